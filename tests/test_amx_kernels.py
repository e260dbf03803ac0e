"""The AMX bf16 kernels (kernels/native/csrc/amx_gemm.cpp, amx_moe.cpp) against float64 torch
references, on fresh random inputs each run, on each backend this CPU runs (the AMX tiles;
AVX512-BF16, csrc/bf16_dot.cpp); skipped, with the reason, on a CPU or OS with neither
(`kernels.dense.amx.amx_unavailable_reason`), and each backend where it cannot run.

Error bounds: a bfloat16 output is its float32 sum rounded once (half an ulp: <= 2^-9 of its
magnitude, 2^-8 used); the float32 sums differ from float64 by at most K * 2^-24 of the sum of
absolute products. The fused MoE also rounds each SwiGLU output once to bfloat16, so its bound
adds 2^-8 of sum_j w_j * (|act_j| @ |w2|^T).
"""

from __future__ import annotations

import pytest
import torch

from kernels.dense import amx as cpu_amx
from kernels.dense.amx import AmxLinear, amx_unavailable_reason, pack_vnni
from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.amx import AmxExperts
from kernels.moe.reference import fused_moe_reference

pytestmark = pytest.mark.skipif(amx_unavailable_reason() is not None,
                                reason=f"AMX kernels unavailable: {amx_unavailable_reason()}")

GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)


@pytest.fixture(params=[True, False], ids=["amx-tiles", "avx512-bf16"])
def tiles(request) -> bool:
    """The backend under test: the AMX tiles (True) or AVX512-BF16 (False)."""
    if request.param and cpu_amx.reason_no_tiles():
        pytest.skip(f"AMX tiles unavailable: {cpu_amx.reason_no_tiles()}")
    if not request.param and not cpu_amx.dot_available():
        pytest.skip("AVX512-BF16 unavailable: the CPU lacks it")
    return request.param
ROWS = (1, 3, 5, 15, 16, 17, 31, 33, 47, 64, 70)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _bf16(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def test_pack_vnni_unpacks_to_the_weight():
    g = _gen()
    w = _bf16(3, 40, 96, g=g)
    packed = pack_vnni(w)
    assert packed.shape == (3, 3, 48, 16, 2)
    back = packed.permute(0, 1, 3, 2, 4).reshape(3, 48, 96)
    assert torch.equal(back[:, :40], w) and not back[:, 40:].any()
    odd = pack_vnni(_bf16(1, 5, 40, g=g))  # K padded to 64 with zeros
    assert odd.shape == (1, 1, 32, 16, 2) and not odd[:, :, 20:].any()


@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (100, 96), (776, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(n, k, bias, tiles):
    g = _gen()
    w, b = _bf16(n, k, g=g, scale=k**-0.5), (torch.randn(n, generator=g) if bias else None)
    lin = AmxLinear.pack(w, b)
    same = total = 0
    for m in ROWS:
        x = _bf16(m, k, g=g)
        y = lin(x, tiles=tiles)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        xd, wd = x.double(), w.double()
        ref = xd @ wd.T + (b.double() if bias else 0)
        mag = xd.abs() @ wd.abs().T + (b.double().abs() if bias else 0)
        bound = 2**-8 * ref.abs() + (k + 1) * 2**-23 * mag
        err = (y.double() - ref).abs()
        assert (err <= bound).all(), f"m={m}: max error {err.max():.3g}"
        same += int((y == ref.bfloat16()).sum())
        total += y.numel()
    # the one rounding is round-to-nearest-even of a float32 sum: nearly always the float64
    # result's bfloat16 (counted over every batch size: a 16-column row alone is too few)
    assert same / total > 0.99, f"{same} of {total} equal to the float64 result's bfloat16"


def test_linear_bias_is_added_before_the_rounding_as_torch_does(tiles):
    g = _gen()
    w, b = _bf16(48, 64, g=g), _bf16(48, g=g)
    x = _bf16(9, 64, g=g)
    assert torch.equal(AmxLinear.pack(w, b)(x, tiles=tiles), torch.nn.functional.linear(x, w, b))


def test_linear_keeps_leading_dimensions_and_refuses_other_inputs():
    g = _gen()
    lin = AmxLinear.pack(_bf16(20, 32, g=g))
    assert lin(_bf16(2, 3, 32, g=g)).shape == (2, 3, 20)
    with pytest.raises(RuntimeError, match="bfloat16"):
        lin(torch.randn(4, 32))
    with pytest.raises(ValueError, match="K % 32"):
        AmxLinear.pack(_bf16(20, 48, g=g))


def _moe_case(g, t, h, inter, e, k, *, bias=False):
    hidden = _bf16(t, h, g=g)
    w13 = _bf16(e, 2 * inter, h, g=g, scale=h**-0.5)
    w2 = _bf16(e, h, inter, g=g, scale=inter**-0.5)
    topk_weights, topk_ids = torch.softmax(torch.randn(t, e, generator=g), -1).topk(k, dim=-1)
    topk_ids = topk_ids.int()
    if t > 2:  # other ranks' experts: skipped; token 1 has no pair at all
        topk_ids[0, 0], topk_ids[1, :] = -1, e
    b13 = torch.randn(e, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None
    return hidden, w13, w2, topk_weights, topk_ids, b13, b2


def _moe_bound(hidden, w13, w2, weights, ids, act, b13):
    """Per element: 2^-8 sum_j w_j (|w2_j| @ (|act_j| + 2^-8 m_j)), m_j = (|W_gate| @ |x| + 1)
    (|W_up| @ |x| + 1): the SwiGLU output's one rounding, and (loosely) the float32 sums'."""
    e, two_i, _ = w13.shape
    i = two_i // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            x = int(ids[t, j])
            if not 0 <= x < e:
                continue
            gu = w13[x].double() @ hidden[t].double()
            if b13 is not None:
                gu = gu + b13[x].double()
            a = act.apply(gu[:i], gu[i:]).abs()
            mag = w13[x].double().abs() @ hidden[t].double().abs() + 1
            a = a + 2**-8 * mag[:i] * mag[i:]
            out[t] += float(weights[t, j]) * 2**-8 * (w2[x].double().abs() @ a)
    return out


@pytest.mark.parametrize("t", [1, 3, 7, 33, 70])
@pytest.mark.parametrize("h,inter,e,k,bias,act", [
    (64, 32, 4, 2, False, SILU_AND_MUL),
    (96, 40, 8, 3, True, SILU_AND_MUL),    # I and H not multiples of 16 / 32: padded tiles
    (64, 100, 8, 2, True, GPT_OSS),
    (512, 256, 32, 4, False, SILU_AND_MUL),
])
def test_fused_moe_matches_float64(t, h, inter, e, k, bias, act, tiles):
    g = _gen()
    hidden, w13, w2, weights, ids, b13, b2 = _moe_case(g, t, h, inter, e, k, bias=bias)
    experts = AmxExperts.pack(w13, w2, activation=act, b13=b13, b2=b2)
    y = experts(hidden, weights, ids, tiles=tiles)
    assert y.dtype == torch.bfloat16 and y.shape == (t, h)
    ref = fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights.double(), ids,
                              activation=act, b13=None if b13 is None else b13.double(),
                              b2=None if b2 is None else b2.double())
    bound = 2**-8 * ref.abs() + _moe_bound(hidden, w13, w2, weights, ids, act, b13)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"
    if t > 2:
        assert not y[1].any()  # no pair on this rank


def test_fused_moe_int64_ids_and_many_rows_per_expert(tiles):
    g = _gen()
    hidden, w13, w2, weights, ids, _, _ = _moe_case(g, 300, 64, 32, 4, 2)
    experts = AmxExperts.pack(w13, w2)
    y = experts(hidden, weights, ids, tiles=tiles)
    assert torch.equal(y, experts(hidden, weights, ids.long(), tiles=tiles))
    ref = fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights.double(), ids)
    bound = 2**-8 * ref.abs() + _moe_bound(hidden, w13, w2, weights, ids, SILU_AND_MUL, None)
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("h,inter,e,k", [(64, 32, 4, 2), (512, 256, 32, 4)])
def test_fused_moe_row_does_not_depend_on_the_batch(h, inter, e, k, tiles):
    """The one kernel runs every batch size (kernels/moe/backends.py), so a token's output must
    be bit-identical alone, in a decode-sized batch and in a prefill-sized one (1 x 4 and
    2 x 2 tile blocking, one and many rows per expert, other tokens' experts around it)."""
    g = _gen()
    hidden, w13, w2, weights, ids, _, _ = _moe_case(g, 600, h, inter, e, k)
    experts = AmxExperts.pack(w13, w2)
    full = experts(hidden, weights, ids, tiles=tiles)
    for rows in (1, 2, 7, 33, 128, 600):
        start = 599 - rows + 1 if rows < 600 else 0
        part = experts(hidden[start:], weights[start:], ids[start:], tiles=tiles)
        assert torch.equal(part, full[start:]), rows
    alone = torch.stack([experts(hidden[t:t + 1], weights[t:t + 1], ids[t:t + 1],
                                 tiles=tiles)[0] for t in (0, 5, 299, 599)])
    assert torch.equal(alone, full[[0, 5, 299, 599]])


def test_experts_refuse_float32_activations():
    g = _gen()
    hidden, w13, w2, weights, ids, _, _ = _moe_case(g, 4, 64, 32, 4, 2)
    with pytest.raises(RuntimeError, match="hidden must be bfloat16"):
        AmxExperts.pack(w13, w2)(hidden.float(), weights, ids)


def test_bound_float_experts_take_the_amx_kernel_alone():
    from kernels.moe.backends import ExpertExtras, bind_float_experts

    g = _gen()
    _, w13, w2, _, _, _, _ = _moe_case(g, 1, 64, 32, 4, 2)
    bound = bind_float_experts("native-cpu", w13, w2, ExpertExtras())
    assert isinstance(bound.run, AmxExperts)
    assert len(bound.held) == 4  # one packed layout, not the AVX2 one beside it


def test_the_decision_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_amx, "_decided", [])
    monkeypatch.setenv("MOE_ENGINE_AMX", "0")
    with caplog.at_level("INFO", logger="kernels.dense.amx"):
        assert cpu_amx.amx_unavailable_reason() == "disabled by MOE_ENGINE_AMX=0"
        cpu_amx.amx_unavailable_reason()
    assert [r.getMessage() for r in caplog.records] == [
        "AMX bf16 kernels off: disabled by MOE_ENGINE_AMX=0"]


def test_kernels_refuse_to_run_where_amx_was_not_granted(monkeypatch):
    """A tile instruction without Linux's tile-data grant kills the process (SIGILL): the
    wrappers check the process-wide decision first."""
    g = _gen()
    lin = AmxLinear.pack(_bf16(16, 32, g=g))
    hidden, w13, w2, weights, ids, _, _ = _moe_case(g, 4, 64, 32, 4, 2)
    monkeypatch.setattr(cpu_amx, "_decided", [(None, "the CPU lacks AMX-TILE/AMX-BF16")])
    with pytest.raises(RuntimeError, match="cannot run here"):
        lin(_bf16(2, 32, g=g))
    with pytest.raises(RuntimeError, match="cannot run here"):
        AmxExperts.pack(w13, w2)(hidden, weights, ids)


def test_linear_layer_runs_amx_between_its_crossovers(monkeypatch):
    from kernels.plan import KernelPlan
    from moe_engine.models.layers.linear import Linear

    layer = Linear(64, 48, bias=False, dtype=torch.bfloat16)
    layer.bind_kernels(KernelPlan.uniform("native-cpu"))
    calls = []
    monkeypatch.setattr(AmxLinear, "__call__", lambda self, x: calls.append(len(x)) or x)
    g = _gen()
    for rows in (1, cpu_amx.LINEAR_MAX_ROWS, cpu_amx.LINEAR_MAX_ROWS + 1):
        layer(_bf16(rows, 64, g=g))
    layer(_bf16(3, 64, g=g))
    assert calls == [1, cpu_amx.LINEAR_MAX_ROWS, 3]
    float_layer = Linear(64, 48, bias=False, dtype=torch.float32)
    float_layer.bind_kernels(KernelPlan.uniform("native-cpu"))
    assert not float_layer.kernel.amx  # float32 compute: the AVX2 kernel


def test_avx512_bf16_setting_keeps_the_kernels_off_the_tiles(monkeypatch, caplog):
    if not cpu_amx.dot_available():
        pytest.skip("AVX512-BF16 unavailable: the CPU lacks it")
    monkeypatch.setattr(cpu_amx, "_decided", [])
    monkeypatch.setenv("MOE_ENGINE_AMX", "avx512-bf16")
    with caplog.at_level("INFO", logger="kernels.dense.amx"):
        assert cpu_amx.bf16_backend() == cpu_amx.DOT and not cpu_amx.uses_tiles()
        assert cpu_amx.amx_unavailable_reason() is None
    assert [r.getMessage() for r in caplog.records] == [
        "bf16 kernels on AVX512-BF16 (VDPBF16PS; MOE_ENGINE_AMX=avx512-bf16): linear at "
        f"1-{cpu_amx.LINEAR_MAX_ROWS} rows, fused MoE at every batch size, 4-bit linears at "
        "1-8 rows and 4-bit experts"]
    with pytest.raises(RuntimeError, match="AMX tiles cannot run here: MOE_ENGINE_AMX"):
        AmxLinear.pack(_bf16(16, 32, g=_gen()))(_bf16(2, 32, g=_gen()), tiles=True)


def test_both_backends_compute_the_same_sums_up_to_their_order():
    """Where the CPU has both: the tiles and VDPBF16PS multiply the same bfloat16 pairs and
    sum in float32, so their outputs differ by the sums' order only (a bfloat16 ulp or so)."""
    if cpu_amx.reason_no_tiles() or not cpu_amx.dot_available():
        pytest.skip("needs both the AMX tiles and AVX512-BF16")
    g = _gen()
    lin = AmxLinear.pack(_bf16(96, 512, g=g, scale=512**-0.5))
    x = _bf16(40, 512, g=g)
    a, b = lin(x, tiles=True).float(), lin(x, tiles=False).float()
    assert ((a - b).abs() <= 2**-7 * a.abs() + 1e-6).all()
    assert (a == b).float().mean() > 0.9
