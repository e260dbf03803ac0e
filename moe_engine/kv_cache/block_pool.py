"""A pool of fixed-size KV blocks with a free queue and reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids in [0, num_blocks).

    Free blocks sit in a FIFO queue; `ref_counts` lets several requests share a block (prefix
    caching, later). Allocation is all-or-nothing.

    Raises:
        ValueError: num_blocks < 1; freeing a block that is not allocated.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero go back to the queue.

        Blocks are freed in reverse so the tail of a sequence is reused first (its head is the
        more likely to be shared later).
        """
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
