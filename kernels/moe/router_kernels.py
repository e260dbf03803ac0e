"""Fused top-k routers in Triton: router_logits -> (topk_weights [T, k] float32, topk_ids [T, k]
int32) in one launch per MoE layer, one program per token, without a sort.

One kernel, specialised by constexprs, covers the routing families of
`moe_engine.models.layers.routing` (the torch functions these repeat, of the same names):

| launcher                     | family                        | scores, selection, weights   |
|------------------------------|-------------------------------|------------------------------|
| `fused_softmax_topk`         | Qwen3-MoE, Qwen2-MoE, Mixtral | softmax, top-k, renormalised |
| `fused_topk_softmax`         | gpt-oss                       | top-k logits, softmax of k   |
| `fused_sigmoid_grouped_topk` | DeepSeek-V3, GLM-4.5 (noaux)  | sigmoid + bias, group top-2  |
|                              | MiniMax-M2; ERNIE-4.5-MoE,    | sums, top-k, renorm., scaled |
|                              | LongCat-Flash, Mistral-4      | (or softmax + bias)          |
|                              | (softmax scores)              |                              |
| `fused_softmax_grouped_topk` | DeepSeek-V2                   | softmax, group max, top-k,   |
|                              |                               | scaled                       |

The experts of a row sit in a ``[GROUP_PAD, PER_GROUP_PAD]`` register tile (expert
``g * per_group + j``; one group when the routing has none). The top-k is k rounds of
"take the maximum, the lowest expert id among equal values, then mask it out" (likewise the
kept groups), so ties go to the lower id exactly as the torch path's stable descending sort.
Weights are float32 and ids int32, as the expert kernels take them. The arithmetic is the torch
path's in float32 (``exp``/``sigmoid`` may differ from torch's in the last bit, so weights agree
to float32 rounding, and a selection can differ only between scores within that rounding).

Every launcher also takes the expert-load count of the layer (`expert_counts`: an int64 ``[E]``
row of `moe_engine.instrumentation.ExpertLoadRecorder`'s counts, optional `row_weights` [>= T]
int64 of 1 and 0 for a padded graph batch): each program adds its row's weight to the counts of
its k experts with an atomic add (integers: exact, order-free), so the recorder's
``index_add_`` launch is not needed where the router is one of these (`COUNTS_EXPERTS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.sum_kernels import round_bf16_bits

SOFTMAX_THEN_TOPK, SIGMOID_BIAS, TOPK_THEN_SOFTMAX = 0, 1, 2  # SCORING
NO_GROUPS, GROUP_MAX, GROUP_TOP2_SUM = 0, 1, 2  # GROUP_SCORE
_BIG = tl.constexpr(1 << 30)  # an index past every expert and group


@triton.jit
def _argmax_lowest(x, index, BIG: tl.constexpr):
    """(max of 2-D x, the lowest `index` where x equals it)."""
    best = tl.max(tl.max(x, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(x == best, index, BIG), axis=1), axis=0)


@triton.jit
def _group_keep(
    choice,
    gid,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_SCORE: tl.constexpr,
    PER_GROUP_PAD: tl.constexpr,
    BIG: tl.constexpr,
):
    """[GROUP_PAD, 1] bool: the TOPK_GROUP best groups (lower group id first on ties); gid:
    [GROUP_PAD] group ids."""
    lane = tl.arange(0, PER_GROUP_PAD)[None, :]
    first = tl.max(choice, axis=1)
    if GROUP_SCORE == 2:  # sum of the two largest (a tie for the largest counts twice)
        at = tl.min(tl.where(choice == first[:, None], lane, BIG), axis=1)
        second = tl.max(tl.where(lane == at[:, None], float("-inf"), choice), axis=1)
        score = first + second
    else:
        score = first
    score = tl.where(gid < N_GROUP, score, float("-inf"))
    keep = gid < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, gid, BIG), axis=0)
        keep = keep | (gid == pick)
        score = tl.where(gid == pick, float("-inf"), score)
    return keep[:, None]


@triton.jit
def router_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, row_weights_ptr, stride_lt,
    routed_scaling_factor, renorm_eps,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, PER_GROUP_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SCORING: tl.constexpr, GROUP_SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND_WEIGHTS_BF16: tl.constexpr, ROUND_WEIGHTS_FP16: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_ROW_WEIGHTS: tl.constexpr,
):  # fmt: skip
    """One token: see the module docstring."""
    t = tl.program_id(0)
    groups = tl.arange(0, GROUP_PAD)[:, None]
    lanes = tl.arange(0, PER_GROUP_PAD)[None, :]
    valid = (groups < N_GROUP) & (lanes < PER_GROUP)
    expert = groups * PER_GROUP + lanes
    index = tl.where(valid, expert, _BIG)
    x = tl.load(logits_ptr + t * stride_lt + expert, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SCORING == 0:
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
    else:
        scores = x
        choice = x
    if GROUP_SCORE != 0:
        keep = _group_keep(
            choice, tl.arange(0, GROUP_PAD), N_GROUP, TOPK_GROUP, GROUP_SCORE, PER_GROUP_PAD, _BIG
        )
        choice = tl.where(keep, choice, float("-inf"))
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    picked = tl.full([K_PAD], float("-inf"), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        _, pick = _argmax_lowest(choice, index, _BIG)
        hit = expert == pick
        value = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == i, pick, ids)
        picked = tl.where(slot == i, value, picked)
        choice = tl.where(hit, float("-inf"), choice)
    if SCORING == 2:  # softmax over the k chosen logits, in the logits' dtype
        e = tl.exp(picked - tl.max(picked, axis=0))
        weights = e / tl.sum(e, axis=0)
        if ROUND_WEIGHTS_BF16:
            if INTERPRET_BF16:
                weights = round_bf16_bits(weights)
            weights = weights.to(tl.bfloat16).to(tl.float32)
        if ROUND_WEIGHTS_FP16:
            weights = weights.to(tl.float16).to(tl.float32)
    else:
        weights = tl.where(slot < TOP_K, picked, 0.0)
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + renorm_eps)
        weights = weights * routed_scaling_factor
    out = t * TOP_K + slot
    tl.store(weights_ptr + out, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slot < TOP_K)
    if HAS_COUNTS:  # the k ids of a row are distinct: one atomic add per expert and row
        add = tl.full([K_PAD], 1, dtype=tl.int64)
        if HAS_ROW_WEIGHTS:
            add = add * tl.load(row_weights_ptr + t)
        tl.atomic_add(counts_ptr + ids, add, mask=slot < TOP_K)


def _launch(
    logits: torch.Tensor, top_k: int, *, scoring: int, n_group: int = 1, topk_group: int = 1,
    group_score: int = NO_GROUPS, bias: torch.Tensor | None = None, renormalize: bool = False,
    renorm_eps: float = 0.0, scale: float = 1.0, expert_counts: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    num_tokens, num_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    _check_counts(expert_counts, row_weights, num_tokens, num_experts)
    device = logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    per_group = num_experts // n_group
    interpret = bool(triton.knobs.runtime.interpret)
    router_topk_kernel[(num_tokens,)](
        logits, bias if bias is not None else logits, weights, ids,
        expert_counts if expert_counts is not None else ids,
        row_weights if row_weights is not None else ids, logits.stride(0),
        float(scale), float(renorm_eps),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group, PER_GROUP=per_group,
        GROUP_PAD=triton.next_power_of_2(n_group),
        PER_GROUP_PAD=triton.next_power_of_2(per_group), TOPK_GROUP=topk_group,
        SCORING=scoring, GROUP_SCORE=group_score, HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize,
        ROUND_WEIGHTS_BF16=scoring == TOPK_THEN_SOFTMAX and logits.dtype == torch.bfloat16,
        ROUND_WEIGHTS_FP16=scoring == TOPK_THEN_SOFTMAX and logits.dtype == torch.float16,
        INTERPRET_BF16=interpret, HAS_COUNTS=expert_counts is not None,
        HAS_ROW_WEIGHTS=row_weights is not None, num_warps=1 if num_experts <= 128 else 4,
    )  # fmt: skip
    return weights, ids


def _check_counts(
    expert_counts: torch.Tensor | None,
    row_weights: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
) -> None:
    """Raises ValueError unless expert_counts is None or a contiguous int64 [E] tensor and
    row_weights None or an int64 [P >= T] one (given only with expert_counts)."""
    if expert_counts is None:
        if row_weights is not None:
            raise ValueError("row_weights without expert_counts")
        return
    if (expert_counts.dtype != torch.int64 or tuple(expert_counts.shape) != (num_experts,)
            or expert_counts.stride(0) != 1):  # fmt: skip
        raise ValueError(
            f"expert_counts must be a contiguous [{num_experts}] int64 tensor, got "
            f"{tuple(expert_counts.shape)} {expert_counts.dtype}"
        )
    if row_weights is not None and (
        row_weights.dtype != torch.int64 or row_weights.dim() != 1
        or row_weights.numel() < num_tokens
    ):  # fmt: skip
        raise ValueError(
            f"row_weights must be [P >= {num_tokens}] int64, got {tuple(row_weights.shape)} "
            f"{row_weights.dtype}"
        )


def fused_softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, **counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.softmax_topk` in one launch: softmax over the E experts in float32, the k
    largest (lower id first on ties), optionally divided by their sum.

    Args:
        router_logits: [T, E] float32, bfloat16 or float16.
        top_k: experts per token, 1 <= top_k <= E; renormalize: divide the k by their sum.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (descending weight).

    Raises:
        ValueError: top_k outside [1, E].
    """
    return _launch(
        router_logits, top_k, scoring=SOFTMAX_THEN_TOPK, renormalize=renormalize, **counts
    )


def fused_topk_softmax(
    router_logits: torch.Tensor, top_k: int, **counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.topk_softmax` (gpt-oss) in one launch: the k largest logits (lower id first on
    ties), then a softmax over those k computed in float32 and rounded to the logits' dtype, as
    torch's softmax in that dtype rounds its float32 result.

    Args:
        router_logits: [T, E] float32, bfloat16 or float16; top_k: 1 <= top_k <= E.

    Returns:
        topk_weights [T, k] float32 (sum to 1 up to that rounding), topk_ids [T, k] int32.
    """
    return _launch(router_logits, top_k, scoring=TOPK_THEN_SOFTMAX, **counts)


def fused_sigmoid_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    e_score_correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str = "sigmoid",
    **counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.sigmoid_grouped_topk` (DeepSeek-V3 / GLM-4.5 noaux_tc routing, arXiv:2412.19437
    sec. 2.1.2) in one launch: sigmoid scores (`scoring="softmax"`: softmax over all experts,
    ERNIE-4.5-MoE,
    LongCat-Flash, Mistral-4), plus the correction bias for the choice only;
    groups scored by the sum of their two largest biased scores, the best `topk_group` kept;
    the top_k of their experts; weights the unbiased scores, divided by their sum + 1e-20 when
    `norm_topk_prob`, times `routed_scaling_factor`.

    Args:
        router_logits: [T, E] float32 (any float dtype is read as float32).
        top_k; e_score_correction_bias: [E] float32 or None; n_group, topk_group (limits
        checked where the config is read: `routing.check_sigmoid_group_limits`);
        norm_topk_prob; routed_scaling_factor; scoring: "sigmoid" or "softmax".

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (by descending biased score).
    """
    grouped = topk_group < n_group
    kind = SOFTMAX_THEN_TOPK if scoring == "softmax" else SIGMOID_BIAS
    return _launch(
        router_logits, top_k, scoring=kind, n_group=n_group, topk_group=topk_group,
        group_score=GROUP_TOP2_SUM if grouped else NO_GROUPS, bias=e_score_correction_bias,
        renormalize=norm_topk_prob, renorm_eps=1e-20, scale=routed_scaling_factor, **counts,
    )  # fmt: skip


def fused_softmax_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    **counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.softmax_grouped_topk` (DeepSeek-V2) in one launch: softmax over all experts;
    "greedy" the top_k, "group_limited_greedy" the top_k of the `topk_group` groups with the
    largest maximum (arXiv:2405.04434 sec. 2.1.3); weights times `routed_scaling_factor`, not
    renormalised.

    Args:
        router_logits: [T, E]; top_k; topk_method: "greedy" or "group_limited_greedy";
        n_group, topk_group: the group limit (read by "group_limited_greedy" only);
        routed_scaling_factor.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (by descending probability).
    """
    if topk_method != "group_limited_greedy":
        return _launch(
            router_logits, top_k, scoring=SOFTMAX_THEN_TOPK, scale=routed_scaling_factor, **counts
        )
    return _launch(
        router_logits, top_k, scoring=SOFTMAX_THEN_TOPK, n_group=n_group, topk_group=topk_group,
        group_score=GROUP_MAX, scale=routed_scaling_factor, **counts,
    )  # fmt: skip


#: The launcher of each routing rule, by the name of its torch function in
#: `moe_engine.models.layers.routing` (what `KernelPlan.router_topk` hands out for triton).
FUSED_ROUTERS = {
    "softmax_topk": fused_softmax_topk,
    "topk_softmax": fused_topk_softmax,
    "sigmoid_grouped_topk": fused_sigmoid_grouped_topk,
    "softmax_grouped_topk": fused_softmax_grouped_topk,
}
#: Every launcher takes ``expert_counts=`` / ``row_weights=`` (see the module docstring); a
#: layer reads this attribute off its router kernel rather than comparing names.
for _router in FUSED_ROUTERS.values():
    _router.COUNTS_EXPERTS = True
