"""A pool of fixed-size KV blocks: an LRU free queue, reference counts and the prefix-cache map.

Follows vLLM v1's `BlockPool` (vllm/v1/core/block_pool.py):
- Block 0 is the null block (`NULL_BLOCK_ID`): never handed out, never freed; usable blocks are
  1..num_blocks, so the physical cache has num_blocks + 1 blocks.
- Free blocks wait in one queue in eviction order. A block freed with a hash (a full block of a
  prefix) stays in the prefix-cache map while it waits, so a later request with the same prefix
  can take it back (`touch`) without recomputing it; it is evicted from the map only when
  `allocate` hands it out again. Blocks never cached (or evicted) leave the queue first because
  freed blocks join its tail: the queue's head holds the least recently freed blocks.
- Reference counts let several requests share a cached block; a block is free when its count
  is 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from moe_engine.kv_cache.spec import NULL_BLOCK_ID


class BlockPool:
    """Hands out block ids in [1, num_blocks]; id 0 is the null block.

    Args:
        num_blocks: usable blocks (the physical cache holds one more, the null block).

    Raises:
        ValueError: num_blocks < 1; freeing a block that is not allocated.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # LRU free queue: insertion order is eviction order (head first); O(1) removal by id.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self.ref_counts = [0] * (num_blocks + 1)
        self._block_key: list[Hashable | None] = [None] * (num_blocks + 1)
        self._cached: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` may hand out now: never used, freed, or cached with no user."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache map (in use or waiting in the free queue)."""
        return len(self._cached)

    def is_free(self, block: int) -> bool:
        """True when `block` waits in the free queue (reference count 0)."""
        return block != NULL_BLOCK_ID and self.ref_counts[block] == 0

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks from the head of the free queue, or None (nothing taken) when fewer
        are free. A taken block that was cached is evicted from the prefix-cache map."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._block_key[b]
            if key is not None:
                del self._cached[key]
                self._block_key[b] = None
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (cached) block, taking it out of the free queue when it was
        free. The null block is skipped."""
        for b in blocks:
            if b == NULL_BLOCK_ID:
                continue
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero join the free queue's tail.

        Blocks are freed in reverse, so the tail of a sequence is evicted first (its head is
        the more likely to be shared later). The null block is skipped.
        """
        for b in reversed(blocks):
            if b == NULL_BLOCK_ID:
                continue
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def cache_block(self, block: int, key: Hashable) -> bool:
        """Enter an allocated, full block under `key` (its chained hash and group) in the
        prefix-cache map; returns whether it entered. A key already cached by another block
        keeps that block; a block that already has a key keeps it."""
        if block == NULL_BLOCK_ID or self._block_key[block] is not None or key in self._cached:
            return False
        self._cached[key] = block
        self._block_key[block] = key
        return True

    def uncache(self, key: Hashable) -> None:
        """Remove `key` from the prefix-cache map (no-op when absent); its block stays where
        it is (in use, or in the free queue) but can no longer be found."""
        block = self._cached.pop(key, None)
        if block is not None:
            self._block_key[block] = None

    def clear_cache(self) -> int:
        """Empty the prefix-cache map (every block stays where it is, in use or free, but can
        no longer be found); returns how many blocks it held."""
        n = len(self._cached)
        for block in self._cached.values():
            self._block_key[block] = None
        self._cached.clear()
        return n

    def get_cached_block(self, key: Hashable) -> int | None:
        """The block cached under `key`, or None."""
        return self._cached.get(key)
