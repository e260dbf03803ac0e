"""The native CPU MoE kernel on 4-bit experts (MXFP4, int4) against a float64 reference.

The reference is `kernels.moe.reference.fused_moe_reference` in float64 on the dequantized weights
(`quant.mxfp4.dequantize_mxfp4`, `quant.int4.dequantize_int4`); the kernel decodes the same
values in registers and accumulates in float32, so results agree to float32 rounding. Fresh
random inputs each run; the kernel must build here (a build failure is a test failure, not a
skip).

MXFP4 blocks (32) and int4 groups of 32/64/128 make H and I multiples of 32, so their 16-column
tiles never need padding; int4 groups of 8 (accepted by `quant.int4.check_group_size`) let H and
I be multiples of 8 only, which is how the padded tiles are exercised.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.native import (
    PackedQuantExperts,
    pack_q4_tiles,
    pack_tiles,
    unpack_q4_tiles,
    unpack_tiles,
)
from kernels.moe.reference import fused_moe_reference
from kernels.native.library import _build
from quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    _build("moe_cpu")  # raises NativeUnavailable with the compiler's message


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _routing(g, t, e, k):
    logits = torch.randn(t, e, generator=g)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return topk_weights, topk_ids.to(torch.int32)


def _weights(g, e, h, inter):
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    return w13, w2


def _mxfp4(w13, w2):
    """(packed experts, dequantized float64 w13, w2)."""
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    deq = (dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64))
    return PackedQuantExperts.from_mxfp4(q13, q2), *deq


def _int4_list(w, group, symmetric):
    packed, scales, zeros = quantize_int4(w, group, symmetric=symmetric)
    ws = [Int4Weight(packed[e], scales[e], None if zeros is None else zeros[e])
          for e in range(len(w))]  # fmt: skip
    return ws, dequantize_int4(packed, scales, zeros, dtype=torch.float64)


def _int4(w13, w2, group, symmetric=True):
    l13, d13 = _int4_list(w13, group, symmetric)
    l2, d2 = _int4_list(w2, group, symmetric)
    return PackedQuantExperts.from_int4(l13, l2), d13, d2


def _reference(hidden, w13, w2, weights, ids, activation=SILU_AND_MUL, b13=None, b2=None):
    b13, b2 = (None if b is None else b.double() for b in (b13, b2))
    return fused_moe_reference(hidden.double(), w13, w2, weights, ids, activation=activation,
                               b13=b13, b2=b2)  # fmt: skip


def _check(got, want, tol=1e-4):
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------
# Layout: pack / unpack


def test_q4_tile_layout_is_the_documented_nibble_order():
    """Byte i (< 8) of row k of a tile holds column i + 4 * (i // 4) in its low nibble and that
    column + 4 in its high nibble; the 8 bytes of k + 1 follow those of k."""
    g = _gen()
    codes = torch.randint(0, 16, (2, 37, 6), generator=g, dtype=torch.uint8)
    packed = pack_q4_tiles(codes)
    assert packed.shape == (2, 3, 3, 16) and packed.dtype == torch.uint8
    for e in range(2):
        for t in range(3):
            for k in range(6):
                for i in range(8):
                    byte = int(packed[e, t, k // 2, 8 * (k % 2) + i])
                    col = 16 * t + i + 4 * (i // 4)
                    low = int(codes[e, col, k]) if col < 37 else 0
                    high = int(codes[e, col + 4, k]) if col + 4 < 37 else 0
                    assert (byte & 15, byte >> 4) == (low, high)
    assert torch.equal(unpack_q4_tiles(packed, 37), codes)
    scales = torch.randn(2, 37, 3, generator=g)
    assert torch.equal(unpack_tiles(pack_tiles(scales), 37), scales)
    with pytest.raises(ValueError, match="15"):
        pack_q4_tiles(torch.full((1, 4, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_q4_tiles(torch.zeros(1, 4, 5, dtype=torch.uint8))


def test_mxfp4_pack_round_trip_is_bit_exact():
    g = _gen()
    e, h, inter = 3, 64, 96
    w13, w2 = _weights(g, e, h, inter)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    scales = q13[1].clone()
    scales.view(-1)[:4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)  # extremes too
    q13 = (q13[0], scales)
    packed = PackedQuantExperts.from_mxfp4(q13, q2)
    assert packed.w13_codes.shape == (e, 2, inter // 16, h // 2, 16)
    assert packed.w13_scales.shape == (e, 2, inter // 16, h // 32, 16)
    assert packed.w2_codes.shape == (e, h // 16, inter // 2, 16)
    assert packed.nbytes == sum(t.numel() for t in (*q13, *q2))  # 4.25 bits per weight
    r13, r2 = packed.to_mxfp4()
    for got, want in zip((*r13, *r2), (*q13, *q2), strict=True):
        assert got.dtype == torch.uint8 and torch.equal(got, want)
    with pytest.raises(ValueError, match="int4"):
        packed.to_int4()
    with pytest.raises(ValueError, match="mxfp4 experts"):
        PackedQuantExperts.from_mxfp4(q13, (q2[0][:, :, :1], q2[1][:, :, :1]))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [8, 32, 64, 128])
def test_int4_pack_round_trip_is_exact(group, symmetric):
    g = _gen()
    w13, w2 = _weights(g, 3, 128, 40 if group == 8 else 128)
    l13, _ = _int4_list(w13, group, symmetric)
    l2, _ = _int4_list(w2, group, symmetric)
    l13 = [w._replace(scales=w.scales.bfloat16()) for w in l13]  # a checkpoint's scale dtype
    l2 = [w._replace(scales=w.scales.bfloat16()) for w in l2]
    packed = PackedQuantExperts.from_int4(l13, l2)
    assert packed.w13_zeros.numel() == (0 if symmetric else packed.w13_scales.numel())
    r13, r2 = packed.to_int4()
    for got, want in zip(r13 + r2, l13 + l2, strict=True):
        assert torch.equal(got.packed, want.packed)
        assert got.scales.dtype == torch.bfloat16 and torch.equal(got.scales, want.scales)
        assert (got.zeros is None) == symmetric
        if not symmetric:
            assert torch.equal(got.zeros, want.zeros)


def test_int4_mixed_zero_points_and_shape_errors():
    g = _gen()
    w13, w2 = _weights(g, 2, 64, 32)
    l13, d13 = _int4_list(w13, 32, symmetric=False)
    l2, d2 = _int4_list(w2, 32, symmetric=True)  # symmetric: zero point 8 in the packed form
    packed = PackedQuantExperts.from_int4(l13, l2)
    hidden = torch.randn(5, 64, generator=g)
    weights, ids = _routing(g, 5, 2, 2)
    _check(packed(hidden, weights, ids), _reference(hidden, d13, d2, weights, ids))
    with pytest.raises(ValueError, match="group sizes"):
        PackedQuantExperts.from_int4(l13, _int4_list(w2, 16, True)[0])
    with pytest.raises(ValueError, match="w13"):
        PackedQuantExperts.from_int4(l13, l2[:1])


# ------------------------------------------------------------------------------------------
# The kernel against the float64 reference


CASES = [
    (1, 64, 32, 8, 2),      # one token: 1-row blocks
    (2, 96, 64, 4, 2),      # 2 rows per expert at most
    (13, 64, 96, 6, 3),     # 3-6 rows per expert
    (37, 64, 32, 4, 4),     # top_k == num_experts, more than 6 rows per expert
    (200, 32, 64, 16, 4),   # many 6-row blocks: tiles dequantized once per expert
]


@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), CASES)
def test_mxfp4_matches_float64_reference(t, h, inter, e, k):
    g = _gen()
    packed, d13, d2 = _mxfp4(*_weights(g, e, h, inter))
    hidden = torch.randn(t, h, generator=g)
    weights, ids = _routing(g, t, e, k)
    _check(packed(hidden, weights, ids), _reference(hidden, d13, d2, weights, ids))


@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), CASES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_matches_float64_reference(t, h, inter, e, k, symmetric):
    g = _gen()
    group = 32
    packed, d13, d2 = _int4(*_weights(g, e, h, inter), group, symmetric)
    hidden = torch.randn(t, h, generator=g)
    weights, ids = _routing(g, t, e, k)
    _check(packed(hidden, weights, ids), _reference(hidden, d13, d2, weights, ids))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_int4_group_sizes(group, symmetric, t):
    g = _gen()
    packed, d13, d2 = _int4(*_weights(g, 6, 256, 128), group, symmetric)
    hidden = torch.randn(t, 256, generator=g)
    weights, ids = _routing(g, t, 6, 2)
    _check(packed(hidden, weights, ids), _reference(hidden, d13, d2, weights, ids))


@pytest.mark.parametrize("t", [1, 4, 30])
def test_int4_padded_tiles(t):
    """Groups of 8: H = 40 and I = 24 are not multiples of the 16-column tile."""
    g = _gen()
    packed, d13, d2 = _int4(*_weights(g, 5, 40, 24), 8, symmetric=False)
    assert packed.w13_codes.shape[2] == 2 and packed.w2_codes.shape[1] == 3
    hidden = torch.randn(t, 40, generator=g)
    weights, ids = _routing(g, t, 5, 2)
    b13, b2 = torch.randn(5, 48, generator=g), torch.randn(5, 40, generator=g)
    got = packed(hidden, weights, ids, activation=GPT_OSS, b13=b13, b2=b2)
    _check(got, _reference(hidden, d13, d2, weights, ids, GPT_OSS, b13, b2))


@pytest.mark.parametrize("method", ["mxfp4", "int4"])
def test_remote_slots_zero_tokens_and_idle_experts(method):
    g = _gen()
    w13, w2 = _weights(g, 8, 64, 32)
    packed, d13, d2 = _mxfp4(w13, w2) if method == "mxfp4" else _int4(w13, w2, 32, False)
    hidden = torch.randn(19, 64, generator=g)
    weights, ids = _routing(g, 19, 8, 2)
    ids[::3, 1] = -1  # slots of other ranks' experts
    ids[ids == 5] = 6  # expert 5 gets no token
    ids[4, 0] = 8  # an id past this rank's experts: skipped too
    ids[7] = -1  # a token routed to no local expert: a zero row
    got = packed(hidden, weights, ids.long())
    _check(got, _reference(hidden, d13, d2, weights, ids))
    assert got[7].abs().max() == 0
    assert packed(hidden, weights, torch.full_like(ids, -1)).abs().max() == 0
    assert packed(hidden[:0], weights[:0], ids[:0]).shape == (0, 64)


@pytest.mark.parametrize("method", ["mxfp4", "int4"])
@pytest.mark.parametrize("t", [1, 2, 5, 23])
def test_gpt_oss_clamped_activation_and_biases(method, t):
    g = _gen()
    w13, w2 = _weights(g, 8, 64, 64)
    packed, d13, d2 = _mxfp4(w13, w2) if method == "mxfp4" else _int4(w13, w2, 64, True)
    hidden = torch.randn(t, 64, generator=g) * 4  # push gate/up past the clamp limit
    weights, ids = _routing(g, t, 8, 4)
    b13, b2 = torch.randn(8, 128, generator=g), torch.randn(8, 64, generator=g)
    got = packed(hidden, weights, ids, activation=GPT_OSS, b13=b13, b2=b2)
    _check(got, _reference(hidden, d13, d2, weights, ids, GPT_OSS, b13, b2))
    plain = packed(hidden, weights, ids, b13=b13, b2=b2)
    assert (plain - got).abs().max() > 1e-2  # the activation really differs


def test_bfloat16_activations():
    g = _gen()
    packed, d13, d2 = _mxfp4(*_weights(g, 4, 64, 32))
    hidden = torch.randn(9, 64, generator=g).bfloat16()
    weights, ids = _routing(g, 9, 4, 2)
    got = packed(hidden, weights, ids)
    assert got.dtype == torch.bfloat16
    want = _reference(hidden, d13, d2, weights, ids)  # on the same bf16 inputs
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_call_rejects_what_the_kernel_would_misread():
    import dataclasses

    g = _gen()
    packed, _, _ = _mxfp4(*_weights(g, 4, 64, 32))
    weights, ids = _routing(g, 3, 4, 2)
    with pytest.raises(RuntimeError, match="hidden size 64"):
        packed(torch.randn(3, 32, generator=g), weights, ids)
    with pytest.raises(RuntimeError, match="topk_ids must be"):
        packed(torch.randn(2, 64, generator=g), weights, ids)
    with pytest.raises(RuntimeError, match="biases must be"):
        packed(torch.randn(3, 64, generator=g), weights, ids, b13=torch.zeros(4, 3),
               b2=torch.zeros(4, 64))
    with pytest.raises(RuntimeError, match="group size 16"):
        dataclasses.replace(packed, group_size=16)(torch.randn(3, 64, generator=g), weights, ids)
    with pytest.raises(RuntimeError, match="scales must be"):
        dataclasses.replace(packed, w2_scales=packed.w2_scales.float())(
            torch.randn(3, 64, generator=g), weights, ids)


@pytest.mark.parametrize("t", [1, 4, 20])
def test_mxfp4_subnormal_and_nan_scales_decode_exactly(t):
    """E8M0 bytes 0-3 (2^-127 is an fp32 subnormal) decode exactly: with activations of 1e30
    the products are normal floats and the result is compared relatively. Byte 255 is NaN."""
    g = _gen()
    w13, w2 = _weights(g, 4, 64, 32)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    tiny = torch.randint(0, 4, q13[1].shape, generator=g, dtype=torch.uint8)
    q13 = (q13[0], tiny)
    packed = PackedQuantExperts.from_mxfp4(q13, q2)
    d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    hidden = torch.randn(t, 64, generator=g) * 1e30
    weights, ids = _routing(g, t, 4, 2)
    want = _reference(hidden, d13, d2, weights, ids)
    got = packed(hidden, weights, ids).double()
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    nan_scales = q2[1].clone()
    nan_scales[int(ids[0, 0]), 0, 0] = 255
    with_nan = PackedQuantExperts.from_mxfp4(q13, (q2[0], nan_scales))
    out = with_nan(hidden, weights, ids)
    assert torch.isnan(out[0, 0]) and not torch.isnan(out[0, 1:]).any()


# ------------------------------------------------------------------------------------------
# The engine's layer


def _layer_case(g, e=8, h=64, inter=64, t=11, k=2):
    w13, w2 = _weights(g, e, h, inter)
    hidden = torch.randn(t, h, generator=g)
    weights, ids = _routing(g, t, e, k)
    return w13, w2, hidden, weights, ids


@pytest.mark.parametrize("t", [1, 11, 50])
def test_quantized_experts_use_the_native_kernel(t):
    from kernels.plan import KernelPlan
    from moe_engine.models.layers.quantized_experts import QuantizedExperts

    g = _gen()
    w13, w2, hidden, weights, ids = _layer_case(g, t=t)
    b13, b2 = torch.randn(8, 128, generator=g), torch.randn(8, 64, generator=g)
    for method, group in (("mxfp4", 32), ("int4", 32), ("int4", 64)):
        experts = QuantizedExperts(w13, w2, method, group, activation=GPT_OSS, b13=b13, b2=b2)
        canonical_bytes = experts.nbytes
        experts.bind_kernels(KernelPlan.uniform("native-cpu"))
        assert experts.backend == "native-cpu" and not experts._held  # one layout only
        assert experts.nbytes == canonical_bytes  # tiles of 16 rows: no padding here
        if method == "mxfp4":
            q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
            d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
        else:
            d13 = dequantize_int4(*quantize_int4(w13, group), dtype=torch.float64)
            d2 = dequantize_int4(*quantize_int4(w2, group), dtype=torch.float64)
        got = experts(hidden, weights, ids)
        want = _reference(hidden, d13, d2, weights, ids, GPT_OSS, b13, b2)
        _check(got, want)
        # the canonical layout comes back exactly from the native tiles
        canonical = experts.canonical()
        if method == "mxfp4":
            assert torch.equal(canonical.w13_blocks, q13[0])
            assert torch.equal(canonical.w2_scales, q2[1])
        else:
            packed, scales, _ = quantize_int4(w2, group)
            assert torch.equal(canonical.w2_packed, packed)
            assert torch.equal(canonical.w2_scales, scales) and canonical.w2_zeros is None
        # bound again to torch: its path, on the weights given back by the native layout
        experts.bind_kernels(KernelPlan.uniform("torch"))
        fallback = experts(hidden, weights, ids)
        if method == "mxfp4":
            torch.testing.assert_close(fallback.double(), want, rtol=1e-4, atol=1e-4)
        else:  # the torch int4 matmul takes bfloat16 activations
            assert (fallback.double() - want).norm() < 2e-2 * want.norm()


def test_quantized_experts_from_checkpoint_formats_use_the_native_kernel():
    from kernels.plan import KernelPlan
    from moe_engine.models.layers.quantized_experts import QuantizedExperts

    native = KernelPlan.uniform("native-cpu")
    g = _gen()
    w13, w2, hidden, weights, ids = _layer_case(g, t=7)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    experts = QuantizedExperts.from_mxfp4(q13, q2)
    experts.bind_kernels(native)
    assert experts.backend == "native-cpu"
    d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    _check(experts(hidden, weights, ids), _reference(hidden, d13, d2, weights, ids))
    l13, d13 = _int4_list(w13, 64, symmetric=False)
    l2, d2 = _int4_list(w2, 64, symmetric=False)
    experts = QuantizedExperts.from_int4(l13, l2)
    experts.b13, experts.b2 = torch.randn(8, 128, generator=g), torch.randn(8, 64, generator=g)
    experts.bind_kernels(native)
    assert experts.backend == "native-cpu"
    want = _reference(hidden, d13, d2, weights, ids, b13=experts.b13, b2=experts.b2)
    _check(experts(hidden, weights, ids), want)


def test_unbound_quantized_experts_run_torch():
    """A module nobody bound runs torch (the engine always binds); the canonical MXFP4 layout
    is what it reads."""
    from moe_engine.models.layers.quantized_experts import QuantizedExperts

    g = _gen()
    w13, w2, hidden, weights, ids = _layer_case(g, t=5)
    experts = QuantizedExperts(w13, w2, "mxfp4", 32)
    assert experts.backend is None
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    want = _reference(hidden, d13, d2, weights, ids)
    torch.testing.assert_close(experts(hidden, weights, ids).double(), want, rtol=1e-4, atol=1e-4)
    assert experts.backend == "torch" and experts._held


@pytest.mark.parametrize("method", ["mxfp4", "int4", "int4-asym"])
def test_bfloat16_rows_on_the_bf16_dot_products(method):
    """bfloat16 calls: where the bf16 kernels run, `weight_args` carries `DOT_FLAG` and the
    products run on VDPBF16PS (exact products, float32 sums, the intermediate rounded once to
    bfloat16); asymmetric int4 stays on the float32 kernels. Either agrees with the float64
    reference to bfloat16 rounding, one token with an expert picked twice too; on the dot
    products a token's result in a batch (5 tokens; 40, so that an expert gets more rows than a
    register block) equals its result alone, bit for bit (draft verification relies on it)."""
    from kernels.dense.amx import bf16_backend
    from kernels.moe.native import DOT_FLAG

    g = _gen()
    w13, w2 = _weights(g, 8, 256, 128)
    if method == "mxfp4":
        packed, d13, d2 = _mxfp4(w13, w2)
    else:
        packed, d13, d2 = _int4(w13, w2, 64, symmetric=method == "int4")
    dot = bf16_backend() is not None
    assert bool(packed.weight_args.format & DOT_FLAG) == dot
    b13, b2 = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
    for ids in (torch.tensor([[3, 0, 6, 1]]), torch.tensor([[5, 5, 2, -1]]),
                torch.randint(0, 8, (5, 4), generator=g),
                torch.randperm(8 * 40, generator=g).view(40, 8)[:, :4] % 8):
        hidden = torch.randn(len(ids), 256, generator=g).bfloat16()
        weights = torch.softmax(torch.randn(len(ids), 4, generator=g), -1)
        got = packed(hidden, weights, ids.int(), activation=GPT_OSS, b13=b13, b2=b2)
        assert got.dtype == torch.bfloat16
        want = _reference(hidden, d13, d2, weights, ids, GPT_OSS, b13, b2)
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-2 * scale)
        if dot and method != "int4-asym":
            alone = torch.cat([packed(hidden[i:i + 1], weights[i:i + 1], ids[i:i + 1].int(),
                                      activation=GPT_OSS, b13=b13, b2=b2)
                               for i in range(len(ids))])
            assert torch.equal(got, alone)
