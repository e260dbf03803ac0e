"""Native decode attention over the paged KV cache (csrc/paged_attention.cpp) for the CPU.

One query token per sequence (the decode batch of a step); keys and values are read in place
through the block tables, so the per-layer gather copy of the torch path disappears. The torch
path (`moe_engine.models.layers.attention`, gathered blocks + `scaled_dot_product_attention`)
is the reference and the fallback.
"""

from __future__ import annotations

import torch

from kernels.native import load_native


def native_attention_available() -> bool:
    """Whether the native decode attention is usable in this process (built on first call)."""
    return load_native("paged_attention") is not None


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
) -> torch.Tensor:
    """softmax(q K^T * scale) V for one query per sequence, keys read through block tables.

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

    Returns:
        [B, Hq, D] in q's dtype.

    Raises:
        RuntimeError: the native kernel is unavailable, or shapes/dtypes that do not match
            (the message names the argument).
    """
    ext = load_native("paged_attention")
    if ext is None:
        raise RuntimeError("native decode attention is unavailable (see kernels/native.py)")
    empty = torch.empty(0, dtype=torch.float32)
    return ext.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
        empty if sinks is None else sinks, int(sliding_window or 0), float(scale),
    )
