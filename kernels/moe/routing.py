"""Token-expert pair bookkeeping shared by the plain-torch expert paths.

A routing decision `topk_ids [T, k]` is T*k (token, slot) pairs; pair p is token p // k, slot
p % k. The expert paths sort the pairs by expert once, run each expert on a contiguous run of
rows, then put the weighted rows back in pair order and sum each token's k slots.
"""

from __future__ import annotations

import torch


def sort_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, list[int]]:
    """Pairs grouped by expert, stable within an expert; pairs whose id is outside
    [0, num_experts) (experts of other ranks) go last.

    Args:
        topk_ids: [T, k] int32 expert ids.
        num_experts: E, the local experts.

    Returns:
        order: [T*k] int64 pair indices, sorted; counts: rows per expert (len E), so expert e
        owns order[sum(counts[:e]) : sum(counts[:e + 1])].
    """
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    return order, counts


def combine_pairs(
    rows: torch.Tensor, pair_of_row: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """Sum weighted expert rows back into tokens.

    Args:
        rows: [R, H] weighted expert outputs.
        pair_of_row: [R] int64, the pair each row belongs to; pairs with no row count as zero.
        num_tokens, top_k: T and k.

    Returns:
        [T, H], rows' dtype.
    """
    pairs = rows.new_zeros(num_tokens * top_k, rows.shape[1])
    pairs[pair_of_row] = rows
    return pairs.view(num_tokens, top_k, -1).sum(dim=1)
