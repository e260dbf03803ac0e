"""Paged attention in Triton: varlen prefill and decode through the block table, MLA decode.

The KV cache is paged (PagedAttention, Kwon et al., SOSP 2023): keys and values live in
fixed-size blocks ``[num_blocks, block_size, Hkv, D]`` and each request's ``block_table`` row
lists its blocks in order (padded with the null block 0). Each program gathers key tiles through
the block table and keeps FlashAttention-2's online softmax (Dao, 2023): a running row maximum
``m``, denominator ``l`` and unnormalised fp32 accumulator, rescaled tile by tile, in base 2
(``exp2`` of logits pre-multiplied by ``log2(e)``). The launch layout follows the design of vLLM's
Triton unified attention (an independent implementation): one program per (request,
tile of ``BLOCK_Q`` queries, kv head) whose rows are the ``BLOCK_Q x G`` (query, head) pairs of
the kv head's ``G`` query heads (GQA), so each key tile is loaded once for all of them.

- :func:`paged_attention`: prefill over chunked context, mixed query lengths and decode in one
  call (the queries of request ``b`` are its last ``q_len`` positions), causal, optional sliding
  window and gpt-oss attention sinks. ``max_query_len == 1`` launches the decode layout (one
  program per (request, kv head), ``BLOCK_Q = 1``), split along the keys (flash-decoding) when
  the block table is long and the batch too small to fill the device; a reduction kernel merges
  the splits' partial ``(acc, m, l)``.
- :func:`mla_decode`: DeepSeek-V2/V3 absorbed MLA decode on FlashMLA's latent layout
  ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: all heads attend one shared latent per
  token, values are its first ``kv_lora_rank`` columns.

Graph-safe: no host sync; grids and scratch shapes depend only on tensor shapes and the host int
``max_query_len``. Requests with ``seq_len == 0`` (CUDA-graph padding rows) read no key and write
zeros. The torch references are ``moe_engine.models.layers.attention.attention_with_sinks``
(and SDPA) and ``MLAAttention._decode_absorbed``; tests/test_triton_attention.py compares with a
float64 torch reference under ``TRITON_INTERPRET=1`` (relative Frobenius error: fp32 < 1e-5,
bf16/fp16 < 1e-2). The ``@triton.jit`` kernels are in
:mod:`kernels.attention.triton_attention_kernels`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from kernels.attention.triton_attention_kernels import (
    merge_kv_splits_kernel,
    mla_decode_kernel,
    paged_attention_kernel,
)

LOG2E = 1.4426950408889634
MIN_TILE = 16  # tl.dot needs every tile dimension >= 16
MIN_KEYS_PER_SPLIT = 512  # flash-decoding: a split below this many keys costs more than it hides
MAX_KV_SPLITS = 16
TARGET_PROGRAMS = 256  # about two waves of programs on a 132-SM H100/H200


@dataclass(frozen=True)
class AttentionTileConfig:
    """Tile sizes of one launch.

    Attributes:
        block_m: prefill rows per program ((query, head) pairs: ``BLOCK_Q x G_PAD``); for decode
            and MLA, query heads per program (MLA: ``BLOCK_H``).
        block_n: keys per tile (any power of two >= 16; tiles may span several paged blocks).
        num_warps, num_stages: Triton launch options.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: (largest head_dim, prefill config, decode config), for 16-bit inputs. Starting points after
#: FlashAttention-2's and vLLM's defaults (smaller tiles, more warps as head_dim grows keep the
#: fp32 accumulator and the K/V tiles in registers). Checked by compiling for sm_90 without a
#: GPU (ptxas, `cuobjdump -res-usage`): 185-242 registers a thread, no spills, for GQA groups of
#: 1-16; speed not yet measured on a GPU.
_TILE_TABLE: tuple[tuple[int, AttentionTileConfig, AttentionTileConfig], ...] = (
    (64, AttentionTileConfig(64, 64, 4, 2), AttentionTileConfig(16, 64, 4, 2)),
    (128, AttentionTileConfig(64, 32, 8, 2), AttentionTileConfig(16, 64, 8, 2)),
    (256, AttentionTileConfig(32, 32, 8, 1), AttentionTileConfig(16, 32, 8, 1)),
)
#: MLA decode, kv_lora_rank + rope_dim = 576 in real models: 16 heads per program (FlashMLA's
#: 64-head tiles do not fit Triton's registers with a 512-wide accumulator), 32 latents a tile
#: at every block size (64-key tiles, `_key_tile` at FlashMLA's block size 64, spilled 528-560
#: B a thread on sm_90); compiled at rank 512, rope 64: 152-231 registers, no spills.
_MLA_CONFIG = AttentionTileConfig(16, 32, 8, 1)


def tile_config(
    head_dim: int, block_size: int, *, decode: bool, dtype: torch.dtype = torch.bfloat16
) -> AttentionTileConfig:
    """The tile config for ``head_dim``, the cache's ``block_size`` (tokens) and ``dtype``.

    The head_dim row of ``_TILE_TABLE`` (the last row above 256); float32 halves ``block_m``
    (prefill) and ``block_n`` (down to 16): its IEEE dots run on FMA units and spill registers
    at the 16-bit tiles. ``block_n`` is then raised by :func:`_key_tile`.
    """
    row = next((r for r in _TILE_TABLE if head_dim <= r[0]), _TILE_TABLE[-1])
    cfg = row[2] if decode else row[1]
    block_m, block_n = cfg.block_m, cfg.block_n
    if dtype == torch.float32:
        block_m = block_m if decode else max(MIN_TILE, block_m // 2)
        block_n = max(MIN_TILE, block_n // 2)
    return AttentionTileConfig(
        block_m, _key_tile(block_n, block_size), cfg.num_warps, cfg.num_stages
    )


def _key_tile(block_n: int, block_size: int) -> int:
    """``block_n`` raised to a power-of-two ``block_size`` <= 64, so that a key tile covers whole
    paged blocks (each block read as one contiguous run)."""
    if block_size <= 64 and block_size & (block_size - 1) == 0:
        return max(block_n, block_size)
    return block_n


def num_kv_splits(programs: int, max_keys: int) -> int:
    """Flash-decoding splits (>= 1) for ``programs`` (request, head-group) programs over block
    tables of ``max_keys`` key slots: from shapes only, so a captured graph keeps its split."""
    if max_keys < 2 * MIN_KEYS_PER_SPLIT or programs >= TARGET_PROGRAMS:
        return 1
    by_length = max_keys // MIN_KEYS_PER_SPLIT
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, programs)
    return max(1, min(MAX_KV_SPLITS, by_length, by_occupancy))


# --- launchers ------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _dot_flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(FP32_DOT, ROUND_BF16): fp32 operands for fp32 inputs (IEEE, no TF32) and for 16-bit ones
    under the interpreter (its tl.dot on bf16 multiplies bit patterns); bf16 rounding to
    nearest even under the interpreter (it truncates)."""
    knobs = getattr(triton, "knobs", None)  # newer Triton; older ones read the variable
    env = os.environ.get("TRITON_INTERPRET") == "1"
    interpret = bool(knobs.runtime.interpret) if knobs is not None else env
    return dtype == torch.float32 or interpret, interpret and dtype == torch.bfloat16


def _require(ok: bool, field: str, value: object, reason: str) -> None:
    if not ok:
        raise ValueError(f"{field} {value}: {reason}")


def _check_tables(block_tables, seq_lens, device: torch.device, rows: int | None) -> None:
    _require(block_tables.dim() == 2 and block_tables.dtype in _INDEX_DTYPES,
             "block_tables", (tuple(block_tables.shape), block_tables.dtype),
             "must be [B, max_blocks] int32/int64")  # fmt: skip
    _require(block_tables.stride(-1) == 1, "block_tables.stride", block_tables.stride(),
             "rows must be contiguous")  # fmt: skip
    b = block_tables.shape[0]
    _require(tuple(seq_lens.shape) == (b,) and seq_lens.dtype in _INDEX_DTYPES, "seq_lens",
             (tuple(seq_lens.shape), seq_lens.dtype), f"must be [{b}] int32/int64")  # fmt: skip
    _require(rows is None or rows == b, "batch rows", rows, f"must match block_tables' {b}")
    _require(seq_lens.is_contiguous(), "seq_lens.stride", seq_lens.stride(), "must be dense")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        _require(t.device == device, f"{name}.device", t.device, f"must be q's {device}")


def _check_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                 max_query_len, sliding_window, sinks, out) -> None:  # fmt: skip
    """ValueError for what :func:`paged_attention` does not take (shapes and metadata only:
    nothing here reads a device tensor, so the call stays graph-safe)."""
    _require(q.dim() == 3 and q.dtype in _FLOAT_DTYPES, "q", (tuple(q.shape), q.dtype),
             "must be [T, Hq, D] float32/bfloat16/float16")  # fmt: skip
    t, hq, d = q.shape
    _require(k_cache.dim() == 4 and k_cache.shape[-1] == d, "k_cache.shape",
             tuple(k_cache.shape), f"must be [num_blocks, block_size, Hkv, {d}]")  # fmt: skip
    _require(v_cache.shape == k_cache.shape, "v_cache.shape", tuple(v_cache.shape),
             f"must equal k_cache's {tuple(k_cache.shape)}")  # fmt: skip
    _require(hq % k_cache.shape[2] == 0, "Hkv", k_cache.shape[2], f"must divide Hq {hq}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if x is not None:
            _require(x.dtype == q.dtype, f"{name}.dtype", x.dtype, f"must be q's {q.dtype}")
            _require(x.device == q.device, f"{name}.device", x.device, f"must be q's {q.device}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if x is not None:
            _require(x.stride(-1) == 1, f"{name}.stride", x.stride(), "last dim must be dense")
    _require(out is None or out.shape == q.shape, "out.shape", None if out is None else
             tuple(out.shape), f"must equal q's {tuple(q.shape)}")  # fmt: skip
    _check_tables(block_tables, seq_lens, q.device, None)
    b = block_tables.shape[0]
    _require(tuple(query_start_loc.shape) == (b + 1,) and query_start_loc.dtype in
             _INDEX_DTYPES and query_start_loc.device == q.device and
             query_start_loc.is_contiguous(), "query_start_loc",
             (tuple(query_start_loc.shape), query_start_loc.dtype, query_start_loc.device),
             f"must be dense [{b + 1}] int32/int64 on {q.device}")  # fmt: skip
    _require(isinstance(max_query_len, int) and max_query_len >= 1, "max_query_len",
             max_query_len, "must be a host int >= 1")  # fmt: skip
    _require(sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
             "sliding_window", sliding_window, "must be None or an int >= 1")  # fmt: skip
    _require(sinks is None or (tuple(sinks.shape) == (hq,) and sinks.is_floating_point() and
             sinks.device == q.device and sinks.is_contiguous()), "sinks", None if sinks is None
             else (tuple(sinks.shape), sinks.dtype),
             f"must be dense [{hq}] float on {q.device}")  # fmt: skip


def _split_scratch(rows: int, splits: int, width: int, device: torch.device):
    """Partial acc [rows * splits, width] and (m, l) [rows * splits, 2], fp32, uninitialised:
    every split of every row a program owns is written (an empty split as m = -inf, l = 0,
    acc = 0), so no fill launch is needed; rows no program owns (tokens past
    query_start_loc[B]) merge to unspecified values, as their outputs are documented."""
    n = rows * splits
    return (torch.empty(n, width, dtype=torch.float32, device=device),
            torch.empty(n, 2, dtype=torch.float32, device=device))  # fmt: skip


def _merge(out, part_acc, part_ml, sinks, rows, heads, splits, dim, dim_pad, round_bf16):
    merge_kv_splits_kernel[(rows,)](
        out, part_acc, part_ml, out if sinks is None else sinks, heads,
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), DIM=dim, DIM_PAD=dim_pad,
        HAS_SINKS=sinks is not None, ROUND_BF16=round_bf16, num_warps=4,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of queries over the paged KV cache.

    Args:
        q: [T, Hq, D] float32/bfloat16/float16, the batch's query tokens, requests contiguous;
            request b's q_len_b = query_start_loc[b + 1] - query_start_loc[b] queries are its
            LAST q_len_b positions (query i at position seq_lens[b] - q_len_b + i).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype, Hkv dividing Hq (GQA:
            query head h reads kv head h // (Hq // Hkv)).
        block_tables: [B, max_blocks] int32/int64 block ids (padded with the null block 0).
        seq_lens: [B] int32/int64 keys of each request after this step (tokens); 0 for CUDA-graph
            padding rows (their queries get zeros, no key is read).
        query_start_loc: [B + 1] int32/int64 cumulative query lengths.
        scale: multiplies q . k.
        max_query_len: host int >= 1, the longest q_len_b; 1 selects the decode launch (split
            along the keys when ``num_kv_splits`` says so).
        sliding_window: key k visible to the query at p iff p - window < k <= p (transformers'
            convention); None: every earlier key.
        sinks: optional [Hq] float per-head sink logits (gpt-oss): one more, value-less softmax
            column exp(sinks[h]), as ``attention_with_sinks``.
        out: optional [T, Hq, D] in q's dtype, written in place.

    Returns:
        [T, Hq, D] in q's dtype (``out`` when given); fp32 scores, softmax and accumulation.
        Tokens past query_start_loc[B] (if T is larger) belong to no request: unspecified.

    Raises:
        ValueError: a shape, dtype, device or layout the kernels do not take (names the field).
    """
    return invoke_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale,
        max_query_len=max_query_len, sliding_window=sliding_window, sinks=sinks, out=out,
    )  # fmt: skip


def invoke_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale: float,
    max_query_len: int, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None, config: AttentionTileConfig | None = None,
    kv_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_attention` with the tile ``config`` and the number of ``kv_splits`` forced
    (None: ``tile_config`` and, for decode, ``num_kv_splits``; 1 for prefill)."""
    _check_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                 max_query_len=max_query_len, sliding_window=sliding_window, sinks=sinks,
                 out=out)  # fmt: skip
    out = torch.empty_like(q) if out is None else out
    num_tokens, hq, d = q.shape
    batch, (_, block_size, hkv, _) = block_tables.shape[0], k_cache.shape
    if num_tokens == 0 or batch == 0:
        return out
    groups, decode = hq // hkv, max_query_len == 1
    cfg = config or tile_config(d, block_size, decode=decode, dtype=q.dtype)
    _require(cfg.block_n >= MIN_TILE and cfg.block_n & (cfg.block_n - 1) == 0, "config.block_n",
             cfg.block_n, f"must be a power of two >= {MIN_TILE}")  # fmt: skip
    if decode:  # one program per (request, kv head): its G heads are the rows, padded to 16
        g_pad, block_q = max(MIN_TILE, triton.next_power_of_2(groups)), 1
    else:
        g_pad = triton.next_power_of_2(groups)
        block_q = min(cfg.block_m // g_pad, triton.next_power_of_2(max_query_len))
        block_q = max(block_q, triton.cdiv(MIN_TILE, g_pad), 1)
    max_keys = block_tables.shape[1] * block_size
    if kv_splits is None:
        kv_splits = num_kv_splits(batch * hkv, max_keys) if decode else 1
    _require(isinstance(kv_splits, int) and kv_splits >= 1, "kv_splits", kv_splits, "must be >= 1")
    d_pad = max(MIN_TILE, triton.next_power_of_2(d))
    fp32_dot, round_bf16 = _dot_flags(q.dtype)
    part_acc = part_ml = out
    if kv_splits > 1:
        part_acc, part_ml = _split_scratch(num_tokens * hq, kv_splits, d_pad, q.device)
    grid = (batch, triton.cdiv(max_query_len, block_q) * kv_splits, hkv)
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        q if sinks is None else sinks, part_acc, part_ml, scale * LOG2E, sliding_window or 0,
        max_keys, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), hq,
        GROUPS=groups, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, NUM_SPLITS=kv_splits, FP32_DOT=fp32_dot,
        ROUND_BF16=round_bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if kv_splits > 1:
        _merge(out, part_acc, part_ml, sinks, num_tokens * hq, hq, kv_splits, d, d_pad,
               round_bf16)  # fmt: skip
    return out


def mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
    kv_splits: int | None = None,
    q_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA absorbed decode (DeepSeek-V2/V3) over the paged latent cache, FlashMLA's layout.

    Every head of request b attends all seq_lens[b] latents of the request (a decode query sees
    every key): scores = (q[b, h] . latent) * scale; output = softmax(scores) @ c_kv, with c_kv
    the latent's first ``kv_lora_rank`` columns (the rest is k_pe, the shared rope key).

    Args:
        q: [B, n_heads, kv_lora_rank + rope_dim] float32/bfloat16/float16, the absorbed query
            (q_nope @ W_UK concatenated with q_pe); or, with ``q_rope``, its first
            ``kv_lora_rank`` columns [B, n_heads, kv_lora_rank] (any batch/head strides: e.g.
            the transposed output of the absorbing bmm), so that no concatenation is needed.
        latent_cache: [num_blocks, block_size, kv_lora_rank + rope_dim] in q's dtype.
        block_tables: [B, max_blocks] int32/int64 (padded with the null block 0).
        seq_lens: [B] int32/int64 keys per request (tokens); 0 gives zeros.
        scale: multiplies q . latent.
        kv_lora_rank: the value width r (512 in DeepSeek-V3).
        out: optional [B, n_heads, kv_lora_rank] in q's dtype, written in place.
        kv_splits: flash-decoding splits along the keys (None: ``num_kv_splits``).
        q_rope: optional [B, n_heads, rope_dim] in q's dtype, the query's rope part (any
            batch/head strides).

    Returns:
        [B, n_heads, kv_lora_rank] in q's dtype (o_lat; the caller applies W_UV).

    Raises:
        ValueError: a shape, dtype, device or layout the kernel does not take.
    """
    _require(q.dim() == 3 and q.dtype in _FLOAT_DTYPES, "q", (tuple(q.shape), q.dtype),
             "must be [B, n_heads, kv_lora_rank + rope_dim] float32/bfloat16/float16")  # fmt: skip
    batch, heads, width = q.shape
    if q_rope is not None:
        _require(q_rope.dim() == 3 and tuple(q_rope.shape[:2]) == (batch, heads) and
                 q_rope.dtype == q.dtype and q_rope.device == q.device and width == kv_lora_rank,
                 "q_rope", (tuple(q_rope.shape), q_rope.dtype), f"must be [{batch}, {heads}, "
                 f"rope_dim] {q.dtype} beside q [B, n_heads, kv_lora_rank]")  # fmt: skip
        width = kv_lora_rank + q_rope.shape[2]
    _require(0 < kv_lora_rank < width, "kv_lora_rank", kv_lora_rank, f"must be in (0, {width})")
    _require(latent_cache.dim() == 3 and latent_cache.shape[-1] == width and
             latent_cache.dtype == q.dtype and latent_cache.device == q.device, "latent_cache",
             (tuple(latent_cache.shape), latent_cache.dtype), f"must be [num_blocks, block_size,"
             f" {width}] {q.dtype} on {q.device}")  # fmt: skip
    q_pe = q[..., kv_lora_rank:] if q_rope is None else q_rope
    for name, x in (("q", q), ("q_rope", q_pe), ("latent_cache", latent_cache), ("out", out)):
        if x is not None:
            _require(x.stride(-1) == 1, f"{name}.stride", x.stride(), "last dim must be dense")
    _check_tables(block_tables, seq_lens, q.device, batch)
    shape = (batch, heads, kv_lora_rank)
    _require(out is None or (tuple(out.shape) == shape and out.dtype == q.dtype), "out",
             None if out is None else (tuple(out.shape), out.dtype),
             f"must be {shape} {q.dtype}")  # fmt: skip
    out = q.new_empty(shape) if out is None else out
    if batch == 0 or heads == 0:
        return out
    block_size, cfg = latent_cache.shape[1], _MLA_CONFIG
    max_keys = block_tables.shape[1] * block_size
    block_h = min(cfg.block_m, max(MIN_TILE, triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    kv_splits = kv_splits or num_kv_splits(batch * head_blocks, max_keys)
    _require(isinstance(kv_splits, int) and kv_splits >= 1, "kv_splits", kv_splits, "must be >= 1")
    rank_pad = max(MIN_TILE, triton.next_power_of_2(kv_lora_rank))
    rope = width - kv_lora_rank
    fp32_dot, round_bf16 = _dot_flags(q.dtype)
    part_acc = part_ml = out
    if kv_splits > 1:
        part_acc, part_ml = _split_scratch(batch * heads, kv_splits, rank_pad, q.device)
    mla_decode_kernel[(batch, head_blocks, kv_splits)](
        out, q, q_pe, latent_cache, block_tables, seq_lens, part_acc, part_ml, scale * LOG2E,
        max_keys, heads, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        RANK=kv_lora_rank, RANK_PAD=rank_pad, ROPE=rope,
        ROPE_PAD=max(MIN_TILE, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=kv_splits, FP32_DOT=fp32_dot, ROUND_BF16=round_bf16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if kv_splits > 1:
        _merge(out, part_acc, part_ml, None, batch * heads, heads, kv_splits, kv_lora_rank,
               rank_pad, round_bf16)  # fmt: skip
    return out
