"""Each build of the native CPU kernels against a float64 torch reference, and the runtime choice
between them.

kernels/native/build.py builds the same sources twice (`ISAS`: "avx2", and "avx512" with
512-bit micro-kernels); kernels/native/library.py picks one per process (`choose_isa`,
`MOE_ENGINE_CPU_ISA`). Every kernel test here runs once per variant through the `variant`
fixture: `load_variant` builds and loads that build beside the process's own, and `using` makes
the kernel objects call it. The AVX-512 variant is skipped, naming the flags the CPU lacks,
where it cannot run; the AVX2 one must build (a build failure is a failure).

Shapes are small and odd on purpose: 1-13 rows (the AVX-512 kernels block 12 rows, the AVX2
ones 6; 1-4 rows unroll k by up to 8 and 4-bit experts with 1-2 rows take the 64-byte-chunk
kernel when the block size is a multiple of 8), K not a multiple of the unroll, N not a
multiple of the 16-column tile, int4 groups of 6 (k pairs left over after the unroll), 8 and 32.
Fresh random inputs each run.
"""

from __future__ import annotations

import pytest
import torch

from kernels.dense import amx as cpu_amx
from kernels.dense.native_linear import PackedLinear
from kernels.dense.native_linear_q4 import DOT_FLAG, PackedQuantLinear
from kernels.moe.native import PackedExperts, PackedQuantExperts
from kernels.moe.reference import fused_moe_reference
from kernels.native.build import ISAS
from kernels.native.library import (
    ISA_ENV,
    VECTOR_BITS,
    check_status,
    choose_isa,
    isa_unsupported_reason,
    load_native,
    load_variant,
    using,
)
from quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

ROWS = range(1, 14)


@pytest.fixture(params=ISAS)
def variant(request) -> str:
    """Run the test on the library variant `request.param` (skipped where the CPU lacks it)."""
    isa = request.param
    why = isa_unsupported_reason(isa)
    if why is not None:
        pytest.skip(f"the {isa} kernels cannot run here: {why}")
    module = load_variant(isa)
    assert module.moe_engine_vector_bits() == VECTOR_BITS[isa]
    with using(module):
        yield isa


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


# ------------------------------------------------------------------------------------------
# Kernels, per variant


@pytest.mark.parametrize(("n", "k"), [(37, 29), (16, 3), (50, 64)])
@pytest.mark.parametrize("bf16_weights", [False, True])
def test_linear_every_row_count(variant, n, k, bf16_weights):
    g = _gen()
    w = torch.randn(n, k, generator=g)
    if bf16_weights:
        w = w.bfloat16().float()
    b = torch.randn(n, generator=g)
    packed = PackedLinear.pack(w, b)
    assert packed.weight.dtype == (torch.bfloat16 if bf16_weights else torch.float32)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        want = x.double() @ w.double().t() + b.double()
        torch.testing.assert_close(packed(x).double(), want, rtol=1e-5, atol=1e-4,
                                   msg=lambda s, m=m: f"{variant}, {m} rows: {s}")


@pytest.mark.parametrize(("method", "scale_dtype", "n", "k", "group"), [
    ("int4", torch.float32, 37, 30, 6), ("int4", torch.bfloat16, 50, 64, 32),
    ("int4", torch.float16, 16, 40, 8), ("mxfp4", None, 37, 64, 32),
])
def test_4bit_linear_every_row_count(variant, method, scale_dtype, n, k, group):
    """`--quantized-layers all`'s projections (csrc/linear_q4_cpu.cpp): 1-13 rows (the 4-bit
    micro-kernels), 97 and 200 (tiles dequantized per row chunk); float32 and bfloat16 inputs;
    against x @ quant/'s own dequantization of the same weight in float64."""
    g = _gen()
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    if method == "int4":
        want_w = dequantize_int4(*quantize_int4(w, group, scale_dtype=scale_dtype),
                                 dtype=torch.float64)
    else:
        want_w = dequantize_mxfp4(*quantize_mxfp4(w), torch.float64)
    packed = PackedQuantLinear.quantize(w, b, method, group, scale_dtype or torch.float32)
    assert torch.equal(packed.dequantized.double(), want_w)
    for m in (*ROWS, 97, 200):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            x = torch.randn(m, k, generator=g).to(dtype)
            got = packed(x)
            assert got.dtype == dtype and got.shape == (m, n)
            want = x.double() @ want_w.t() + b.double()
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol,
                                       msg=lambda s, m=m, d=dtype: f"{variant}, {m} rows {d}: {s}")


def _q4_row(packed: PackedQuantLinear, x: torch.Tensor, dot: bool, threads: int = 2
            ) -> torch.Tensor:
    """moe_linear_q4 of bfloat16 rows x [M, K] (contiguous) into float32 [M, N], with or
    without the format's VDPBF16PS bit, on the variant in use."""
    lib = load_native("linear_q4_cpu")
    codes, scales, fmt, bias = packed.weight_args
    fmt = (fmt & ~DOT_FLAG) | (DOT_FLAG if dot else 0)
    y = torch.empty(x.shape[0], packed.out_features)
    check_status(lib.moe_linear_q4(x.data_ptr(), 1, x.shape[0], packed.in_features, codes,
                                   scales, None, fmt, packed.group_size, packed.out_features,
                                   bias, y.data_ptr(), 0, threads), "linear_q4")
    return y


@pytest.mark.parametrize(("method", "scale_dtype", "n", "k", "group"), [
    ("int4", torch.bfloat16, 50, 256, 128), ("int4", torch.float32, 37, 96, 32),
    ("int4", torch.float16, 16, 64, 16), ("mxfp4", None, 40, 128, 32),
    ("int4", torch.bfloat16, 21, 64, 8),  # G % 16 != 0: the float32 kernel
])
def test_4bit_linear_one_bf16_row_on_vdpbf16ps(variant, method, scale_dtype, n, k, group):
    """A bfloat16 row with the format's DOT_FLAG (csrc/linear_q4_cpu.cpp `dot_tile`, the
    batch-1 decode of `--quantized-layers all` where the bf16 kernels run): float32 outputs
    against float64, equal on 1 and 2 threads. The path is told apart by VDPBF16PS treating
    denormal inputs as zero: rows of denormals give exact zeros on it, and not on the float32
    kernel (the AVX2 build, groups not a multiple of 16)."""
    if not cpu_amx.dot_available():
        pytest.skip("AVX512-BF16 unavailable: the CPU lacks it")
    g = _gen()
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    packed = PackedQuantLinear.quantize(w, b, method, group, scale_dtype or torch.float32)
    want_w = packed.dequantized.double()
    for _ in range(3):
        x = torch.randn(1, k, generator=g).bfloat16()
        want = x.double() @ want_w.t() + b.double()
        got = _q4_row(packed, x, dot=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_q4_row(packed, x, dot=False), got, rtol=1e-5, atol=1e-5)
        assert torch.equal(_q4_row(packed, x, dot=True, threads=1), got)
    unbiased = PackedQuantLinear.quantize(w * 1e4, None, method, group,
                                          scale_dtype or torch.float32)
    tiny = torch.full((1, k), 2e-39).bfloat16()  # bfloat16 denormals
    on_dot = variant == "avx512" and group % 16 == 0
    assert bool((_q4_row(unbiased, tiny, dot=True) == 0).all()) == on_dot
    assert bool((_q4_row(unbiased, tiny, dot=False) != 0).any())


@pytest.mark.parametrize(("method", "scale_dtype", "group"), [
    ("mxfp4", None, 32), ("int4", torch.bfloat16, 128), ("int4", torch.float16, 16)])
def test_4bit_linear_bf16_rows_on_vdpbf16ps_match_one_row(variant, method, scale_dtype, group):
    """2-8 bfloat16 rows with DOT_FLAG run two at a time on VDPBF16PS (csrc/q4_dot_avx512.h
    `dot_tile_rows`): every row's result equals that row alone (bit for bit: a row's arithmetic
    does not depend on its neighbours) and float64 within float32 rounding; 9 rows (past
    kDotMaxRows) and the AVX2 build take the float32 kernels, which agree within float32
    rounding."""
    if not cpu_amx.dot_available():
        pytest.skip("AVX512-BF16 unavailable: the CPU lacks it")
    g = _gen()
    n, k = 45, 256
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    packed = PackedQuantLinear.quantize(w, b, method, group, scale_dtype or torch.float32)
    want_w = packed.dequantized.double()
    for m in (2, 3, 5, 8, 9):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = _q4_row(packed, x, dot=True)
        want = x.double() @ want_w.t() + b.double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        alone = torch.cat([_q4_row(packed, x[i:i + 1].contiguous(), dot=True) for i in range(m)])
        if m <= 8 and variant == "avx512":  # the AVX2 build's float32 kernels block rows
            assert torch.equal(got, alone), f"{m} rows differ from each row alone"
        assert torch.equal(_q4_row(packed, x, dot=True, threads=1), got)


def _one_expert_routing(g: torch.Generator, t: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top-2 routing that gives expert 0 all t tokens and spreads the second slot over the
    others: expert 0 runs a t-row block, the rest fewer."""
    weights = torch.softmax(torch.randn(t, 2, generator=g), -1)
    ids = torch.stack([torch.zeros(t, dtype=torch.int32),
                       1 + torch.arange(t, dtype=torch.int32) % (e - 1)], dim=1)
    return weights, ids


def _reference(hidden, w13, w2, weights, ids) -> torch.Tensor:
    return fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_every_row_count(variant, dtype):
    g = _gen()
    e, h, inter = 4, 37, 21  # neither a multiple of the tile nor of the unroll
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    packed = PackedExperts.pack(w13, w2)
    assert packed.w13.dtype == dtype
    for t in ROWS:
        hidden = torch.randn(t, h, generator=g)
        weights, ids = _one_expert_routing(g, t, e)
        torch.testing.assert_close(
            packed(hidden, weights, ids).double(), _reference(hidden, w13, w2, weights, ids),
            rtol=1e-4, atol=1e-4, msg=lambda s, t=t: f"{variant}, {t} rows: {s}")


def _int4_experts(g, e, h, inter, group, symmetric, scale_dtype):
    """(packed experts, dequantized float64 w13, w2)."""
    out, deq = [], []
    for shape in ((e, 2 * inter, h), (e, h, inter)):
        w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
        packed, scales, zeros = quantize_int4(w, group, symmetric=symmetric,
                                              scale_dtype=scale_dtype)
        out.append([Int4Weight(packed[i], scales[i], None if zeros is None else zeros[i])
                    for i in range(e)])
        deq.append(dequantize_int4(packed, scales, zeros, dtype=torch.float64))
    return PackedQuantExperts.from_int4(*out), *deq


@pytest.mark.parametrize(("group", "h", "inter"), [(6, 30, 18), (8, 40, 24), (32, 64, 32)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_experts_every_row_count(variant, group, h, inter, scale_dtype, symmetric):
    g = _gen()
    e = 4
    packed, d13, d2 = _int4_experts(g, e, h, inter, group, symmetric, scale_dtype)
    for t in ROWS:
        hidden = torch.randn(t, h, generator=g)
        weights, ids = _one_expert_routing(g, t, e)
        torch.testing.assert_close(
            packed(hidden, weights, ids).double(), _reference(hidden, d13, d2, weights, ids),
            rtol=1e-4, atol=1e-4, msg=lambda s, t=t: f"{variant}, {t} rows: {s}")


@pytest.mark.parametrize(("h", "inter"), [(64, 32), (96, 160)])
def test_mxfp4_experts_every_row_count(variant, h, inter):
    g = _gen()
    e = 4
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    packed = PackedQuantExperts.from_mxfp4(q13, q2)
    d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    for t in ROWS:
        hidden = torch.randn(t, h, generator=g)
        weights, ids = _one_expert_routing(g, t, e)
        torch.testing.assert_close(
            packed(hidden, weights, ids).double(), _reference(hidden, d13, d2, weights, ids),
            rtol=1e-4, atol=1e-4, msg=lambda s, t=t: f"{variant}, {t} rows: {s}")


@pytest.mark.parametrize("t", [1, 2, 13])
def test_mxfp4_subnormal_and_nan_scales(variant, t):
    """E8M0 bytes 0-3 (2^-127 is a float32 subnormal) decode exactly in every kernel (one row,
    two, and a dequantized tile); byte 255 is NaN and stays in its column."""
    g = _gen()
    e, h, inter = 3, 64, 32
    w13 = torch.randn(e, 2 * inter, h, generator=g)
    w2 = torch.randn(e, h, inter, generator=g)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    q13 = (q13[0], torch.randint(0, 4, q13[1].shape, generator=g, dtype=torch.uint8))
    nan_scales = q2[1].clone()
    nan_scales[0, 5, 0] = 255  # expert 0, output column 5, first block
    q2 = (q2[0], nan_scales)
    packed = PackedQuantExperts.from_mxfp4(q13, q2)
    d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    hidden = torch.randn(t, h, generator=g) * 1e30  # products of 2^-127 scales stay normal
    weights, ids = _one_expert_routing(g, t, e)
    got, want = packed(hidden, weights, ids).double(), _reference(hidden, d13, d2, weights, ids)
    assert torch.isnan(got[:, 5]).all() and not torch.isnan(got[:, :5]).any()
    keep = torch.ones(h, dtype=torch.bool)
    keep[5] = False
    torch.testing.assert_close(got[:, keep], want[:, keep], rtol=1e-4,
                               atol=1e-4 * float(want[:, keep].abs().max()))


@pytest.mark.parametrize("method", ["bf16", "int4", "mxfp4"])
def test_decode_sizes_of_the_bench_model(variant, method):
    """The shapes a batch-1 decode step runs (bench-qwen3-moe: hidden 512, experts of 256,
    int4 groups of 128) at 1, 2 and 4 tokens, top-4 of 8 experts."""
    g = _gen()
    e, h, inter = 8, 512, 256
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    if method == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        packed, d13, d2 = PackedExperts.pack(w13, w2), w13, w2
    elif method == "int4":
        packed, d13, d2 = _int4_experts(g, e, h, inter, 128, True, torch.float32)
    else:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        packed = PackedQuantExperts.from_mxfp4(q13, q2)
        d13, d2 = dequantize_mxfp4(*q13, torch.float64), dequantize_mxfp4(*q2, torch.float64)
    for t in (1, 2, 4):
        hidden = torch.randn(t, h, generator=g)
        weights, ids = torch.softmax(torch.randn(t, e, generator=g), -1).topk(4, dim=-1)
        torch.testing.assert_close(
            packed(hidden, weights, ids.int()).double(),
            _reference(hidden, d13, d2, weights, ids.int()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [False, None])
def test_decode_attention(variant, dtype, amx):
    """Paged decode attention (the AVX-512 build's 16-column values pass, D 16 and 80 taking
    its one-register tail; bf16 with D 64 the AMX scores where the process runs them) against
    a float64 reference, with a sliding window."""
    from test_native_attention_linear import _paged
    from test_native_attention_linear import _reference as attention_reference

    from kernels.attention.native_decode import paged_decode_attention

    g = _gen()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for hq, hkv, d, block_size in ((8, 2, 64, 16), (6, 2, 80, 8), (4, 4, 16, 16)):
        lens = [1, 17, int(torch.randint(2, 120, (1,), generator=g))]
        k_cache, v_cache, tables = _paged(g, lens, hkv, d, block_size, dtype)
        q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
        for window in (None, 9):
            got = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens),
                                         d**-0.5, sliding_window=window, amx=amx)
            want = attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5, window)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------
# The choice of variant

AVX2_FLAGS = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


def test_auto_takes_the_widest_variant_the_cpu_runs(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    isa, why = choose_isa(flags=AVX512_FLAGS)
    assert isa == "avx512" and "avx512bw" in why
    isa, why = choose_isa(flags=AVX2_FLAGS)
    assert isa == "avx2" and "lacks avx512f, avx512bw, avx512vl, avx512dq" in why
    # AVX-512F alone (no BW/VL/DQ, e.g. Knights Landing) is not enough
    assert choose_isa(flags=AVX2_FLAGS | {"avx512f"})[0] == "avx2"


def test_the_environment_overrides_and_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert choose_isa(flags=AVX512_FLAGS) == ("avx2", f"{ISA_ENV}=avx2")
    monkeypatch.setenv(ISA_ENV, "avx512")
    assert choose_isa(flags=AVX512_FLAGS)[0] == "avx512"
    with pytest.raises(ValueError, match=rf"{ISA_ENV}=avx512: cannot run the avx512 kernels "
                                         r"here: this CPU lacks avx512f, avx512bw"):
        choose_isa(flags=AVX2_FLAGS)
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=r"unknown instruction set 'sse9'; use auto, avx2, avx512"):
        choose_isa(flags=AVX512_FLAGS)


def test_no_avx2_leaves_the_native_kernels_unavailable(monkeypatch):
    from kernels.native.library import NativeUnavailable

    monkeypatch.delenv(ISA_ENV, raising=False)
    with pytest.raises(NativeUnavailable, match="lacks avx2"):
        choose_isa(flags=frozenset({"sse2", "avx"}))


def test_the_process_library_is_the_chosen_variant_and_the_plan_says_so():
    from kernels.native.library import load_native, loaded_isa
    from kernels.registry import choose_kernels

    isa, why = choose_isa()
    assert load_native("linear_cpu").moe_engine_vector_bits() == VECTOR_BITS[isa]
    assert loaded_isa() == f"{isa} ({why})"
    plan = choose_kernels("cpu")
    assert plan.native_isa == loaded_isa()
    assert f"native-cpu build: {isa} ({why})" in plan.describe()
    assert plan.info() == {**plan.as_dict(), "native_cpu_isa": isa}
