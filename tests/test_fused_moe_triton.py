"""Triton fused MoE (`kernels.moe.fused_moe`) against the float64 torch reference, on the CPU.

The kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set below before the first
`triton` import), on tiny fresh random shapes each run. Tolerances (relative Frobenius error of
the [T, H] output against `fused_moe_reference` in float64 on the same, already rounded inputs):
float32 < 1e-4; bfloat16 < 1e-2 (the issue's bounds; bf16 rounds the GEMM1 output, the SwiGLU
and the GEMM2 output, each to 8 mantissa bits).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.moe.activation import SILU_AND_MUL, SwiGLU  # noqa: E402
from kernels.moe.fused_moe import (  # noqa: E402
    fused_moe,
    fused_moe_int4,
    fused_moe_mxfp4,
    invoke_fused_moe_kernel,
    max_num_tokens_padded,
    moe_align_block_size,
)
from kernels.moe.reference import fused_moe_reference  # noqa: E402
from quant.int4 import dequantize_int4, quantize_int4  # noqa: E402
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

HIDDEN, INTER, TOP_K = 32, 16, 2
RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def gen() -> torch.Generator:
    """A fresh seed each run (printed by pytest on failure through the generator's state)."""
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def random_ids(g: torch.Generator, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """[tokens, top_k] int32, distinct experts per token."""
    rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32)


def make_moe(
    g: torch.Generator,
    tokens: int,
    experts: int,
    dtype: torch.dtype,
    inter: int = INTER,
    top_k: int = TOP_K,
) -> dict:
    """Inputs at unit scale, rounded to `dtype` (the reference sees the same rounded values)."""
    return {
        "hidden": torch.randn(tokens, HIDDEN, generator=g).to(dtype),
        "w13": (torch.randn(experts, 2 * inter, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype),
        "w2": (torch.randn(experts, HIDDEN, inter, generator=g) / inter**0.5).to(dtype),
        "topk_weights": torch.rand(tokens, top_k, generator=g),
        "topk_ids": random_ids(g, tokens, experts, top_k),
    }


def reference64(
    hidden, w13, w2, topk_weights, topk_ids, activation=SILU_AND_MUL, b13=None, b2=None
) -> torch.Tensor:
    return fused_moe_reference(
        hidden.double(), w13.double(), w2.double(), topk_weights, topk_ids,
        activation=activation,
        b13=None if b13 is None else b13.double(),
        b2=None if b2 is None else b2.double(),
    )  # fmt: skip


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


# --- moe_align_block_size -------------------------------------------------------------------


def check_alignment(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, block_size, num_experts)
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    total = int(post_padded[0])
    max_padded = max_num_tokens_padded(num_pairs, block_size, num_experts)
    assert sorted_ids.dtype == expert_ids.dtype == post_padded.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (max_padded // block_size,)
    assert total % block_size == 0 and total <= max_padded
    real = sorted_ids[sorted_ids < num_pairs].long()
    # every valid pair exactly once, no invalid pair, everything else is the sentinel
    assert sorted(real.tolist()) == torch.nonzero(valid).flatten().tolist()
    assert bool((sorted_ids[(sorted_ids != num_pairs)] < num_pairs).all())
    assert bool((sorted_ids[total:] == num_pairs).all())
    used_blocks = total // block_size
    assert bool((expert_ids[used_blocks:] == -1).all())
    counts = torch.bincount(flat[valid], minlength=num_experts)
    expected_blocks = (counts + block_size - 1) // block_size
    block_experts = expert_ids[:used_blocks].long()
    assert block_experts.tolist() == sorted(block_experts.tolist())  # ascending expert order
    assert torch.bincount(block_experts, minlength=num_experts).tolist() == (
        expected_blocks.tolist()
    )
    for b in range(used_blocks):  # each block holds pairs of its own expert only
        ids = sorted_ids[b * block_size : (b + 1) * block_size].long()
        ids = ids[ids < num_pairs]
        assert bool((flat[ids] == expert_ids[b]).all())
        assert ids.tolist() == sorted(ids.tolist())  # stable within an expert


@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("experts", [4, 8])
def test_align_invariants_random_with_dropped_ids(tokens: int, experts: int) -> None:
    g = gen()
    topk_ids = random_ids(g, tokens, experts, TOP_K)
    drop = torch.rand(tokens, TOP_K, generator=g) < 0.2
    topk_ids[drop] = -1
    topk_ids[0, 0] = experts  # out of range on the high side too
    check_alignment(topk_ids, 16, experts)
    check_alignment(topk_ids, 32, experts)


def test_align_all_tokens_to_expert_zero() -> None:
    sorted_ids, expert_ids, post_padded = moe_align_block_size(
        torch.zeros(4, 1, dtype=torch.int32), 16, 4
    )
    assert sorted_ids[:16].tolist() == [0, 1, 2, 3] + [4] * 12
    assert bool((sorted_ids[16:] == 4).all())
    assert expert_ids[0] == 0 and bool((expert_ids[1:] == -1).all())
    assert post_padded.tolist() == [16]


def test_align_edge_cases() -> None:
    check_alignment(torch.arange(4, dtype=torch.int32).repeat(3, 1), 16, 4)  # top_k == E
    check_alignment(torch.full((3, 2), -1, dtype=torch.int32), 16, 4)  # nothing on this rank
    check_alignment(torch.full((20, 1), 511, dtype=torch.int32), 16, 512)  # last of 512
    _, expert_ids, post_padded = moe_align_block_size(torch.zeros(0, 2, dtype=torch.int32), 16, 4)
    assert post_padded.tolist() == [0] and bool((expert_ids == -1).all())
    for bad in (0, 8, 24):
        with pytest.raises(ValueError, match="block_size"):
            moe_align_block_size(torch.zeros(2, 1, dtype=torch.int32), bad, 4)


# --- fused_moe ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_fused_moe_matches_reference(tokens: int, dtype: torch.dtype) -> None:
    g = gen()
    experts = int(torch.randint(4, 9, (1,), generator=g))
    moe = make_moe(g, tokens, experts, dtype)
    if tokens > 1:
        moe["topk_ids"][1] = -1  # a token routed to no expert of this rank
    moe["topk_ids"][moe["topk_ids"] == experts - 1] = 0  # an expert with zero tokens
    got = fused_moe(**moe)
    want = reference64(**moe)
    assert got.dtype == dtype and got.shape == (tokens, HIDDEN)
    assert rel_err(got, want) < RTOL[dtype]
    if tokens > 1:
        assert bool((got[1] == 0).all())


def test_fused_moe_top_k_equals_num_experts_and_512_experts() -> None:
    g = gen()
    moe = make_moe(g, 3, 2, torch.float32)  # TOP_K == 2 experts: every token uses all
    assert rel_err(fused_moe(**moe), reference64(**moe)) < RTOL[torch.float32]
    moe = make_moe(g, 3, 512, torch.float32)
    moe["topk_ids"][:, 0] = 511  # the winning expert at the last index
    assert rel_err(fused_moe(**moe), reference64(**moe)) < RTOL[torch.float32]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_int4_matches_dequantized_reference(symmetric: bool, dtype: torch.dtype) -> None:
    g = gen()
    moe = make_moe(g, 5, 4, torch.float32)
    w13, w2 = moe.pop("w13"), moe.pop("w2")
    p13, s13, z13 = quantize_int4(w13, group_size=16, symmetric=symmetric)
    p2, s2, z2 = quantize_int4(w2, group_size=16, symmetric=symmetric)
    moe["hidden"] = moe["hidden"].to(dtype)
    got = fused_moe_int4(
        w13_packed=p13, w13_scales=s13, w2_packed=p2, w2_scales=s2,
        w13_zeros=z13, w2_zeros=z2, **moe,
    )  # fmt: skip
    deq13 = dequantize_int4(p13, s13, z13, dtype=dtype)  # what the kernel sees in registers
    deq2 = dequantize_int4(p2, s2, z2, dtype=dtype)
    assert got.dtype == dtype
    assert rel_err(got, reference64(w13=deq13, w2=deq2, **moe)) < RTOL[dtype]


def test_fused_moe_rejects_bad_block_size() -> None:
    moe = make_moe(gen(), 2, 4, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        fused_moe(**moe, block_size_m=12)


def test_interpreter_is_on_and_kernels_do_not_import_the_engine() -> None:
    import kernels.moe.fused_moe as module

    assert triton.knobs.runtime.interpret  # really interpreted on this CPU-only machine
    source = open(module.__file__).read()
    assert "import moe_engine" not in source and "from moe_engine" not in source


# --- every weight format on the routing edge cases, and the gpt-oss activation --------------

FORMATS = ("dense", "int4", "mxfp4")
INT4_GROUP = 16
MX_INTER = 32  # MXFP4 groups 32 values of K, and w2's K is the intermediate size


def run_format(
    fmt: str, moe: dict, dtype: torch.dtype, **extra
) -> tuple[torch.Tensor, float, dict]:
    """Run `fmt`'s Triton kernel on `moe` (float32 weights; hidden already in `dtype`) and
    return (output, relative error against the float64 reference on the weights the kernel
    sees: the quantized ones dequantized to `dtype`, those inputs as a dict)."""
    moe = dict(moe)
    w13, w2 = moe.pop("w13"), moe.pop("w2")
    if fmt == "dense":
        w13, w2 = w13.to(dtype), w2.to(dtype)
        got = fused_moe(w13=w13, w2=w2, **moe, **extra)
    elif fmt == "int4":
        p13, s13, z13 = quantize_int4(w13, group_size=INT4_GROUP, symmetric=False)
        p2, s2, z2 = quantize_int4(w2, group_size=INT4_GROUP, symmetric=False)
        got = fused_moe_int4(
            w13_packed=p13, w13_scales=s13, w2_packed=p2, w2_scales=s2,
            w13_zeros=z13, w2_zeros=z2, **moe, **extra,
        )  # fmt: skip
        w13, w2 = dequantize_int4(p13, s13, z13, dtype=dtype), dequantize_int4(p2, s2, z2, dtype)
    else:
        q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        got = fused_moe_mxfp4(moe["hidden"], *q13, *q2, moe["topk_weights"], moe["topk_ids"],
                              **extra)  # fmt: skip
        w13, w2 = dequantize_mxfp4(*q13, dtype=dtype), dequantize_mxfp4(*q2, dtype=dtype)
    want = reference64(w13=w13, w2=w2, **moe, **extra)
    assert got.dtype == dtype and got.shape == moe["hidden"].shape
    return got, rel_err(got, want), {"w13": w13, "w2": w2, **moe}


def scenario(name: str, g: torch.Generator, dtype: torch.dtype) -> dict:
    """The routing edge cases of issue 3, with fresh random values."""
    if name == "one_token":
        experts = int(torch.randint(2, 9, (1,), generator=g))
        return make_moe(g, 1, experts, dtype, MX_INTER)
    if name == "remote_ids":  # token 1 on no expert of this rank; ids -1 and E both dropped
        moe = make_moe(g, 6, 4, dtype, MX_INTER)
        moe["topk_ids"][1] = torch.tensor([-1, 4])
        moe["topk_ids"][3, 0] = -1
        return moe
    if name == "empty_expert":
        moe = make_moe(g, 7, 5, dtype, MX_INTER)
        empty = int(torch.randint(0, 5, (1,), generator=g))
        others = torch.tensor([e for e in range(5) if e != empty], dtype=torch.int32)
        moe["topk_ids"] = others[random_ids(g, 7, 4, TOP_K).long()]  # expert `empty` gets none
        return moe
    if name == "top_k_equals_experts":
        return make_moe(g, 3, 4, dtype, MX_INTER, top_k=4)
    assert name == "last_of_512"  # 512 experts, the winning (largest-weight) expert is 511
    moe = make_moe(g, 3, 512, dtype, MX_INTER)
    moe["topk_ids"][:, 0] = 511
    moe["topk_ids"][:, 1] = torch.where(moe["topk_ids"][:, 1] == 511, 0, moe["topk_ids"][:, 1])
    moe["topk_weights"] = torch.tensor([[0.7, 0.3]]).repeat(3, 1)
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "case", ["one_token", "remote_ids", "empty_expert", "top_k_equals_experts", "last_of_512"]
)
def test_every_format_on_routing_edge_cases(case: str, fmt: str, dtype: torch.dtype) -> None:
    g = gen()
    moe = scenario(case, g, dtype)
    moe["w13"], moe["w2"] = moe["w13"].float(), moe["w2"].float()
    got, err, _ = run_format(fmt, moe, dtype)
    assert err < RTOL[dtype], (case, fmt, dtype, err)
    if case == "remote_ids":
        assert bool((got[1] == 0).all())  # routed to no expert here: exactly zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_clamped_swiglu_and_biases_match_reference(fmt: str, dtype: torch.dtype) -> None:
    """gpt-oss's activation (alpha 1.702, limit 7, HF `GptOssExperts`) with expert biases.
    Activations are scaled up so that the clamp really cuts (checked: the reference moves by
    far more than the tolerance without the limit, or with plain SwiGLU)."""
    g = gen()
    moe = make_moe(g, 9, 4, dtype, MX_INTER)
    moe["hidden"] = (moe["hidden"].float() * 6).to(dtype)
    moe["topk_ids"][2, 1] = -1
    moe["w13"], moe["w2"] = moe["w13"].float(), moe["w2"].float()
    b13 = torch.randn(4, 2 * MX_INTER, generator=g).to(dtype)
    b2 = torch.randn(4, HIDDEN, generator=g).to(dtype)
    clamped = SwiGLU(alpha=1.702, limit=7.0)
    got, err, inputs = run_format(fmt, moe, dtype, activation=clamped, b13=b13, b2=b2)
    assert err < RTOL[dtype], (fmt, dtype, err)
    for other in (SwiGLU(alpha=1.702), SwiGLU()):  # the limit and the variant both matter here
        assert rel_err(got, reference64(**inputs, activation=other, b13=b13, b2=b2)) > 0.05
    assert rel_err(got, reference64(**inputs, activation=clamped)) > 0.05  # and the biases


def test_mxfp4_kernel_decodes_every_code_and_scale_byte_exactly() -> None:
    """One-hot rows times the weight read W back column by column (fp32, exact): every E2M1 code
    under E8M0 bytes 0 (2^-127), 1, 126, 127 (1.0), 128, 253 and 254 (2^127; small codes only
    there, so nothing overflows) equals `quant.mxfp4.dequantize_mxfp4` bit for bit; byte 255
    makes the row NaN."""
    g = gen()
    n, k = 16, 64
    codes = torch.randint(0, 16, (1, n, k), generator=g, dtype=torch.uint8)
    codes[0, 0, :16] = torch.arange(16, dtype=torch.uint8)  # all 16 codes in one group
    scale_bytes = torch.tensor([0, 1, 126, 127, 128, 253, 254], dtype=torch.uint8)
    scales = scale_bytes[torch.randint(0, 7, (1, n, k // 32), generator=g)]
    scales[0, 0, 0], scales[0, 1, 1] = 127, 254
    big = (scales >= 253).repeat_interleave(32, dim=-1)
    codes[big] = codes[big] & 0b1011  # |E2M1| <= 1.5 under 2^127: stays finite
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(1, n, k // 32, 16)
    want = dequantize_mxfp4(blocks, scales, torch.float32)[0]  # [n, k]
    eye = torch.eye(k)
    out = torch.empty(k, n)
    align = moe_align_block_size(torch.zeros(k, 1, dtype=torch.int32), 16, 1)
    invoke_fused_moe_kernel(
        eye, blocks, out, torch.ones(k, 1), *align, top_k=1, mul_routed_weight=False,
        w_scales=scales,
    )  # fmt: skip
    assert torch.equal(out.t(), want)
    assert out[:16, 0].tolist() == [0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    scales[0, 3, 1] = 255  # NaN scale: the row's dot products are NaN
    invoke_fused_moe_kernel(
        eye, blocks, out, torch.ones(k, 1), *align, top_k=1, mul_routed_weight=False,
        w_scales=scales,
    )  # fmt: skip
    assert bool(torch.isnan(out[:, 3]).all())
    assert not bool(torch.isnan(out[:, [0, 1, 2]]).any())


def test_mxfp4_and_activation_inputs_are_checked() -> None:
    moe = make_moe(gen(), 2, 4, torch.float32, MX_INTER)
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    with pytest.raises(ValueError, match="uint8"):
        fused_moe_mxfp4(moe["hidden"], q13[0], q13[1].float(), *q2, moe["topk_weights"],
                        moe["topk_ids"])  # fmt: skip
    with pytest.raises(ValueError, match="bias"):
        fused_moe(**moe, b13=torch.zeros(4, 3))
    with pytest.raises(ValueError, match="alpha"):
        SwiGLU(limit=7.0)
