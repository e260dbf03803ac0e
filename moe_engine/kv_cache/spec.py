"""What each KV-cache group needs per block (vLLM v1's `KVCacheSpec` family).

A group is a set of layers with the same attention kind; each request holds one block table per
group. This issue ships full attention only; sliding window and linear attention follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer cache shape of one group.

    Attributes:
        block_size: tokens per block.
        num_kv_heads: key/value heads per layer.
        head_dim: elements per head.
        dtype: cache element type.
        num_layers: layers in the group.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_layers: int

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request with `num_tokens` tokens of context holds in this group."""
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token of the context stays in the cache."""
