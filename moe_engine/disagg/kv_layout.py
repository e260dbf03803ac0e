"""Where a request's KV blocks live in memory, so another instance can write them there.

The paged cache (`ModelRunner`) is one tensor pair (K, V) per layer slot, each
[num_blocks + 1, block_size, num_kv_heads, head_dim] (MLA: one latent tensor [num_blocks + 1,
block_size, latent_dim]); KV-cache group g's layers use slots 0..len(group.layers) - 1 (the
hybrid cache shares slots between groups, `kv_cache.spec.KVCacheGroup`), and block b of a slot
tensor is the contiguous bytes [b * block_bytes, (b + 1) * block_bytes) from its base address.

`KVCacheDescriptor` is what an instance publishes about its cache (the transfer session, each
group's tensors' base addresses and block sizes, and a signature of the layout); `block_copies`
turns two instances' block tables for one request into (source address, destination address,
length) triples, one per run of consecutive blocks on both sides, which is what a transfer
engine writes (Mooncake's `batch_transfer_*`). Blocks move whole, per group; null blocks
(sliding-window blocks outside the window) are skipped on either side, so a sliding group moves
only the blocks within its window and an MLA cache its latents as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from moe_engine.kv_cache.spec import NULL_BLOCK_ID, KVCacheGroup


class KVCacheDescriptor(msgspec.Struct, frozen=True):
    """An instance's paged KV cache as a peer writes into it.

    Attributes:
        session: the transfer engine's address of the instance ("host:port").
        signature: dtype, block size and each group's spec; two instances move blocks only
            when their signatures are equal (the same model, dtype and block size).
        groups: per KV-cache group, (base address, bytes per block) of each tensor its layers
            use, in slot order (K then V per slot; one latent tensor per MLA slot).
        num_blocks: block ids are 1..num_blocks (0 is the null block).
    """

    session: str
    signature: str
    groups: list[list[tuple[int, int]]]
    num_blocks: int


def slot_tensors(kv_caches: Sequence) -> list[torch.Tensor]:
    """The distinct cache tensors of a runner's `kv_caches` (per layer: a (K, V) pair, one MLA
    tensor, or a linear-attention state, which is refused), in slot order."""
    seen: dict[int, torch.Tensor] = {}
    for entry in kv_caches:
        for t in entry if isinstance(entry, tuple) else (entry,):
            seen.setdefault(t.data_ptr(), t)
    return list(seen.values())


def describe(session: str, kv_caches: Sequence, kv_groups: Sequence[KVCacheGroup],
             num_blocks: int) -> KVCacheDescriptor:
    """The descriptor of a runner's cache (`ModelRunner.kv_caches`, `.kv_groups`).

    Raises:
        ValueError: a group's layers have no paged cache (linear-attention state slots, which
            are not moved yet).
    """
    groups = []
    for g, group in enumerate(kv_groups):
        tensors = []
        for index in group.layers:
            entry = kv_caches[index]
            parts = entry if isinstance(entry, tuple) else (entry,)
            for t in parts:
                if t.dim() < 3 or not t.is_contiguous():
                    raise ValueError(f"KV-cache group {g}: layer {index} has no paged cache")
                tensors.append((t.data_ptr(), t.stride(0) * t.element_size()))
        groups.append(tensors)
    specs = "; ".join(repr(group.spec) for group in kv_groups)
    dtype = _dtype_of(kv_caches[kv_groups[0].layers[0]])
    return KVCacheDescriptor(session, f"{dtype} | {specs}", groups, num_blocks)


def _dtype_of(entry) -> str:
    t = entry[0] if isinstance(entry, tuple) else entry
    return str(t.dtype).removeprefix("torch.")


def check_compatible(src: KVCacheDescriptor, dst: KVCacheDescriptor) -> None:
    """Raises ValueError (naming both layouts) unless blocks can move from src to dst."""
    if src.signature != dst.signature or len(src.groups) != len(dst.groups):
        raise ValueError(
            f"KV cache layouts differ: this instance has {src.signature!r}, the peer "
            f"{dst.signature!r} (prefill and decode instances need the same model, dtype "
            "and block size)"
        )


def block_copies(
    src: KVCacheDescriptor,
    dst: KVCacheDescriptor,
    src_tables: Sequence[Sequence[int]],
    dst_tables: Sequence[Sequence[int]],
    first_block: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths in bytes) that copy a request's
    blocks from one cache into another.

    Args:
        src, dst: the two instances' descriptors (checked compatible).
        src_tables, dst_tables: per group, the request's block ids on each side (the same
            count of blocks covering the same tokens).
        first_block: per group, the first block index to move (the destination's prefix-cache
            hit already holds the earlier ones); default 0.

    Raises:
        ValueError: incompatible layouts, tables of different lengths, or a block id out of
            range on either side.
    """
    check_compatible(src, dst)
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for g, (s_table, d_table) in enumerate(zip(src_tables, dst_tables, strict=True)):
        if len(s_table) != len(d_table):
            raise ValueError(f"group {g}: {len(s_table)} source blocks, {len(d_table)} "
                             "destination blocks")
        start = first_block[g] if first_block is not None else 0
        pairs = [(s, d) for s, d in zip(s_table[start:], d_table[start:], strict=True)
                 if s != NULL_BLOCK_ID and d != NULL_BLOCK_ID]
        for s, d in pairs:
            if not (0 < s <= src.num_blocks + 1 and 0 < d <= dst.num_blocks + 1):
                raise ValueError(f"group {g}: block {s} -> {d} is outside the caches")
        for (s_base, bb), (d_base, _) in zip(src.groups[g], dst.groups[g], strict=True):
            for s0, d0, n in _runs(pairs):
                srcs.append(s_base + s0 * bb)
                dsts.append(d_base + d0 * bb)
                lens.append(n * bb)
    return srcs, dsts, lens


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of each run of pairs that are
    consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
