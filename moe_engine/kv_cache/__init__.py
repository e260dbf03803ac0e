"""Paged KV cache: the block pool, per-group specs and the manager that hands out block tables."""

from moe_engine.kv_cache.block_pool import BlockPool
from moe_engine.kv_cache.manager import KVCacheManager
from moe_engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec

__all__ = ["BlockPool", "FullAttentionSpec", "KVCacheManager", "KVCacheSpec"]
