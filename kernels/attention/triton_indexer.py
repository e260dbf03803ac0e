"""The lightning indexer's scores in Triton (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5),
read through the paged key cache.

For query token t (row b, position p) and key position s of its row:

    I(t, s) = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s])     (float32; -inf unless s <= p and
                                                                 s < seq_lens[b])

with the keys k [num_blocks, block_size, d] gathered through the row's block table (no copy of
the context). One program per (token, tile of BLOCK_N keys): the tile's keys are loaded once
for all heads, q . k is one ``tl.dot`` of [BLOCK_H, d] x [d, BLOCK_N] in IEEE float32 (no TF32),
the head sum a reduction over the tile. The top-k itself is ``torch.topk`` on the scores (the
per-row selection of the torch path, `moe_engine.models.layers.indexer.LightningIndexer`,
which is the reference: tests/test_family_dsa.py compares the two under
``TRITON_INTERPRET=1``). The reference DeepSeek kernel scores in FP8 after a Hadamard rotation;
transformers (the oracle here) and this kernel score in float32.

Graph-safe: no host sync; the grid depends on the shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Keys per program (a power of two >= 16, `tl.dot`'s smallest tile).
BLOCK_N = 32


@triton.jit
def indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, block_tables_ptr, tok_row_ptr, tok_pos_ptr, seq_lens_ptr, out_ptr,
    num_heads, head_dim, block_size, num_keys, scale,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ks, stride_bt, stride_ot,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    tile = tl.program_id(1)
    row = tl.load(tok_row_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    seq_len = tl.load(seq_lens_ptr + row)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    q_mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=offs_h < num_heads, other=0.0)
    visible = (offs_n <= pos) & (offs_n < seq_len)
    block = tl.load(block_tables_ptr + row * stride_bt + offs_n // block_size, mask=visible,
                    other=0)
    slot = block.to(tl.int64) * stride_kb + (offs_n % block_size) * stride_ks
    k = tl.load(k_ptr + slot[None, :] + offs_d[:, None],
                mask=visible[None, :] & (offs_d[:, None] < head_dim), other=0.0).to(tl.float32)
    scores = tl.maximum(tl.dot(q, k, input_precision="ieee") * scale, 0.0)  # [BLOCK_H, BLOCK_N]
    index = tl.sum(w[:, None] * scores, axis=0)
    index = tl.where(visible, index, float("-inf"))
    tl.store(out_ptr + t * stride_ot + offs_n, index, mask=offs_n < num_keys)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_rows: torch.Tensor,
    token_positions: torch.Tensor,
    seq_lens: torch.Tensor,
    num_keys: int,
    scale: float,
) -> torch.Tensor:
    """The indexer scores of N query tokens over their rows' keys (module doc).

    Args:
        q: [N, heads, d] float32/bfloat16/float16 (contiguous last dim), the roped indexer
            queries.
        weights: [N, heads] float32, the head weights (times heads^-0.5).
        key_cache: [num_blocks, block_size, d], the indexer keys (contiguous).
        block_tables: [B, max_blocks] int32/int64 (padded with the null block 0).
        token_rows: [N] int64, each token's row of block_tables.
        token_positions: [N] int64, each token's position (it sees keys 0..position).
        seq_lens: [B] int64 keys per row (tokens).
        num_keys: columns of the result (>= every row's seq_len; keys past it are -inf).
        scale: d^-0.5.

    Returns:
        [N, num_keys] float32, -inf at invisible keys.

    Raises:
        ValueError: mismatched widths or a key cache of another last dim than q's.
    """
    n, heads, d = q.shape
    if weights.shape != (n, heads) or key_cache.shape[-1] != d:
        raise ValueError(
            f"indexer_scores: q {tuple(q.shape)}, weights {tuple(weights.shape)} and key cache "
            f"{tuple(key_cache.shape)} disagree (want weights [N, heads], keys [..., d])"
        )
    out = torch.empty(n, num_keys, dtype=torch.float32, device=q.device)
    if n == 0 or num_keys == 0:
        return out
    weights = weights.float().contiguous()
    grid = (n, triton.cdiv(num_keys, BLOCK_N))
    indexer_scores_kernel[grid](
        q, weights, key_cache, block_tables, token_rows, token_positions, seq_lens, out,
        heads, d, key_cache.shape[1], num_keys, scale,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0), out.stride(0),
        BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
