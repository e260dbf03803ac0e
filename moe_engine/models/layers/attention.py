"""Attention over the paged KV cache (PagedAttention, Kwon et al., SOSP'23), CPU-friendly.

Each step's tokens are laid out flat; the model runner groups the requests into at most two
batches: single-token queries (decodes) and multi-token queries (prefill chunks). For each batch
one `scaled_dot_product_attention` call reads the keys through the block tables (whole blocks
gathered with one `index_select`), with a mask that is causal from each request's start
position. So the cost per layer is two batched calls per step, never a loop per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Requests of one step whose queries are attended together.

    Attributes:
        token_start, token_end: their tokens' range in the step's flat token layout.
        tok_b: [n] int64, batch row of each of the n tokens.
        tok_q: [n] int64, query column of each token within its row.
        block_ids: [B * nb] int64, the rows' block tables cut to nb = ceil(Lk / block_size)
            blocks and flattened (0 for padding).
        mask: [B, 1, Lq, nb * block_size] bool, True where the query may attend the key.
        max_q: Lq, the longest query in the batch (tokens).
    """

    token_start: int
    token_end: int
    tok_b: torch.Tensor
    tok_q: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor
    max_q: int


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step.

    Attributes:
        slot_mapping: [T] int64, cache slot (block_id * block_size + offset) of each new token.
        batches: the query batches, covering [0, T) in order.
    """

    slot_mapping: torch.Tensor
    batches: list[AttentionBatch]


def build_attention_batch(
    token_start: int,
    q_lens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionBatch:
    """Build one query batch's gather indices and mask, vectorised over its requests.

    Args:
        token_start: flat index of the batch's first token.
        q_lens: [B] int64, tokens fed per request this step.
        starts: [B] int64, tokens already cached per request (position of its first query).
        block_tables: [B, max_blocks] int64, padded with 0.
        block_size: tokens per block.
    """
    seq_lens = starts + q_lens
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    b = q_lens.numel()
    tok_b = torch.repeat_interleave(torch.arange(b), q_lens)
    offsets = torch.cumsum(q_lens, 0) - q_lens
    tok_q = torch.arange(int(q_lens.sum())) - offsets[tok_b]
    num_blocks = (max_k + block_size - 1) // block_size
    key_pos = torch.arange(num_blocks * block_size)
    q_pos = starts[:, None] + torch.arange(max_q)[None, :]  # [B, Lq] absolute positions
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < seq_lens[:, None, None]
    )
    return AttentionBatch(
        token_start=token_start,
        token_end=token_start + int(q_lens.sum()),
        tok_b=tok_b,
        tok_q=tok_q,
        block_ids=block_tables[:, :num_blocks].reshape(-1),
        mask=mask.unsqueeze(1),
        max_q=max_q,
    )


class PagedAttention(torch.nn.Module):
    """Writes this step's K/V into the layer's cache and attends through the block tables.

    Args:
        num_heads: query heads; num_kv_heads: key/value heads (GQA when fewer); head_dim.
        scale: softmax scale (head_dim ** -0.5 for the models here).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]; kv_cache: two [num_blocks, block_size, Hkv, D].

        Returns:
            [T, Hq * D] attention output, q's dtype.
        """
        k_cache, v_cache = kv_cache
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache.view(-1, *new.shape[1:]).index_copy_(0, meta.slot_mapping, new.to(cache.dtype))
        out = torch.empty_like(q)
        for batch in meta.batches:
            out[batch.token_start : batch.token_end] = self._attend(
                q[batch.token_start : batch.token_end], k_cache, v_cache, batch
            )
        return out.view(q.shape[0], -1)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        b = batch.mask.shape[0]
        keys, values = (_gather_blocks(c, batch.block_ids, b) for c in (k_cache, v_cache))
        if batch.max_q == 1:
            # Decode: a KV head's G query heads become its G query rows, so one
            # non-GQA call covers the batch (faster on CPU than enable_gqa).
            groups = self.num_heads // self.num_kv_heads
            q_rows = q.view(b, self.num_kv_heads, groups, self.head_dim)
            o = F.scaled_dot_product_attention(
                q_rows, keys, values, attn_mask=batch.mask, scale=self.scale
            )
            return o.reshape(b, self.num_heads, self.head_dim)
        q_pad = q.new_zeros(b, batch.max_q, self.num_heads, self.head_dim)
        q_pad[batch.tok_b, batch.tok_q] = q
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=batch.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)  # [B, Lq, Hq, D]
        return o[batch.tok_b, batch.tok_q]


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; block_ids: [rows * nb] -> [rows, Hkv, L, D].

    Whole blocks are copied as contiguous rows, which is several times faster than gathering
    key slots one by one.
    """
    num_blocks, block_size, heads, dim = cache.shape
    flat = cache.view(num_blocks, -1).index_select(0, block_ids)
    return flat.view(rows, -1, heads, dim).transpose(1, 2)
