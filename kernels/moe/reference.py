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


def moe_align_block_size_reference(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.moe.fused_moe.moe_align_block_size` (same arguments, outputs and
    contract, arguments unchecked) in plain torch on ``topk_ids``' device: one stable argsort,
    a scatter-add count and a scatter, vectorised, about 40 small ops. Nothing is read back to
    the host (no ``.item()``, no ``bincount``, whose CUDA version reads the maximum back).

    Returns:
        ``sorted_token_ids [max_padded]``, ``expert_ids [max_padded // block_size]``,
        ``num_tokens_post_padded [1]``, int32.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    # kernels.moe.fused_moe.max_num_tokens_padded (that module imports Triton)
    bound = max(num_pairs + min(num_experts, num_pairs) * (block_size - 1), 1)
    max_padded = -(-bound // block_size) * block_size
    valid = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(valid, flat, num_experts)  # invalid pairs sort last, to a dump slot
    order = torch.argsort(keyed, stable=True)
    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_all.scatter_add_(0, keyed, torch.ones_like(keyed))
    counts = counts_all[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_ends = torch.cumsum(padded, 0)
    sorted_keys = keyed[order]
    first_of_key = torch.cumsum(counts_all, 0) - counts_all
    rank_in_expert = torch.arange(num_pairs, device=device) - first_of_key[sorted_keys]
    # destination of each sorted pair; invalid pairs all go to slot max_padded, cut below
    starts = torch.cat([padded_ends - padded, padded_ends.new_full((1,), max_padded)])
    dest = torch.where(sorted_keys < num_experts, starts[sorted_keys] + rank_in_expert, max_padded)
    buffer = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    buffer[dest] = order.to(torch.int32)
    sorted_token_ids = buffer[:max_padded]
    block_starts = torch.arange(0, max_padded, block_size, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    total = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, total
