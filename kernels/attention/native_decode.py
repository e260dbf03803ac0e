"""Native decode attention over the paged KV cache (csrc/paged_attention.cpp) for the CPU.

One query token per sequence (the decode batch of a step); keys and values are read in place
through the block tables, so the per-layer gather copy of the torch path disappears. The torch
path (`moe_engine.models.layers.attention`, gathered blocks + `scaled_dot_product_attention`)
is the reference and the fallback.
"""

from __future__ import annotations

import torch

from kernels.dense.amx import DOT, TILES, bf16_backend
from kernels.native.library import BAD_ARGUMENT, check_status, dtype_flag, load_native


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    amx: bool | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V for one query per sequence, keys read through block tables.

    With bfloat16 q and cache and D a multiple of 32 up to 256, the scores q . k are bfloat16
    products summed in float32, then times `scale`, where this process runs the bf16 kernels
    (`kernels.dense.amx.bf16_backend`): on AMX tiles for at most 16 query heads per KV head and
    blocks of a multiple of 16 slots (csrc/amx_attention.cpp), or with VDPBF16PS for 1, 2, 4,
    8 or 16 query heads per KV head (csrc/bf16_dot.cpp); otherwise, and for the
    probability-weighted values always, in float32 FMAs (AVX-512 in the AVX-512 build).

    Args:
        q: [B, Hq, D] float32 or bfloat16, D a multiple of 8.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], float32 or bfloat16 (one dtype),
            Hkv dividing Hq (query head i reads KV head i // (Hq / Hkv)).
        block_tables: [B, W] int64 block ids (padding beyond a sequence is never read).
        seq_lens: [B] int64 keys per sequence (tokens), the query being the last, at position
            seq_len - 1; each in [1, W * block_size].
        scale: multiplies q . k.
        sliding_window: keys at positions < seq_len - window are invisible (the query sees
            itself and window - 1 earlier tokens); None: full attention.
        sinks: optional [Hq] per-head sink logits (gpt-oss): one more softmax term without a
            value.
        amx: False keeps the scores on float32 FMAs; None (default) or True: on the bf16
            kernels where the shapes fit and this process runs them (True does not force them
            on a CPU without them).

    Returns:
        [B, Hq, D] in q's dtype.

    Raises:
        RuntimeError: the native kernel is unavailable, or shapes/dtypes that do not match
            (the message names the argument).
    """
    lib = load_native("paged_attention")
    if lib is None:
        raise RuntimeError("native decode attention is unavailable (see kernels/native/library.py)")
    q = q.contiguous()
    q_shape, cache_shape = q.shape, k_cache.shape
    if len(q_shape) != 3:
        raise RuntimeError(f"q must be [B, Hq, D], got {tuple(q_shape)}")
    if (len(cache_shape) != 4 or cache_shape != v_cache.shape or k_cache.dtype != v_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        raise RuntimeError("k_cache/v_cache must be contiguous [num_blocks, block_size, Hkv, D], "
                           f"one dtype; got {k_cache.dtype} {tuple(cache_shape)} and "
                           f"{v_cache.dtype} {tuple(v_cache.shape)}")
    b, hq, d = q_shape
    _, block_size, hkv, cache_d = cache_shape
    if cache_d != d or d % 8:
        raise RuntimeError(f"head_dim must match (q {d}, cache {cache_d}) and be a multiple of 8")
    if hq % hkv:
        raise RuntimeError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    table_shape = block_tables.shape
    if len(table_shape) != 2 or table_shape[0] != b or block_tables.dtype != torch.int64:
        raise RuntimeError(f"block_tables must be int64 [B, W] with B = {b}, got "
                           f"{block_tables.dtype} {tuple(table_shape)}")
    if seq_lens.numel() != b or seq_lens.dtype != torch.int64:
        raise RuntimeError(f"seq_lens must be int64 [B] = [{b}], got {seq_lens.dtype} "
                           f"{tuple(seq_lens.shape)}")
    sink_ptr = None
    if sinks is not None and sinks.numel():
        if sinks.numel() != hq:
            raise RuntimeError(f"sinks must be [Hq] = [{hq}], got {tuple(sinks.shape)}")
        sinks = sinks.float().contiguous()
        sink_ptr = sinks.data_ptr()
    q_bf16, cache_bf16 = dtype_flag(q, "q"), dtype_flag(k_cache, "the KV cache")
    out = torch.empty_like(q)
    status = lib.moe_paged_decode_attention(
        q.data_ptr(), q_bf16, k_cache.data_ptr(), v_cache.data_ptr(), cache_bf16,
        block_tables.data_ptr(), table_shape[1], seq_lens.data_ptr(), sink_ptr, b, hq,
        hkv, d, block_size, int(sliding_window or 0), float(scale),
        _scores_kind(amx), out.data_ptr(),
        torch.get_num_threads())
    if status == BAD_ARGUMENT:
        raise RuntimeError(f"seq_lens out of the block table: each must be in [1, W * "
                           f"block_size] = [1, {table_shape[1] * block_size}]")
    check_status(status, "paged_decode_attention")
    return out


def _scores_kind(amx: bool | None) -> int:
    """The kernel's `amx` argument: 1 the scores on AMX tiles, 2 on AVX512-BF16 (this
    process's bf16 backend, `kernels.dense.amx.bf16_backend`), 0 float32 FMAs (`amx` False)."""
    if amx is False:
        return 0
    return {TILES: 1, DOT: 2}.get(bf16_backend(), 0)
