"""The 4-bit Triton fused MoE at the tuned tables' tile sizes (`kernels.moe.fused_moe_configs`:
BLOCK_N 128, BLOCK_K 128, BLOCK_M 16/32/64), under Triton's interpreter on the CPU.

The other fused-MoE tests (tests/test_fused_moe_triton.py) use tiny shapes, which the launcher
shrinks to 16- or 32-wide tiles; the packed kernels' group broadcast (several scale groups per K
tile, or one group over several tiles), their one-step-ahead scale prefetch, the nibble split
into two dots and the masking of a partial last K or N tile only run at the real tile sizes.
Two checks, on fresh random inputs each run:

- read-back: one-hot activation rows times the weights return each dequantized weight, which
  must equal `quant.int4.dequantize_int4` / `quant.mxfp4.dequantize_mxfp4` bit for bit (the
  same fp32 product, one rounding to the activation dtype);
- the whole op (GEMM1 + SwiGLU, GEMM2 + routed weight, sum over k) against the float64
  reference on the dequantized weights: relative Frobenius error < 1e-4 (fp32), 1e-2 (bf16).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels.moe.activation import SwiGLU  # noqa: E402
from kernels.moe.fused_moe import (  # noqa: E402
    fused_moe_int4,
    fused_moe_mxfp4,
    invoke_fused_moe_kernel,
    moe_align_block_size,
)
from kernels.moe.fused_moe_configs import MoeTileConfig  # noqa: E402
from kernels.moe.reference import fused_moe_reference  # noqa: E402
from quant.int4 import dequantize_int4, quantize_int4  # noqa: E402
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

TILE_N = TILE_K = 128  # every tuned 4-bit config's BLOCK_N, and its decode buckets' BLOCK_K
RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def read_back(
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    dtype: torch.dtype,
    block_m: int,
    block_k: int = TILE_K,
) -> torch.Tensor:
    """``[E, n, k]`` weights as the kernel dequantizes them, where it reads them: row ``i`` of
    ``eye(k)`` is one pair, routed to expert ``i % E``, so its output row is column ``i`` of that
    expert's weights; the columns of other experts stay NaN (each column index is read once)."""
    experts, n, k = w.shape[0], w.shape[1], w[0, 0].numel() * 2  # two codes per byte
    ids = (torch.arange(k) % experts).to(torch.int32)[:, None]
    out = torch.empty(k, n, dtype=dtype)
    invoke_fused_moe_kernel(
        torch.eye(k, dtype=dtype), w, out, torch.ones(k, 1),
        *moe_align_block_size(ids, block_m, experts), top_k=1, mul_routed_weight=False,
        w_scales=scales, w_zeros=zeros, block_size_m=block_m, block_size_n=TILE_N,
        block_size_k=block_k,
    )  # fmt: skip
    weights = torch.full((experts, n, k), float("nan"), dtype=dtype)
    for e in range(experts):
        weights[e, :, e::experts] = out[e::experts].t()
    return weights


def assert_read_back_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` from :func:`read_back` equals ``want`` bit for bit where the kernel read it."""
    for e in range(got.shape[0]):
        assert torch.equal(got[e, :, e :: got.shape[0]], want[e, :, e :: got.shape[0]]), e


# (group, zero points, scale dtype, activation dtype, BLOCK_M, K, N, BLOCK_K): group 128 spans
# whole tiles (two K steps: the second group row is the prefetched one), or two tiles at the
# large-batch buckets' BLOCK_K 64; group 32 puts 4 groups in a tile, with K 160 (a tile and a
# quarter: masked tail) and N 144 (a masked second N tile).
INT4_CASES = [
    (128, False, torch.float32, torch.float32, 16, 256, 128, 128),
    (128, True, torch.bfloat16, torch.bfloat16, 32, 256, 128, 128),
    (128, True, torch.float32, torch.float32, 64, 256, 128, 64),
    (32, True, torch.float32, torch.float32, 64, 160, 144, 128),
    (32, False, torch.bfloat16, torch.bfloat16, 16, 160, 128, 128),
    (64, True, torch.float16, torch.float32, 16, 192, 128, 128),
]


@pytest.mark.parametrize("group, zeros, scale_dtype, dtype, block_m, k, n, block_k", INT4_CASES)
def test_int4_read_back_is_exact_at_tuned_tiles(
    group: int,
    zeros: bool,
    scale_dtype: torch.dtype,
    dtype: torch.dtype,
    block_m: int,
    k: int,
    n: int,
    block_k: int,
) -> None:
    g = gen()
    w = torch.randn(2, n, k, generator=g)
    packed, scales, zero = quantize_int4(w, group, symmetric=not zeros, scale_dtype=scale_dtype)
    assert scales.dtype == scale_dtype and (zero is not None) == zeros
    got = read_back(packed, scales, zero, dtype, block_m, block_k)
    assert_read_back_equal(got, dequantize_int4(packed, scales, zero, dtype=dtype))


def test_mxfp4_read_back_is_exact_at_tuned_tiles_with_edge_scale_bytes() -> None:
    """Every E2M1 code under E8M0 bytes 0 (2^-127, subnormal products), 1, 127, 253 and 254
    (2^127; small codes there, so nothing overflows), bit for bit; byte 255 makes its weight
    NaN, and so the whole output column of that weight row."""
    g = gen()
    n, k = 128, 160
    codes = torch.randint(0, 16, (2, n, k), generator=g, dtype=torch.uint8)
    codes[:, :, :16] = torch.arange(16, dtype=torch.uint8)  # all 16 codes in a group
    scale_bytes = torch.tensor([0, 1, 126, 127, 128, 253, 254], dtype=torch.uint8)
    scales = scale_bytes[torch.randint(0, 7, (2, n, k // 32), generator=g)]
    scales[:, :8, 0] = torch.tensor([0, 1, 126, 127, 128, 253, 254, 0], dtype=torch.uint8)
    big = (scales >= 253).repeat_interleave(32, dim=-1)
    codes[big] = codes[big] & 0b1011  # |E2M1| <= 1.5 under 2^126, 2^127: stays finite
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(2, n, k // 32, 16)
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    assert_read_back_equal(read_back(blocks, scales, None, torch.float32, 32), want)
    scales[1, 5, 4] = 255  # in the last (partial) K tile of expert 1, weight row 5
    got = read_back(blocks, scales, None, torch.float32, 32)
    assert bool(torch.isnan(got[1, 5, 1::2]).all()) and not bool(torch.isnan(got[0, :, 0::2]).any())
    assert_read_back_equal(got[:, :5], want[:, :5])
    assert_read_back_equal(got[:, 6:], want[:, 6:])


def make_moe(g: torch.Generator, tokens: int, experts: int, hidden: int, inter: int) -> dict:
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return {
        "hidden": torch.randn(tokens, hidden, generator=g),
        "w13": torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        "w2": torch.randn(experts, hidden, inter, generator=g) / inter**0.5,
        "topk_weights": torch.rand(tokens, 2, generator=g),
        "topk_ids": ids.to(torch.int32),
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


# (format, group, zero points, scale dtype, activation dtype, BLOCK_M, H, I)
E2E_CASES = [
    ("int4", 128, True, torch.bfloat16, torch.bfloat16, 16, 256, 128),
    ("int4", 32, False, torch.float32, torch.float32, 32, 160, 160),
    ("mxfp4", 32, False, torch.uint8, torch.bfloat16, 64, 160, 128),
]


@pytest.mark.parametrize("fmt, group, zeros, scale_dtype, dtype, block_m, hidden, inter", E2E_CASES)
def test_fused_moe_4bit_at_tuned_tiles_matches_reference(
    fmt: str,
    group: int,
    zeros: bool,
    scale_dtype: torch.dtype,
    dtype: torch.dtype,
    block_m: int,
    hidden: int,
    inter: int,
) -> None:
    """Both GEMMs at BLOCK_N = BLOCK_K = 128; the MXFP4 bf16 case with gpt-oss's clamped SwiGLU
    and expert biases, the rest with plain SwiGLU. 2 experts, 3 tokens, top-2."""
    g = gen()
    moe = make_moe(g, 3, 2, hidden, inter)
    w13, w2 = moe.pop("w13"), moe.pop("w2")
    moe["hidden"] = moe["hidden"].to(dtype)
    extra = {"config": MoeTileConfig(block_m, TILE_N, TILE_K, 4, 3)}
    if fmt == "mxfp4" and dtype == torch.bfloat16:
        extra["activation"] = SwiGLU(alpha=1.702, limit=7.0)
        extra["b13"] = torch.randn(2, 2 * inter, generator=g).to(dtype)
        extra["b2"] = torch.randn(2, hidden, generator=g).to(dtype)
    if fmt == "int4":
        q13 = quantize_int4(w13, group, symmetric=not zeros, scale_dtype=scale_dtype)
        q2 = quantize_int4(w2, group, symmetric=not zeros, scale_dtype=scale_dtype)
        got = fused_moe_int4(
            w13_packed=q13[0], w13_scales=q13[1], w2_packed=q2[0], w2_scales=q2[1],
            w13_zeros=q13[2], w2_zeros=q2[2], **moe, **extra,
        )  # fmt: skip
        deq13, deq2 = dequantize_int4(*q13, dtype=dtype), dequantize_int4(*q2, dtype=dtype)
    else:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        got = fused_moe_mxfp4(
            moe["hidden"], *q13, *q2, moe["topk_weights"], moe["topk_ids"], **extra
        )
        deq13, deq2 = dequantize_mxfp4(*q13, dtype=dtype), dequantize_mxfp4(*q2, dtype=dtype)
    extra.pop("config")
    bias = {name: extra.pop(name).double() for name in ("b13", "b2") if name in extra}
    want = fused_moe_reference(
        moe["hidden"].double(), deq13.double(), deq2.double(), moe["topk_weights"],
        moe["topk_ids"], **extra, **bias,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == moe["hidden"].shape
    assert rel_err(got, want) < RTOL[dtype], (fmt, group, dtype, rel_err(got, want))
