"""Plain-torch fused MoE: the oracle for the Triton kernels and the CPU path.

Follows the expert loop of the Hugging Face Qwen3-MoE/Mixtral reference: every token-expert
pair is computed as `w2 @ (silu(gate) * up)` and added to its token weighted by `topk_weights`.
Pairs are sorted by expert once so that each expert with tokens runs one matmul per projection;
the weighted results go back to (token, slot) order and are summed over the k slots.

Optionally, as in Hugging Face's `GptOssExperts`: gpt-oss's clamped SwiGLU
(`kernels.moe.activation.SwiGLU(alpha, limit)`) and per-expert biases `b13 [E, 2I]` (added to the
gate/up projection) and `b2 [E, H]` (added to the down projection before the routing weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.routing import combine_pairs, sort_pairs_by_expert


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of SwiGLU experts.

    Args:
        hidden: [T, H] activations (float32 or bfloat16).
        w13: [E, 2*I, H], gate rows [0, I) then up rows [I, 2I); same dtype as hidden.
        w2: [E, H, I] down projection.
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] int32 expert ids in [0, E); ids outside (e.g. -1) are skipped.
        activation: plain SwiGLU (default) or gpt-oss's clamped variant.
        b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias (hidden's dtype).

    Returns:
        [T, H] in hidden's dtype: sum over the k experts of
        weight * (w2 @ act(w13 @ hidden + b13) + b2).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    order, counts = sort_pairs_by_expert(topk_ids, num_experts)
    return expert_loop(
        hidden, w13, w2, topk_weights, order, counts, activation=activation, b13=b13, b2=b2
    )


def expert_loop(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-expert loop of `fused_moe_reference` on pairs already sorted by
    `kernels.moe.routing.sort_pairs_by_expert` (`order` [T*k] int64, `counts` rows per expert);
    `activation`, `b13` and `b2` as there."""
    num_tokens, top_k = topk_weights.shape
    x = hidden[order // top_k]  # [T*k, H], one gather
    y = torch.zeros_like(x)  # pairs of other ranks (id outside [0, E)) stay zero
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        bias13 = None if b13 is None else b13[expert]
        bias2 = None if b2 is None else b2[expert]
        act = activation(F.linear(x[start:end], w13[expert], bias13))
        y[start:end] = F.linear(act, w2[expert], bias2)
        start = end
    y *= topk_weights.reshape(-1)[order, None].to(y.dtype)
    return combine_pairs(y, order, num_tokens, top_k)
