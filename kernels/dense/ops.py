"""Fused small CPU ops of the decoder layer (csrc/ops_cpu.cpp, csrc/rope_cpu.cpp): one native
call each (RMSNorm; the softmax-then-top-k routing; the attention prologue).

torch's per-op dispatch costs about 8-10 us on the project's machine, so an RMSNorm written as
six torch ops costs more than the arithmetic it does at decode batch sizes.
"""

from __future__ import annotations

import torch

from kernels.native.library import check_status, dtype_flag, load_native


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension (Zhang & Sennrich 2019), statistics in float32, rounded
    as transformers' Qwen3/Mixtral `RMSNorm` (normalised value cast to x's dtype, then times the
    weight) or, with `weight_in_float32`, as gpt-oss's (product in float32, cast once).

    Args:
        x: [D], [A, D] or [A, B, D] float32 or bfloat16, last dimension contiguous (other
            strides free, e.g. the query heads sliced out of a fused QKV output).
        weight: [D], x's dtype.
        eps: added to the mean square.

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Raises:
        RuntimeError: the native ops are unavailable, or shapes/dtypes that do not fit.
    """
    lib = load_native("ops_cpu")
    if lib is None:
        raise RuntimeError("the native CPU ops are unavailable (see kernels/native/library.py)")
    shape, strides = x.shape, x.stride()
    nd = len(shape)
    if not 1 <= nd <= 3 or strides[-1] != 1:
        raise RuntimeError(f"x must be [D], [A, D] or [A, B, D] with a contiguous last "
                           f"dimension, got shape {tuple(shape)} strides {strides}")
    if x.dtype != weight.dtype:
        raise RuntimeError(f"weight ({weight.dtype}) must have x's dtype ({x.dtype})")
    d = shape[-1]
    if weight.numel() != d or not weight.is_contiguous():
        raise RuntimeError(f"weight must be contiguous [D] = [{d}], got {tuple(weight.shape)}")
    bf16 = dtype_flag(x, "x")
    # rows (a, b) at a * sa + b * sb elements: [D] is one row, [A, D] is A x 1
    a, sa = (shape[0], strides[0]) if nd >= 2 else (1, d)
    b, sb = (shape[1], strides[1]) if nd == 3 else (1, d)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_status(lib.moe_rms_norm(x.data_ptr(), a, b, d, sa, sb, weight.data_ptr(), eps,
                                  weight_in_float32, bf16, y.data_ptr(),
                                  torch.get_num_threads()), "rms_norm")
    return y


def router_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing in one native call (csrc/ops_cpu.cpp
    `moe_router_softmax_topk`): softmax over the experts in float32, the k largest
    probabilities in descending order (the lower expert id first on ties, NaN above every
    number: the first k of a stable descending sort), then, with `renormalize`, divided by
    their sum. The routing of Qwen3-MoE and Mixtral in transformers (`routing.softmax_topk`
    is the torch version); within a relative 2e-6 of a float64 softmax, not bit-identical
    to torch's.

    Args:
        logits: [T, E] float32 or bfloat16 router logits, 1 <= k <= E <= 4096.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32.

    Raises:
        RuntimeError: the native ops are unavailable, or shapes/dtypes that do not fit.
    """
    lib = load_native("ops_cpu")
    if logits.dim() != 2:
        raise RuntimeError(f"logits must be [T, E], got {tuple(logits.shape)}")
    bf16 = dtype_flag(logits, "logits")
    t, e = logits.shape
    if not 1 <= k <= e <= 4096:
        raise RuntimeError(f"k = {k} must be in [1, E = {e}] and E <= 4096")
    logits = logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int32)
    check_status(lib.moe_router_softmax_topk(logits.data_ptr(), bf16, t, e, k, renormalize,
                                             weights.data_ptr(), ids.data_ptr(),
                                             torch.get_num_threads()), "router_softmax_topk")
    return weights, ids


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """A layer's attention prologue in one call (csrc/rope_cpu.cpp): split the fused QKV
    output, RMSNorm q and k per head (when `q_norm` is given), apply rotate-half RoPE (Su et
    al. 2021; transformers' `apply_rotary_pos_emb`), write k and v into the cache slots, return
    q. Bit-identical to the torch path (`RMSNorm`, `RotaryEmbedding`, `index_copy_`).

    Args:
        qkv: [T, (Hq + 2 Hkv) * D] float32 or bfloat16, contiguous.
        num_heads: Hq; num_kv_heads: Hkv (D follows from qkv's width).
        positions: [T] int64 positions, each in [0, P).
        cos_cache, sin_cache: [P, D] float32 tables (`RotaryEmbedding.cos_cache`).
        q_norm, k_norm: [D] weights of qkv's dtype, or both None (no q/k norm).
        eps: the norms' epsilon.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] of qkv's dtype, contiguous.
        slot_mapping: [T] int64 flat slot (block * block_size + offset) per token.

    Returns:
        q: [T, Hq, D], qkv's dtype.

    Raises:
        RuntimeError: shapes, dtypes or layouts that do not fit, or a position or slot out of
            range (nothing is written then).
    """
    lib = load_native("rope_cpu")
    t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    if width != (num_heads + 2 * num_kv_heads) * d or d % 2 or not qkv.is_contiguous():
        raise RuntimeError(f"qkv must be contiguous [T, (Hq + 2 Hkv) * D] with D even, got "
                           f"{tuple(qkv.shape)} for Hq={num_heads}, Hkv={num_kv_heads}")
    bf16 = dtype_flag(qkv, "qkv")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != qkv.dtype or not c.is_contiguous() or tuple(c.shape[2:]) != (
            num_kv_heads, d
        ):
            raise RuntimeError(f"{name} must be contiguous [blocks, block_size, {num_kv_heads}, "
                               f"{d}] {qkv.dtype}, got {c.dtype} {tuple(c.shape)}")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != d:
            raise RuntimeError(f"{name} must be float32 [P, {d}], got {table.dtype} "
                               f"{tuple(table.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise RuntimeError("q_norm and k_norm are given together or not at all")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.dtype != qkv.dtype or w.numel() != d or not w.is_contiguous()):
            raise RuntimeError(f"{name} must be contiguous [{d}] {qkv.dtype}")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.dtype != torch.int64 or idx.shape != (t,) or not idx.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous int64 [{t}], got {idx.dtype} "
                               f"{tuple(idx.shape)}")
    q = qkv.new_empty(t, num_heads, d)
    slots = k_cache.numel() // (num_kv_heads * d)
    check_status(lib.moe_qk_norm_rope_cache(
        qkv.data_ptr(), bf16, t, num_heads, num_kv_heads, d, positions.data_ptr(),
        cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0],
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(), eps, k_cache.data_ptr(),
        v_cache.data_ptr(), slots, slot_mapping.data_ptr(), q.data_ptr(),
        torch.get_num_threads()),
        f"qk_norm_rope_cache: a position outside [0, {cos_cache.shape[0]}) or a slot outside "
        f"[0, {slots})")
    return q
