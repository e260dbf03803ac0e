"""KVCacheManager: one block table per KV-cache group per request, over one BlockPool."""

from __future__ import annotations

from moe_engine.kv_cache.block_pool import BlockPool
from moe_engine.kv_cache.spec import KVCacheSpec


class KVCacheManager:
    """Allocates and frees the blocks requests need.

    Block ids are shared across groups: block `b` means slot range [b*block_size, (b+1)*block_size)
    in every layer's cache tensor of every group, so one pool serves all groups.

    Args:
        specs: one spec per KV-cache group (same block_size).
        num_blocks: blocks in the pool.
    """

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int) -> None:
        if not specs:
            raise ValueError("at least one KV cache group is needed")
        self.specs = specs
        self.block_size = specs[0].block_size
        self.pool = BlockPool(num_blocks)
        # request_id -> per-group list of block ids
        self.block_tables: dict[str, list[list[int]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's tables to hold `num_total_tokens` tokens of context.

        Returns:
            False (nothing allocated) when the pool has too few free blocks.
        """
        tables = self.block_tables.setdefault(request_id, [[] for _ in self.specs])
        needed = [
            spec.blocks_needed(num_total_tokens) - len(t)
            for spec, t in zip(self.specs, tables, strict=True)
        ]
        total = sum(n for n in needed if n > 0)
        if total == 0:
            return True
        blocks = self.pool.allocate(total)
        if blocks is None:
            return False
        it = iter(blocks)
        for n, table in zip(needed, tables, strict=True):
            table.extend(next(it) for _ in range(max(n, 0)))
        return True

    def free(self, request_id: str) -> None:
        """Return every block the request holds (no-op for an unknown id)."""
        tables = self.block_tables.pop(request_id, None)
        if tables is None:
            return
        for table in tables:
            self.pool.free(table)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block ids in one group, in token order."""
        return self.block_tables[request_id][group]
