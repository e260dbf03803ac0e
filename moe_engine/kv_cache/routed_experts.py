"""Routing replay, the host half: every computed token's routing kept at its KV slot.

`RoutedExpertsStore` is a host array `[num_slots, num_moe_layers, top_k]` indexed like the KV
cache: slot `block * block_size + offset` of one KV-cache group (the idea of SGLang's
`RoutedExpertsCapturer`, whose host buffer is indexed by the KV pool's token index). Each step
writes its tokens' rows (read back from the device once, `moe_engine.routing_capture`) at the
step's slot mapping of that group; a request's routing is gathered through its block table
when it ends, before its blocks are freed. What follows from keeping it per slot:

- The group: the first one whose blocks a request keeps for its whole life (full attention or
  MLA, `KVCacheSpec.frees_blocks` False); sliding-window and chunked-local groups give early
  blocks back, so they cannot hold a whole request. A model with no such group is refused at
  startup (`choose_group`).
- Prefix caching: a hit reuses the cached blocks, and their slots still hold the routing the
  request that computed them recorded, so the cached prefix's routing is *kept* (not
  recomputed); it is the routing of the same tokens over the same prefix.
- Preemption (recompute): the request's tokens are computed again and rewrite their slots.
- Speculative decoding: a rejected draft's slot is overwritten when the real token at that
  position is computed, and the gather stops before the last token, so only accepted tokens'
  routing is returned.
- Parallel sampling: each completion reads through its own block table (the shared prompt
  blocks, then its own).
- Expert parallelism: each rank runs its own requests, so each rank's own store holds them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_engine.kv_cache.spec import KVCacheSpec


def choose_group(specs: Sequence[KVCacheSpec]) -> int:
    """The KV-cache group whose slots hold the routing: the first that never frees a
    request's blocks (full attention or MLA).

    Raises:
        ValueError: every group frees blocks (sliding-window or chunked-local only).
    """
    for g, spec in enumerate(specs):
        if not spec.frees_blocks:
            return g
    kinds = sorted({s.kind for s in specs})
    raise ValueError(
        f"--enable-return-routed-experts: the routing is kept per KV slot of a cache group "
        f"that keeps every block of a request (full attention or MLA), and this model's "
        f"groups are all {kinds} (they free early blocks); serve it without the flag"
    )


class RoutedExpertsStore:
    """Every KV slot's last written routing.

    Args:
        num_slots: slots of the KV cache ((num_blocks + 1 [+ 1 scratch]) * block_size; block 0,
            the null block, and the scratch block are written by no request).
        num_layers, top_k: L and k of `RoutedExpertsCapture`.
        dtype: numpy dtype of the rows (the capture's: int16 or int32).
        block_size: tokens per KV block; group: the KV-cache group whose block tables index
            it (`choose_group`).
    """

    def __init__(self, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 block_size: int, group: int) -> None:
        self.rows = np.full((num_slots, num_layers, top_k), -1, dtype=dtype)
        self.block_size, self.group = block_size, group

    @property
    def nbytes(self) -> int:
        """Host bytes the store takes."""
        return int(self.rows.nbytes)

    def slot_mapping(self, starts: Sequence[int], num_tokens: Sequence[int],
                     tables: Sequence[Sequence[int]]) -> np.ndarray:
        """The step's slots in its flat token order, requests contiguous.

        Args:
            starts: per scheduled request, the position of its first token this step.
            num_tokens: per request, its tokens this step (drafts included).
            tables: per request, its block table in `group` (block ids in token order).

        Returns:
            [T] int64 slots: table[pos // block_size] * block_size + pos % block_size.
        """
        counts = np.asarray(num_tokens, dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        pos = np.repeat(np.asarray(starts, dtype=np.int64), counts) + np.arange(total) - first
        width = max(len(t) for t in tables)
        padded = np.zeros((len(tables), width), dtype=np.int64)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = table
        req = np.repeat(np.arange(len(tables)), counts)
        return padded[req, pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Keep one step's routing: rows [T, L, k] at slots [T] (later writes win)."""
        self.rows[slots] = rows

    def gather(self, table: Sequence[int], num_tokens: int) -> np.ndarray:
        """One request's routing for positions [0, num_tokens): [num_tokens, L, k] int32,
        read through its block table in `group`.

        Raises:
            ValueError: the table holds fewer than num_tokens positions.
        """
        if num_tokens > len(table) * self.block_size:
            raise ValueError(
                f"routed experts: {num_tokens} positions asked for, the block table holds "
                f"{len(table) * self.block_size}"
            )
        pos = np.arange(num_tokens, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)[pos // self.block_size]
        return self.rows[blocks * self.block_size + pos % self.block_size].astype(np.int32)
