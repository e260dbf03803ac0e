"""Routing: router logits -> (topk_weights [T, k] float32, topk_ids [T, k] int32), per family.

| family                         | function                   | module                     |
|--------------------------------|----------------------------|----------------------------|
| Qwen3-MoE, Mixtral, Qwen2-MoE  | `softmax_topk`             | `SoftmaxTopKRouter`        |
| gpt-oss                        | `topk_softmax`             | (FusedMoE's default path)  |
| DeepSeek-V3, GLM-4.5 (noaux)   | `sigmoid_grouped_topk`     | `SigmoidGroupedTopKRouter` |
| MiniMax-M2 (sigmoid + bias)    | `sigmoid_grouped_topk`     | (n_group = 1)              |
| ERNIE-4.5-MoE (softmax + bias) | (`scoring="softmax"`)      | (n_group = 1)              |
| DeepSeek-V2                    | `softmax_grouped_topk`     | `SoftmaxGroupedTopKRouter` |
| PhiMoE (SparseMixer, top-2)    | `sparsemixer_top2`         | `SparseMixerRouter`        |

Every selection breaks ties toward the lower expert id (and the lower group id when groups
tie): `torch.topk`, which transformers uses, leaves the order of equal values unspecified, so
selections here go through a stable descending sort instead. `topk_ids` come in descending
order of the score that chose them.

The router modules (the "module" column), which hold the checkpoint's router names, are in
`layers/routers.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    pass

#: `SoftmaxGroupedTopKRouter` selection methods (DeepSeek-V2 config `topk_method`).
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
#: How `sigmoid_grouped_topk` turns logits into scores: sigmoid (DeepSeek-V3, GLM-4.5,
#: MiniMax-M2), a softmax over all experts (ERNIE-4.5-MoE), or sigmoid weights with the
#: biased logits choosing ("logits": Kolibri-1).
SCORINGS = ("sigmoid", "softmax", "logits")



def sort_topk(scores: torch.Tensor, k: int, renormalize: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of scores [T, N] float32, descending, the lower index first on
    ties, through a stable descending sort (torch ops; any device); with `renormalize` the
    values divided by their row's sum. Returns (values [T, k] float32, ids [T, k] int64)."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, ids = values[:, :k], ids[:, :k]
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top-k, optionally renormalised to sum to 1.

    The routing of Qwen3-MoE and Qwen2-MoE (`norm_topk_prob`) and Mixtral (always
    renormalised) in Hugging Face `transformers`. Ties go to the lower expert id (stable sort),
    so identical logits still give k distinct experts deterministically. On a CPU bound to
    native-cpu for "router_topk", `FusedMoE` routes through `kernels.dense.ops.
    router_softmax_topk` instead (one call, the same selection rule).

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.
        renormalize: divide the k probabilities by their sum.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = sort_topk(probs, top_k, renormalize)
    return weights, ids.to(torch.int32)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the logits, then softmax over those k (gpt-oss; `GptOssTopKRouter` in Hugging
    Face `transformers`, whose `torch.topk` and softmax in the logits' dtype this repeats).

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.

    Returns:
        topk_weights [T, k] float32 (sum to 1), topk_ids [T, k] int32.
    """
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    weights = F.softmax(logits, dim=-1, dtype=logits.dtype).float()
    return weights, ids.to(torch.int32)


def check_group_limits(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Refuse a group-limited routing configuration that cannot be served.

    Args:
        num_experts: `n_routed_experts`; top_k: `num_experts_per_tok`;
        n_group: groups the experts are split into (contiguous ids, E / n_group each);
        topk_group: groups each token may use.

    Raises:
        ValueError: naming the config field, its value and the limit: n_routed_experts not
            divisible by n_group, topk_group outside [1, n_group], or num_experts_per_tok
            larger than topk_group * (experts per group) (the token could not get k experts
            without using an excluded group).
    """
    if n_group < 1 or num_experts % n_group:
        raise ValueError(
            f"n_routed_experts ({num_experts}) must be divisible by n_group ({n_group}): "
            "group-limited routing splits the experts into n_group equal groups"
        )
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group}) must be in [1, n_group = {n_group}]")
    per_group = num_experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok ({top_k}) must be in [1, topk_group * experts per group = "
            f"{topk_group} * {per_group} = {topk_group * per_group}]"
        )


def check_sigmoid_group_limits(
    num_experts: int, top_k: int, n_group: int, topk_group: int
) -> None:
    """`check_group_limits` plus the sigmoid rule's own: at least 2 experts per group (a
    group's score is the sum of its two best biased scores, `sigmoid_grouped_topk`).

    Raises:
        ValueError: see `check_group_limits`; fewer than 2 experts per group (names
            n_routed_experts and n_group).
    """
    check_group_limits(num_experts, top_k, n_group, topk_group)
    if num_experts // n_group < 2:
        raise ValueError(
            f"n_group ({n_group}) leaves {num_experts // n_group} expert per group; the group "
            f"score sums each group's two best experts, so n_routed_experts ({num_experts}) / "
            "n_group must be >= 2"
        )


def check_v2_routing(
    num_experts: int, top_k: int, topk_method: str, n_group: int | None, topk_group: int | None
) -> None:
    """Refuse a DeepSeek-V2 routing configuration that cannot be served.

    Raises:
        ValueError: topk_method not in `V2_TOPK_METHODS`; for "group_limited_greedy", n_group
            or topk_group missing, or limits `check_group_limits` refuses; top_k outside [1, E].
    """
    if topk_method not in V2_TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {V2_TOPK_METHODS}, got {topk_method!r}")
    if topk_method == "group_limited_greedy":
        if n_group is None or topk_group is None:
            raise ValueError(
                f"topk_method 'group_limited_greedy' needs n_group and topk_group, got "
                f"n_group={n_group}, topk_group={topk_group}"
            )
        check_group_limits(num_experts, top_k, n_group, topk_group)
    elif not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")


def _stable_topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64 indices of the k largest of scores [T, N], the lower index first on ties."""
    return sort_topk(scores, k)[1]


def group_limited_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's best `topk_group` groups.

    Args:
        group_scores: [T, n_group] float, one score per group (lower group id wins ties).
        topk_group: groups kept per token.
        per_group: experts per group (E = n_group * per_group, group g = ids
            [g * per_group, (g + 1) * per_group)).
    """
    kept = _stable_topk_ids(group_scores, topk_group)
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return mask.repeat_interleave(per_group, dim=1)


def sigmoid_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    e_score_correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, bias for selection, group-limited top-k.

    1. scores = sigmoid(router_logits) in float32 (`scoring="softmax"`: the softmax over all
       experts in float32, ERNIE-4.5-MoE's `Ernie4_5_MoeTopKRouter`, whose renormalisation
       divides by max(sum, 1e-12): the same quotient for any sum of k probabilities above
       1e-12; LongCat-Flash's `LongcatFlashTopkRouter`, with a correction bias and no groups,
       and Mistral-4's `Mistral4TopkRouter`, with groups and no bias: transformers masks
       excluded groups there to 0.0, the same choice unless a kept probability underflows);
    2. the choice uses scores + e_score_correction_bias (the auxiliary-loss-free balancing
       bias of the DeepSeek-V3 technical report, arXiv:2412.19437, sec. 2.1.2: it changes
       which experts are chosen, never their weights);
    3. each of the n_group groups scores the sum of its two largest biased scores; the best
       topk_group groups stay and the experts of the others are masked to -inf, so they are
       never picked, even when every biased score is negative (group-limited routing, the
       DeepSeek-V2 paper's device-limited routing, arXiv:2405.04434, sec. 2.1.3; V3's
       node-limited routing);
    4. the top_k biased scores of the rest choose the experts (lower id wins ties);
    5. weights are the *unbiased* sigmoid scores of those experts, divided by their sum
       (+1e-20) when norm_topk_prob, then times routed_scaling_factor.
    This is `DeepseekV3TopkRouter.forward` / `Glm4MoeTopkRouter.forward` of transformers 5.24;
    with n_group = 1, norm_topk_prob and a scale of 1, `MiniMaxM2TopKRouter.forward` (sigmoid)
    and `Ernie4_5_MoeTopKRouter.forward` (softmax). `scoring="logits"`: steps 2-4 choose by
    router_logits + bias instead of the biased scores, the weights are still the sigmoid
    scores (Kolibri-1's `Kolibri1TopKRouter`).

    Args:
        router_logits: [T, E] (computed in float32 from the float32 router weight).
        top_k: experts per token.
        e_score_correction_bias: [E] float32, or None (no bias).
        n_group, topk_group: the group limit (n_group = 1, topk_group = 1: none).
        norm_topk_prob: renormalise the k weights.
        routed_scaling_factor: multiplies the weights.
        scoring: "sigmoid", "softmax" or "logits" (`SCORINGS`, checked by
            `SigmoidGroupedTopKRouter`).

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (by descending biased score).

    The limits are checked once, where they are read (`check_sigmoid_group_limits`, called
    by `SigmoidGroupedTopKRouter` and the architectures' config reading), not per step.
    """
    num_tokens, num_experts = router_logits.shape
    per_group = num_experts // n_group
    if scoring == "softmax":
        scores = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    else:
        scores = router_logits.float().sigmoid()
    choice = router_logits.float() if scoring == "logits" else scores
    if e_score_correction_bias is not None:
        choice = choice + e_score_correction_bias
    if topk_group < n_group:
        top2 = choice.view(num_tokens, n_group, per_group).topk(2, dim=-1).values
        keep = group_limited_mask(top2.sum(dim=-1), topk_group, per_group)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = _stable_topk_ids(choice, top_k)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def split_zero_experts(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take the zero-computation ("identity") experts out of a routing: the ids >= num_experts
    (LongCat-Flash's `zero_expert_num` experts after the `n_routed_experts` real ones) become
    -1 with weight 0, which dispatch and every expert kernel skip, and their weights are summed
    per token (an identity expert returns its input, so they add zero_weight x input).

    Args:
        topk_weights: [T, k] float32; topk_ids: [T, k] int32 ids in [0, num_experts + zeros).
        num_experts: the real (computing) experts E.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (-1 for zero experts), zero_weight
        [T, 1] float32.
    """
    zero = topk_ids >= num_experts
    zero_weight = torch.where(zero, topk_weights, 0.0).sum(dim=-1, keepdim=True)
    return topk_weights.masked_fill(zero, 0.0), topk_ids.masked_fill(zero, -1), zero_weight


def softmax_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: softmax over all experts, greedy or group-limited top-k, scaled.

    "greedy": the top_k softmax probabilities. "group_limited_greedy" (DeepSeek-V2 paper,
    arXiv:2405.04434, sec. 2.1.3, device-limited routing): each group scores its largest
    probability, the best topk_group groups stay, the top_k of their experts are chosen.
    Weights are the probabilities times routed_scaling_factor, *not* renormalised: transformers
    5.24's `DeepseekV2TopkRouter` drops `norm_topk_prob` (its config keeps the field, the
    router ignores it), and this repeats that router. Excluded experts are masked to -inf
    (transformers masks to 0.0, the same choice unless a kept probability underflows to 0).

    Args:
        router_logits: [T, E] (float32 from the float32 router weight).
        top_k: experts per token; topk_method: one of `V2_TOPK_METHODS`.
        n_group, topk_group: the group limit (used by "group_limited_greedy" only).
        routed_scaling_factor: multiplies the weights.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32 (by descending probability).

    The method and limits are checked once, where they are read (`check_v2_routing`, called
    by `SoftmaxGroupedTopKRouter` and DeepSeek-V2's config reading), not per step.
    """
    num_tokens, num_experts = router_logits.shape
    scores = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    choice = scores
    if topk_method == "group_limited_greedy":
        assert n_group is not None and topk_group is not None  # checked above
        per_group = num_experts // n_group
        group_max = scores.view(num_tokens, n_group, per_group).amax(dim=-1)
        keep = group_limited_mask(group_max, topk_group, per_group)
        choice = scores.masked_fill(~keep, float("-inf"))
    ids = _stable_topk_ids(choice, top_k)
    return scores.gather(1, ids) * routed_scaling_factor, ids.to(torch.int32)


def sparsemixer_top2(
    router_logits: torch.Tensor, jitter_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's inference routing, top-2 (Liu et al., "GRIN: GRadient-INformed MoE",
    arXiv:2409.12136; PhiMoE, transformers 5.24 `modeling_phimoe.sparsemixer` with
    training=False, whose ops and dtype this repeats).

    Twice, for the best and then the second-best expert (the first masked out): m = the row's
    largest logit, its expert chosen; logits with (m - logit) / max(|logit|, m) > 2 *
    jitter_eps are masked to -inf; the chosen expert's weight is its softmax probability
    among the rest. The two weights are not renormalised.

    Args:
        router_logits: [T, E] any float dtype (the weights are computed in it).
        jitter_eps: config.json `router_jitter_noise`.

    Returns:
        topk_weights [T, 2] float32, topk_ids [T, 2] int32 (best first).
    """
    weights, ids = [], []
    scores = router_logits
    for _ in range(2):
        best, chosen = scores.max(dim=-1, keepdim=True)
        factor = router_logits.abs().clamp(min=best)
        outside = (best - router_logits) / factor > 2 * jitter_eps
        gates = torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1)
        weights.append(gates.gather(-1, chosen))
        ids.append(chosen)
        scores = router_logits.scatter(-1, chosen, float("-inf"))
    return torch.cat(weights, dim=-1).float(), torch.cat(ids, dim=-1).to(torch.int32)


def routing_counts_experts(kernel: Callable[..., Any] | None) -> bool:
    """Whether a routing kernel counts the expert load in its own launch (takes
    ``expert_counts=`` / ``row_weights=``: `kernels.moe.router_kernels`'s `COUNTS_EXPERTS`)."""
    return bool(getattr(kernel, "COUNTS_EXPERTS", False))
