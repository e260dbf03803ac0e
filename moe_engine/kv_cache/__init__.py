"""Paged KV cache: the block pool, per-group specs and the manager that hands out block tables."""

from moe_engine.kv_cache.block_pool import BlockPool
from moe_engine.kv_cache.manager import KVCacheManager, PrefixHit, hash_block_tokens
from moe_engine.kv_cache.spec import (
    FULL_ATTENTION,
    MLA_ATTENTION,
    NULL_BLOCK_ID,
    SLIDING_ATTENTION,
    AttentionGroup,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    make_kv_cache_groups,
)

__all__ = [
    "FULL_ATTENTION",
    "MLA_ATTENTION",
    "NULL_BLOCK_ID",
    "SLIDING_ATTENTION",
    "AttentionGroup",
    "BlockPool",
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "PrefixHit",
    "SlidingWindowSpec",
    "hash_block_tokens",
    "make_kv_cache_groups",
]
