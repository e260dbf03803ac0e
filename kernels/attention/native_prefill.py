"""Native prefill attention for bfloat16 over the paged KV cache (csrc/prefill_attention.cpp),
on CPUs with AVX512-BF16.

One call attends every prefill chunk of a step (each request's queries over its own cached
keys, causal, with an optional sliding window and sink logits), where the torch path
(`kernels.attention.torch_rows`) makes one `scaled_dot_product_attention` call per
request: torch's CPU flash kernel ran the bench's 37-256-token prompts at 50-70 GFLOP/s
(bench/NOTES.md section 17). The arithmetic is that kernel's for bfloat16: bfloat16 q . k
products summed in float32, an online softmax in float32, the probabilities rounded once to
bfloat16 for the product with the values, float32 sums, the output rounded to bfloat16.
"""

from __future__ import annotations

import torch

from kernels.dense import amx as cpu_amx
from kernels.native.library import BAD_ARGUMENT, check_status, load_native


def prefill_attention_fits(head_dim: int, num_heads: int, num_kv_heads: int,
                           dtype: torch.dtype) -> str | None:
    """None when `paged_prefill_attention` runs these shapes here, else why not."""
    if dtype != torch.bfloat16:
        return f"the native prefill attention runs bfloat16, not {dtype}"
    if head_dim % 32 or head_dim > 256:
        return f"the native prefill attention needs head_dim % 32 == 0, <= 256, got {head_dim}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return (f"the native prefill attention needs at most 16 query heads per KV head, got "
                f"{num_heads} / {num_kv_heads}")
    if cpu_amx.bf16_backend() is None or not cpu_amx.dot_available():
        return "the native prefill attention needs AVX512-BF16"
    return None


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V, causal per request, keys read through block tables.

    Args:
        q: [T, Hq, D] bfloat16, the batch's query tokens request after request; request b's
            are rows query_start_loc[b] .. query_start_loc[b + 1], at positions seq_lens[b] -
            Lq .. seq_lens[b] - 1 (its last Lq keys).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] bfloat16, this step's keys written.
        block_tables: [B, W] int64; seq_lens: [B] int64 keys per request after this step,
            each in [1, W * block_size]; query_start_loc: [B + 1] int64.
        scale: multiplies q . k.
        sliding_window: a query at position p sees keys p - window + 1 .. p; None: all.
        sinks: optional [Hq] per-head sink logits (one more softmax term without a value).

    Returns:
        [T, Hq, D] bfloat16.

    Raises:
        RuntimeError: shapes or dtypes that do not fit (`prefill_attention_fits`, named), or
            lengths outside the block table.
    """
    b = seq_lens.numel()
    _, block_size, hkv, d = k_cache.shape
    why = prefill_attention_fits(d, q.shape[1], hkv, q.dtype)
    if why is not None:
        raise RuntimeError(why)
    if (q.dim() != 3 or q.shape[2] != d or k_cache.dtype != torch.bfloat16
            or v_cache.shape != k_cache.shape or v_cache.dtype != torch.bfloat16
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        raise RuntimeError(f"q [T, Hq, {d}] and contiguous bfloat16 caches of one shape, got q "
                           f"{tuple(q.shape)}, caches {k_cache.dtype} {tuple(k_cache.shape)}")
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    starts = query_start_loc.contiguous()
    if (tables.dim() != 2 or tables.shape[0] != b or tables.dtype != torch.int64
            or lens.dtype != torch.int64 or starts.shape != (b + 1,)
            or starts.dtype != torch.int64 or int(starts[-1]) != q.shape[0]):
        raise RuntimeError(f"block_tables [B, W], seq_lens [B] and query_start_loc [B + 1] "
                           f"int64 ending at T = {q.shape[0]}, got {tuple(tables.shape)}, "
                           f"{tuple(lens.shape)}, {tuple(starts.shape)}")
    sink_ptr = None
    if sinks is not None:
        sinks = sinks.float().contiguous()
        if sinks.numel() != q.shape[1]:
            raise RuntimeError(f"sinks must be [Hq] = [{q.shape[1]}], got {tuple(sinks.shape)}")
        sink_ptr = sinks.data_ptr()
    qc = q.contiguous()
    out = torch.empty_like(qc)
    status = load_native("prefill_attention").moe_prefill_attention(
        qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), starts.data_ptr(), sink_ptr, b, q.shape[1], hkv, d,
        block_size, int(sliding_window or 0), float(scale), out.data_ptr(),
        torch.get_num_threads())
    if status == BAD_ARGUMENT:
        raise RuntimeError(f"seq_lens must be in [1, W * block_size] = [1, "
                           f"{tables.shape[1] * block_size}] and each request's queries at "
                           "most its keys")
    check_status(status, "paged_prefill_attention")
    return out
