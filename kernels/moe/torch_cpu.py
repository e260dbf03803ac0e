"""The CPU expert path: every expert's tokens padded to one length, two batched GEMMs per layer.

On a CPU the per-expert loop of `kernels.moe.reference` is dominated by small matmuls (a few rows
each in decode) and per-op overhead. Padding each expert's rows to the longest expert's count
and running `torch.bmm` over all experts does the same arithmetic in two calls. Measured with
`python bench/moe_cpu.py --tokens 64 512 2048` (32 experts, top-4, float32, 2 threads, quiet
machine): 1.35x faster than the loop at 64 tokens (8 rows per expert), 1.07x at 512 (64 rows),
0.76x at 2048 (256 rows), where the loop's larger GEMMs win. So the loop is used when experts
average more than `MAX_ROWS_PER_EXPERT` rows, when routing is so skewed that padding would
more than quadruple the rows (weights, not rows, are the cost at these sizes), or when fewer
than a quarter of the experts have rows (decoding one token reads 4 of 32 experts' weights in
the loop, all 32 in the batched GEMMs).
"""

from __future__ import annotations

import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.reference import expert_loop
from kernels.moe.routing import combine_pairs, sort_pairs_by_expert

#: Padding may at most multiply the rows computed by this factor before the loop is used.
MAX_PADDING_FACTOR = 4.0
#: Below this fraction of experts with rows (decode of a few tokens), the loop is used: the
#: batched GEMMs would read every expert's weights for a handful of rows.
MIN_ACTIVE_FRACTION = 0.25
#: Above this many (token, expert) rows per expert on average, the per-expert loop is faster.
MAX_ROWS_PER_EXPERT = 96


def fused_moe_cpu(
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
    """Mixture of SwiGLU experts; same contract and result as `fused_moe_reference`.

    Args:
        hidden: [T, H] activations.
        w13: [E, 2*I, H] gate rows then up rows; w2: [E, H, I].
        topk_weights: [T, k] float32; topk_ids: [T, k] int32, ids outside [0, E) skipped.
        activation: plain SwiGLU (default) or gpt-oss's clamped variant.
        b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias (hidden's dtype).

    Returns:
        [T, H] in hidden's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    order, counts = sort_pairs_by_expert(topk_ids, num_experts)
    rows = sum(counts)
    if rows == 0:
        return torch.zeros_like(hidden)
    longest = max(counts)
    too_skewed = num_experts * longest > MAX_PADDING_FACTOR * rows + num_experts
    # the batched GEMMs read every expert's weights; the loop reads only the active ones
    few_active = sum(c > 0 for c in counts) < MIN_ACTIVE_FRACTION * num_experts
    if too_skewed or few_active or rows > MAX_ROWS_PER_EXPERT * num_experts:
        return expert_loop(
            hidden, w13, w2, topk_weights, order, counts, activation=activation, b13=b13, b2=b2
        )
    pair_of_row = order[:rows]  # pairs of other ranks sort last and are dropped
    count_t = torch.tensor(counts)
    expert = torch.repeat_interleave(torch.arange(num_experts), count_t)
    slot = torch.arange(rows) - (count_t.cumsum(0) - count_t)[expert]
    x = hidden.new_zeros(num_experts, longest, hidden.shape[1])
    x[expert, slot] = hidden[pair_of_row // top_k]
    gate_up = torch.bmm(x, w13.transpose(1, 2))
    if b13 is not None:
        gate_up += b13.unsqueeze(1)
    y = torch.bmm(activation(gate_up), w2.transpose(1, 2))[expert, slot]
    if b2 is not None:
        y += b2[expert]
    y *= topk_weights.reshape(-1)[pair_of_row, None].to(y.dtype)
    return combine_pairs(y, pair_of_row, num_tokens, top_k)
