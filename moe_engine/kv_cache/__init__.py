"""Paged KV cache: the block pool, per-group specs and the manager that hands out block tables."""

from moe_engine.kv_cache.block_pool import BlockPool
from moe_engine.kv_cache.manager import KVCacheManager, PrefixHit, hash_block_tokens
from moe_engine.kv_cache.spec import (
    CHUNKED_LOCAL_ATTENTION,
    FULL_ATTENTION,
    MLA_ATTENTION,
    NULL_BLOCK_ID,
    SLIDING_ATTENTION,
    AttentionGroup,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    make_kv_cache_groups,
)

__all__ = [
    "CHUNKED_LOCAL_ATTENTION",
    "FULL_ATTENTION",
    "MLA_ATTENTION",
    "NULL_BLOCK_ID",
    "SLIDING_ATTENTION",
    "AttentionGroup",
    "BlockPool",
    "ChunkedLocalAttentionSpec",
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
