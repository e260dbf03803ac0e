"""Prefill attention on a CPU one request at a time, over each request's own keys.

The torch path of `PagedAttention` attends a batch of prefill chunks together: every query row
padded to the longest chunk, every key row to the longest context, and a [B, 1, Lq, Lk] mask
(built with `where`) telling SDPA which pairs count. torch's CPU flash kernel multiplies the
masked pairs too, so a chunk of 14 prompts of 37-254 tokens (the bench's mixed-64) did about
6x the work of their causal triangles, plus the padded gathers. Here each request is one
`scaled_dot_product_attention` call on its own keys: a request whose chunk starts its context
(no cached prefix) runs with `is_causal=True` and no mask (the kernel skips the blocks above
the diagonal); a later chunk or a prefix-cache hit gets the [Lq, Lk] causal mask of its own
positions. The results are the same attention within float32 summation order (the masked
pairs' weights are exact zeros either way).

Used for CPU tensors only (the row loop reads lengths on the host) and for full attention
without sinks; sliding windows and sink logits keep the batched path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's queries over its cached keys.

    Args:
        q: [n, Hq, D], the batch's n query tokens (request after request, as
            `query_start_loc` says).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], this step's keys and values
            already written; Hkv divides Hq (GQA).
        block_tables: [B, max_blocks] int64, the requests' block tables (CPU).
        seq_lens: [B] int64, keys per request after this step (tokens; CPU).
        query_start_loc: [B + 1] int64, where each request's queries start in q (CPU).
        scale: multiplies q . k.

    Returns:
        [n, Hq, D] in q's dtype.
    """
    num_blocks, block_size, hkv, d = k_cache.shape
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gqa = q.shape[1] != hkv
    out = torch.empty_like(q)
    for row, seq_len in enumerate(lens):
        q_start, q_end = starts[row], starts[row + 1]
        q_len = q_end - q_start
        blocks = block_tables[row, : (seq_len + block_size - 1) // block_size]
        keys, values = (
            c.view(num_blocks, -1).index_select(0, blocks).view(1, -1, hkv, d)[:, :seq_len]
            .transpose(1, 2)
            for c in (k_cache, v_cache)
        )
        rq = q[q_start:q_end].unsqueeze(0).transpose(1, 2)  # [1, Hq, Lq, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(rq, keys, values, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            key_pos = torch.arange(seq_len)
            q_pos = torch.arange(seq_len - q_len, seq_len)
            mask = key_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(rq, keys, values, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
