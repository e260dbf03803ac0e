"""The Triton kernels that cut the MoE block's launches (issue 42), against their torch versions.

`moe_align_block_size_kernel` against `kernels.moe.reference.moe_align_block_size_reference`
(exact: same sorted ids, block experts and padded total), `moe_sum` against the fp32 sum of
the kept rows, and the fused routers of `kernels.moe.router_kernels` against the torch routing
functions of `moe_engine.models.layers.routing` (ids exact, lower id first on ties; weights to
float32 rounding). Fresh random inputs each run, under Triton's interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from kernels.dense.triton_act import silu_and_mul  # noqa: E402
from kernels.moe import router_kernels as rk  # noqa: E402
from kernels.moe.fused_moe import moe_align_block_size  # noqa: E402
from kernels.moe.reference import moe_align_block_size_reference  # noqa: E402
from kernels.moe.sum_kernels import moe_sum  # noqa: E402
from kernels.plan import TRITON, KernelPlan  # noqa: E402
from moe_engine.models.layers import routers, routing  # noqa: E402


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


# --- moe_align_block_size -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_size"),
    [(1, 2, 8, 16), (5, 2, 7, 16), (40, 4, 6, 16), (70, 8, 3, 32), (9, 1, 300, 16), (0, 2, 4, 16)],
)
def test_align_kernel_equals_the_torch_version(tokens, top_k, experts, block_size) -> None:
    """Ids in [-1, E]: -1 (another rank's) and E (out of range) are dropped; 40 x 4 and 70 x 8
    pairs take several chunks of the kernel's loops; E = 7, 6, 3, 300 are not powers of two."""
    g = gen()
    ids = torch.randint(-1, experts + 1, (tokens, top_k), generator=g, dtype=torch.int32)
    got = moe_align_block_size(ids, block_size, experts)
    want = moe_align_block_size_reference(ids, block_size, experts)
    for name, a, b in zip(("sorted_token_ids", "expert_ids", "total"), got, want, strict=True):
        assert a.dtype == torch.int32 and torch.equal(a, b), (name, a, b)


def test_prefill_sized_alignment_takes_the_torch_version(monkeypatch) -> None:
    """Past `MAX_KERNEL_PAIRS` pairs the kernel is not launched (its one program walks the
    pairs serially), and the outputs are the torch version's."""
    from kernels.moe import align_kernels, fused_moe

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was launched")

    ids = torch.randint(-1, 9, (align_kernels.MAX_KERNEL_PAIRS // 2 + 1, 2), dtype=torch.int32)
    monkeypatch.setattr(fused_moe, "invoke_moe_align_block_size", refuse)
    got = moe_align_block_size(ids, 64, 8)
    for a, b in zip(got, moe_align_block_size_reference(ids, 64, 8), strict=True):
        assert torch.equal(a, b)


# --- moe_sum --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden", "dtype"),
    [(1, 2, 48, torch.float32), (6, 4, 1030, torch.bfloat16)],
)
def test_moe_sum_adds_the_kept_rows_in_fp32(tokens, top_k, hidden, dtype) -> None:
    """Dropped pairs' rows hold NaN (never written in the real tail) and must not be read;
    H = 1030 takes three column blocks, the last one partial."""
    g = gen()
    x = torch.randn(tokens, top_k, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 5, (tokens, top_k), generator=g, dtype=torch.int32)
    ids[0, 0], ids[-1, -1] = -1, 5  # another rank's, out of range
    dropped = (ids < 0) | (ids >= 5)
    x[dropped] = float("nan")
    want = x.float().masked_fill(dropped[..., None], 0.0).sum(dim=1).to(dtype)
    got = moe_sum(x, ids, 5)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_adds_the_addend_as_torch_adds_after_it(dtype) -> None:
    """The shared experts' output folded into the tail: bit for bit the separate torch add
    (the sum rounded to the dtype, then the add rounded again)."""
    g = gen()
    x = torch.randn(5, 3, 1030, generator=g).to(dtype)
    ids = torch.randint(0, 4, (5, 3), generator=g, dtype=torch.int32)
    ids[2, 1] = -1
    addend = torch.randn(5, 1030, generator=g).to(dtype)
    got = moe_sum(x, ids, 4, addend)
    assert got.dtype == dtype and torch.equal(got, moe_sum(x, ids, 4) + addend)
    with pytest.raises(ValueError, match="addend"):
        moe_sum(x, ids, 4, addend[:, :-1])


# --- silu_and_mul ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "inter", "dtype"),
    [(1, 32, torch.bfloat16), (3, 1500, torch.bfloat16), (2, 96, torch.float16),
     (3, 1500, torch.float32)],
)  # fmt: skip
def test_silu_and_mul_equals_the_torch_ops(tokens, inter, dtype) -> None:
    """bf16/fp16: bit for bit ``F.silu(gate) * up`` (silu rounded to the dtype, then the
    product); fp32 (where exp may differ from torch's in the last bit): against float64 to
    float32 rounding. I = 1500 takes two column blocks, the last partial."""
    x = (torch.randn(tokens, 2 * inter, generator=gen()) * 4).to(dtype)
    got = silu_and_mul(x)
    gate, up = x[:, :inter], x[:, inter:]
    assert got.dtype == dtype and got.shape == (tokens, inter)
    if dtype == torch.float32:
        want = F.silu(gate.double()) * up.double()
        torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=1e-30)
    else:
        assert torch.equal(got, F.silu(gate) * up)
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(x[:, :-1])


# --- routers --------------------------------------------------------------------------------


def _check(got, want, atol: float = 1e-6) -> None:
    (w, ids), (w_ref, ids_ref) = got, want
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ids_ref.to(torch.int32)), (ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=atol)


def _logits(g, tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(tokens, experts, generator=g)
    x[0, 1] = x[0, 3] = x[0].max() + 1.0  # a tie for the best: the lower id first
    if tokens > 1:
        x[1] = 0.25  # every expert tied
    return x.to(dtype)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "dtype"),
    [(1, 8, 2, torch.float32), (5, 6, 2, torch.bfloat16), (4, 128, 8, torch.float32)],
)
def test_softmax_topk(tokens, experts, top_k, dtype) -> None:
    logits = _logits(gen(), tokens, experts, dtype)
    for renormalize in (True, False):
        _check(
            rk.fused_softmax_topk(logits, top_k, renormalize),
            routing.softmax_topk(logits, top_k, renormalize),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax(dtype) -> None:
    """gpt-oss: torch.topk leaves the order of equal logits unspecified, so the reference here
    is the stable sort (lower id first) with the same softmax in the logits' dtype."""
    logits = _logits(gen(), 6, 32, dtype)
    values, ids = routing.sort_topk(logits.float(), 4)
    want = torch.softmax(values.to(dtype), dim=-1).float(), ids
    _check(rk.fused_topk_softmax(logits, 4), want)
    if dtype == torch.float32:  # no ties but rows 0 and 1: torch's own topk agrees
        _check(rk.fused_topk_softmax(logits[2:], 4), routing.topk_softmax(logits[2:], 4))


@pytest.mark.parametrize(
    ("experts", "top_k", "n_group", "topk_group"),
    [(16, 4, 4, 2), (12, 3, 3, 3), (256, 8, 8, 4)],
)
def test_sigmoid_grouped_topk(experts, top_k, n_group, topk_group) -> None:
    """DeepSeek-V3's routing at its own shape (256 experts, 8 groups, 4 kept, top-8) and
    smaller; E = 12 is not a power of two, and all 3 groups kept means no group limit; row 1
    ties every expert and group."""
    g = gen()
    logits = _logits(g, 5, experts, torch.float32)
    bias = torch.randn(experts, generator=g) * 0.5
    for b, norm, scale in ((bias, True, 2.5), (None, False, 1.0)):
        _check(
            rk.fused_sigmoid_grouped_topk(logits, top_k, b, n_group, topk_group, norm, scale),
            routing.sigmoid_grouped_topk(logits, top_k, b, n_group, topk_group, norm, scale),
            atol=1e-5,
        )


def test_softmax_scoring_with_correction_bias() -> None:
    """ERNIE-4.5-MoE's routing (`scoring="softmax"`): softmax probabilities plus the bias for
    the choice, the unbiased ones renormalised; 12 experts (not a power of two), no groups."""
    g = gen()
    logits = _logits(g, 5, 12, torch.float32)
    bias = torch.randn(12, generator=g) * 0.2
    _check(
        rk.fused_sigmoid_grouped_topk(logits, 3, bias, 1, 1, True, 1.0, scoring="softmax"),
        routing.sigmoid_grouped_topk(logits, 3, bias, 1, 1, True, 1.0, scoring="softmax"),
        atol=1e-5,
    )


def test_softmax_grouped_topk() -> None:
    logits = _logits(gen(), 5, 16, torch.float32)
    for method in routing.V2_TOPK_METHODS:
        _check(
            rk.fused_softmax_grouped_topk(logits, 4, method, 4, 2, 1.5),
            routing.softmax_grouped_topk(logits, 4, method, 4, 2, 1.5),
        )


@pytest.mark.parametrize("masked", [False, True])
def test_every_router_counts_the_expert_load_it_routes(masked) -> None:
    """`expert_counts` gains each row's weight (1, or the row mask's 1/0) per chosen expert:
    the recorder's `index_add_`, exactly, for each launcher."""
    g = gen()
    logits = _logits(g, 6, 16, torch.float32)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.int64) if masked else None
    calls = {
        "softmax_topk": lambda **c: rk.fused_softmax_topk(logits, 4, True, **c),
        "topk_softmax": lambda **c: rk.fused_topk_softmax(logits, 4, **c),
        "sigmoid_grouped_topk": lambda **c: rk.fused_sigmoid_grouped_topk(
            logits, 4, None, 4, 2, True, 1.0, **c),
        "softmax_grouped_topk": lambda **c: rk.fused_softmax_grouped_topk(
            logits, 4, "group_limited_greedy", 4, 2, 1.0, **c),
    }  # fmt: skip
    assert set(calls) == set(rk.FUSED_ROUTERS)
    for name, call in calls.items():
        assert rk.FUSED_ROUTERS[name].COUNTS_EXPERTS
        counts = torch.full((16,), 7, dtype=torch.int64)
        _, ids = call(expert_counts=counts, row_weights=mask)
        weight = torch.ones(6, dtype=torch.int64) if mask is None else mask[:6]
        want = torch.full((16,), 7, dtype=torch.int64)
        want.index_add_(0, ids.reshape(-1).long(), weight[:, None].expand(6, 4).reshape(-1))
        assert torch.equal(counts, want), name
        assert torch.equal(call()[1], ids), name  # counting changes no routing
    with pytest.raises(ValueError, match="expert_counts"):
        rk.fused_softmax_topk(logits, 4, True, expert_counts=torch.zeros(15, dtype=torch.int64))


def test_the_plan_hands_the_fused_routers_to_triton_layers() -> None:
    plan = KernelPlan.uniform(TRITON, "cuda")
    for name, kernel in rk.FUSED_ROUTERS.items():
        assert plan.router_topk("cuda", name) is kernel
    router = routers.SigmoidGroupedTopKRouter(8, 16, 4, 4, 2, True, 2.5)
    router.bind_kernels(plan)
    assert router.kernel is rk.fused_sigmoid_grouped_topk
