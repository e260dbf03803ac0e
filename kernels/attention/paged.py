"""`PagedAttentionKernels`: the decode and prefill kernels one attention layer runs, chosen
once by the registry (`KernelPlan.attention`), with one calling convention.

Each kernel is called `kernel(q, k_cache, v_cache, batch, scale, sliding_window, sinks)` with
`batch` a `PagedBatch` (the block tables, keys per request and query starts the paged kernels
read) and returns the attention output [n, Hq, D] in q's dtype; a `None` kernel means the
layer's own torch path (SDPA over gathered blocks). The one per-call fallback is declared here
and in the registry: the native prefill kernel runs bfloat16 queries and caches only and
returns None for any other (a float32 cache), which the torch path then takes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from kernels.attention.native_decode import paged_decode_attention
from kernels.attention.native_prefill import paged_prefill_attention

#: The native prefill kernel's limit on query heads per KV head (csrc/prefill_attention.cpp).
NATIVE_PREFILL_MAX_GQA = 16
#: The per-call fallback of the native prefill kernel (printed in the startup plan).
NATIVE_PREFILL_FALLBACKS = ("float32 queries or caches: torch",)


class PagedBatch(Protocol):
    """What the paged kernels read of an attention batch (`models.layers.attention`).

    Attributes:
        block_tables: [B, max_blocks] int64, null-block padded.
        seq_lens: [B] int64 keys per request after this step (tokens).
        query_start_loc: [B + 1] int64 where each request's queries start (prefill).
        max_q: the longest query of the batch (tokens).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    max_q: int


#: (q [n, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D], batch, scale,
#: sliding_window, sinks [Hq] or None) -> [n, Hq, D], or None: the torch path takes it.
PagedAttentionFn = Callable[..., "torch.Tensor | None"]


def native_decode(q, k_cache, v_cache, batch: PagedBatch, scale: float,
                  sliding_window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per request on the native decode kernel (`native_decode`)."""
    return paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                  scale, sliding_window=sliding_window, sinks=sinks)


def native_prefill(q, k_cache, v_cache, batch: PagedBatch, scale: float,
                   sliding_window: int | None, sinks: torch.Tensor | None
                   ) -> torch.Tensor | None:
    """Prefill chunks on the native bfloat16 prefill kernel; None for other dtypes."""
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
        return None
    return paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, scale, sliding_window=sliding_window,
                                   sinks=sinks)


def triton_paged(q, k_cache, v_cache, batch: PagedBatch, scale: float,
                 sliding_window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Any batch on the Triton paged-attention kernel (`triton_attention.paged_attention`)."""
    return _triton().paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                           batch.query_start_loc, scale=scale, max_query_len=batch.max_q,
                           sliding_window=sliding_window, sinks=sinks)


@functools.cache
def _triton() -> ModuleType:
    """`kernels.attention.triton_attention`, imported on first use (Triton is heavy)."""
    from kernels.attention import triton_attention

    return triton_attention


@dataclass(frozen=True)
class PagedAttentionKernels:
    """The kernels of one attention layer.

    Attributes:
        decode: runs batches of one query per request; None: the torch path.
        prefill: runs batches of prefill chunks; None: the torch path.
        decode_backend, prefill_backend: the registry's names of the two (for the log and
            GetModelInfo; what runs is the kernel, never the name).
    """

    decode: PagedAttentionFn | None = None
    prefill: PagedAttentionFn | None = None
    decode_backend: str = "torch"
    prefill_backend: str = "torch"

    @property
    def native_decode(self) -> bool:
        """Whether decodes run the native decode kernel (what the one-call native decode
        layer, `kernels.decode_layer`, runs too)."""
        return self.decode is native_decode
