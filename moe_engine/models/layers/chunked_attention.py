"""Chunked local attention over the paged KV cache, as virtual batches of plain causal attention.

Chunked local attention (Llama 4's local layers, `attention_chunk_size` C): the context is cut
into chunks of C tokens from position 0, and a query at position p attends the keys
[floor(p / C) * C, p] only (transformers' `chunked_overlay` and'ed with the causal mask).

Rather than a mask, each request of an attention batch becomes one *virtual request* per chunk
its queries touch (vLLM's `make_local_attention_virtual_batches`): the virtual request's block
table starts at its chunk's first block (C is a multiple of block_size, `ChunkedLocalAttention
Spec`), its keys are the chunk's keys up to its last query, its queries those of the chunk. Its
attention is then plain causal attention, so every paged-attention kernel (native decode and
prefill, Triton, the torch paths) runs it unchanged, and it costs O(C) keys per query instead
of the whole context. The flat token order is unchanged (a request's queries are in position
order, so its chunks' queries follow one another): the layer's q, k and v are not permuted.
The virtual batch of a decode batch has one row per request and static shapes (no host sync),
so decode steps stay capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from moe_engine.kv_cache.spec import CHUNKED_LOCAL_ATTENTION
from moe_engine.models.layers.attention import (
    AttentionBatch,
    AttentionMetadata,
    PagedAttention,
    build_attention_batch,
)


def local_attention_batch(batch: AttentionBatch, chunk: int, block_size: int) -> AttentionBatch:
    """The virtual batch of chunked local attention for `batch` (built once per batch and
    chunk, then shared by the layers: it is cached in the batch like its masks).

    Args:
        batch: a step's query batch (`attention.build_attention_batch` /
            `build_decode_batch`).
        chunk: attention_chunk_size C (tokens), a multiple of block_size.
        block_size: tokens per KV block.

    Returns:
        An `AttentionBatch` over the same token range whose rows are (request, chunk) pairs:
        block_tables [R, C / block_size] int64 starting at each chunk's first block, seq_lens
        [R] the chunk's keys up to its last query, positions relative to the chunk start.

    Raises:
        ValueError: chunk not a positive multiple of block_size.
    """
    if chunk < 1 or chunk % block_size:
        raise ValueError(
            f"attention_chunk_size {chunk} must be a positive multiple of the KV block size "
            f"{block_size}"
        )
    key = ("chunked", chunk, block_size)
    cached = batch._masks.get(key)
    if cached is None:
        build = _decode_batch if batch.max_q == 1 else _prefill_batch
        cached = batch._masks[key] = build(batch, chunk, block_size)
    return cached


def _chunk_tables(tables: torch.Tensor, chunk_start: torch.Tensor, chunk: int,
                  block_size: int) -> torch.Tensor:
    """[R, max_blocks] block tables, [R] first position of each row's chunk -> [R, C /
    block_size]: the chunk's block ids (the null block 0 past the table's end)."""
    cols = (chunk_start // block_size)[:, None] + torch.arange(
        chunk // block_size, device=tables.device
    )
    inside = cols < tables.shape[1]
    picked = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
    return torch.where(inside, picked, torch.zeros_like(picked))


def _decode_batch(batch: AttentionBatch, chunk: int, block_size: int) -> AttentionBatch:
    """One query per request: one virtual row per request (static shapes, no host sync)."""
    seq_lens = batch.seq_lens
    chunk_start = (seq_lens - 1) // chunk * chunk
    tables = _chunk_tables(batch.block_tables, chunk_start, chunk, block_size)
    local_lens = seq_lens - chunk_start
    return AttentionBatch(
        token_start=batch.token_start,
        token_end=batch.token_end,
        tok_b=batch.tok_b,
        tok_q=batch.tok_q,
        block_ids=tables.reshape(-1),
        max_q=1,
        q_pos=(local_lens - 1)[:, None],
        block_tables=tables,
        seq_lens=local_lens,
        num_keys=chunk,
        query_start_loc=batch.query_start_loc,
    )


def _prefill_batch(batch: AttentionBatch, chunk: int, block_size: int) -> AttentionBatch:
    """Prefill chunks: one virtual row per (request, attention chunk) its queries touch."""
    seq_lens = batch.seq_lens
    device = seq_lens.device
    q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    starts = seq_lens - q_lens
    first, last = starts // chunk, (seq_lens - 1) // chunk
    per_row = last - first + 1
    rows = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=device), per_row)
    offsets = torch.cumsum(per_row, 0) - per_row
    index = torch.arange(rows.shape[0], device=device) - offsets[rows]
    chunk_start = (first[rows] + index) * chunk
    ends = torch.minimum(seq_lens[rows], chunk_start + chunk)
    query_start = torch.maximum(starts[rows], chunk_start)
    tables = _chunk_tables(batch.block_tables[rows], chunk_start, chunk, block_size)
    return build_attention_batch(
        batch.token_start, ends - query_start, query_start - chunk_start, tables, block_size
    )


class ChunkedLocalPagedAttention(PagedAttention):
    """`PagedAttention` whose queries see only their own chunk of `attention_chunk_size` tokens
    (through `local_attention_batch`); its layers form a `ChunkedLocalAttentionSpec` KV-cache
    group, which gives back the blocks before the current chunk.

    Args:
        num_heads, num_kv_heads, head_dim, scale: as `PagedAttention`.
        attention_chunk_size: C (tokens), a multiple of the KV block size.

    Raises:
        ValueError: attention_chunk_size < 1.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 attention_chunk_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1 token, got {attention_chunk_size}")
        self.attention_chunk_size = attention_chunk_size

    @property
    def cache_kind(self) -> str:
        return CHUNKED_LOCAL_ATTENTION

    def query_batches(self, meta: AttentionMetadata, block_size: int) -> list[AttentionBatch]:
        """The step's batches as chunk-local virtual batches."""
        return [local_attention_batch(b, self.attention_chunk_size, block_size)
                for b in meta.batches]
