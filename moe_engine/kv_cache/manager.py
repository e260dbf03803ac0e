"""KVCacheManager: one block table per KV-cache group per request, over one BlockPool, with
prefix caching (vLLM v1's `KVCacheManager` + `HybridKVCacheCoordinator`, vllm/v1/core/).

Block tables: `block_tables[request_id][group]` lists block ids in token order; entry i holds
tokens [i * block_size, (i + 1) * block_size). A sliding-window group replaces the blocks wholly
outside the window by `NULL_BLOCK_ID` and gives them back, so positions stay aligned.

Prefix caching (`enable_prefix_caching`): block i of a request is named by the chained hash
h_i = sha256(h_{i-1} || token ids of block i || extra keys), h_-1 a fixed root, so equal hashes
mean equal whole prefixes. When a block is full (all its tokens are scheduled) it enters the
pool's map under (h_i, group); when its requests end it waits in the LRU free queue, still in
the map, until `allocate` hands it out again. A new request reuses the longest prefix that every
group can serve: a full-attention group needs every block of the prefix, a sliding-window group
only the ceil((window - 1) / block_size) blocks before its end, a chunked-local group only the
blocks of the chunk its end falls in (earlier ones are null). The hit
never covers the last token, which is always recomputed so that a token can be sampled.

Parallel sampling (`moe_engine.core.parallel_sampling`): the completions of one request share its
prompt's full blocks through the same map. With prefix caching off they are still hashed and
looked up, but only requests with a `cache_salt` are, the salt starts their hash chain (so only
siblings, which share it, find the blocks), only prompt blocks enter the map, and
`forget_prefix` takes them out of it when the last sibling ends.

Weight updates (`weight_update.control`): `weights_epoch` counts them. Each cached block is
tagged with the oldest epoch whose weights computed K/V it depends on (its request's
`kv_weights_epoch`: a request that straddles an update tags its later blocks with the epoch it
began on). `new_weights(flush=True)` (the default of `UpdateWeights`) empties the map and
refuses any later hit on a block tagged before the update, so blocks computed under one
weights version never serve a request under another; `flush=False` (`--keep-prefix-cache`)
leaves them findable, and a request that takes one starts with `kv_weights_epoch` older than
the weights serving, which the engine reports as `kv_from_other_weights`.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from moe_engine.kv_cache.block_pool import BlockPool
from moe_engine.kv_cache.spec import MLA_ATTENTION, NULL_BLOCK_ID, KVCacheSpec
from moe_engine.kv_cache.state import StateSlotPool
from moe_engine.request import Request

#: Parent hash of a request's first block.
ROOT_BLOCK_HASH = hashlib.sha256(b"moe-engine prefix cache v1").digest()


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """The chained hash of one full block (vLLM v1 `hash_block_tokens`, sha256).

    Args:
        parent_hash: the previous block's hash (`ROOT_BLOCK_HASH` for the first block).
        token_ids: the block's block_size token ids.
        extra_keys: anything else the block's K/V depend on (LoRA id, cache salt, ...), hashed
            by repr after the fixed-length token bytes.

    Returns:
        32 bytes.
    """
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass
class PrefixHit:
    """A request's cached prefix, found by `KVCacheManager.get_computed_blocks`.

    Attributes:
        blocks: per group, the block ids of the prefix (`NULL_BLOCK_ID` where a sliding group
            does not need the block); every group's list has num_tokens / block_size entries.
        num_tokens: tokens of the prefix (a multiple of block_size, < the request's tokens).
        num_queried: tokens the lookup covered (the request's tokens).
        weights_epoch: the oldest weights epoch that computed a block of the prefix (None
            without a hit).
    """

    blocks: list[list[int]]
    num_tokens: int
    num_queried: int
    weights_epoch: int | None = None


class KVCacheManager:
    """Allocates and frees the blocks requests need, shares cached prefixes.

    Block ids are shared across groups: block `b` means slot range [b*block_size,
    (b+1)*block_size) of the physical tensors every group's layers use (see `spec.py`), so one
    pool serves all groups; a block belongs to one group at a time.

    Args:
        specs: one spec per KV-cache group (same block_size).
        num_blocks: usable blocks in the pool (block 0, the null block, comes on top).
        enable_prefix_caching: reuse cached full blocks of earlier requests.
        state_slots: with linear-attention layers, the pool of their per-request state slots
            (`kv_cache.state`): a request takes one with its first blocks and returns it with
            them, and no request ever reuses another's blocks (their state is not in them).

    Raises:
        ValueError: no groups, or groups with different block sizes.
    """

    def __init__(
        self,
        specs: list[KVCacheSpec],
        num_blocks: int,
        enable_prefix_caching: bool = False,
        state_slots: StateSlotPool | None = None,
    ) -> None:
        if not specs:
            raise ValueError("at least one KV cache group is needed")
        if len({s.block_size for s in specs}) != 1:
            sizes = [s.block_size for s in specs]
            raise ValueError(f"KV cache groups differ in block size: {sizes}")
        self.specs = specs
        self.block_size = specs[0].block_size
        self.pool = BlockPool(num_blocks)
        if enable_prefix_caching and state_slots is not None:
            raise ValueError(
                "enable_prefix_caching: a model with linear-attention layers cannot reuse "
                "cached blocks (the layers' state is not in them)"
            )
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self._freeing = [g for g, s in enumerate(specs) if s.frees_blocks]
        # request_id -> per-group list of block ids
        self.block_tables: dict[str, list[list[int]]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached: dict[str, int] = {}
        #: Tokens looked up in the prefix cache by admitted requests, and tokens found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        #: The parent hash of every new hash chain: `ROOT_BLOCK_HASH`, re-derived by each
        #: `reset_prefix_cache` so that no chain begun before it matches one begun after.
        self._root = ROOT_BLOCK_HASH
        self._num_resets = 0
        #: Weight updates so far; the oldest epoch a hit may be tagged with (the last flush);
        #: each block's tag, set when it enters the map (read only through the map).
        self.weights_epoch = 0
        self._min_hit_epoch = 0
        self._block_epoch: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now (never used, freed, or cached with no user: all reusable)."""
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request may ever hold in total (the pool without the null block)."""
        return self.pool.num_blocks

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks one request of `num_tokens` tokens of context holds at once, over
        all groups, when each step feeds it at most `max_chunk` tokens."""
        return sum(spec.max_blocks_held(num_tokens, max_chunk) for spec in self.specs)

    def check_fits(self, num_tokens: int, max_chunk: int | None = None) -> None:
        """Refuse a request that could never be scheduled, however empty the pool.

        Raises:
            ValueError: naming the tokens, the blocks it needs per group and the pool size.
        """
        need = self.max_blocks_per_request(num_tokens, max_chunk)
        if need <= self.num_usable_blocks:
            return
        per_group = ", ".join(
            f"{_describe(s)} {s.max_blocks_held(num_tokens, max_chunk)}" for s in self.specs
        )
        raise ValueError(
            f"a request of {num_tokens} tokens (prompt + max_tokens - 1) needs {need} KV blocks "
            f"of {self.block_size} tokens ({per_group}) but the pool has "
            f"{self.num_usable_blocks}; it could never run"
        )

    def shares_blocks(self, request: Request) -> bool:
        """True when the request's full blocks are hashed, cached and looked up: with prefix
        caching on, or for a completion of a parallel-sampling request (`cache_salt`); never
        with linear-attention state slots."""
        if self.state_slots is not None:
            return False
        return self.enable_prefix_caching or request.cache_salt is not None

    def block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of the request's full blocks (extended as tokens arrive)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        self._extend_hashes(hashes, request.all_token_ids, request.cache_salt)
        return hashes

    def _extend_hashes(self, hashes: list[bytes], ids: Sequence[int], salt: str | None) -> None:
        """Append the hashes of the full blocks of `ids` that `hashes` lacks."""
        bs = self.block_size
        if hashes:
            parent = hashes[-1]
        elif salt is None:
            parent = self._root
        else:
            parent = hash_block_tokens(self._root, (), ("cache_salt", salt))
        for i in range(len(hashes), len(ids) // bs):
            parent = hash_block_tokens(parent, ids[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (new weights: the K/V in them is stale); returns how
        many blocks the map held. Requests still running keep their blocks; the hash chains
        of their later blocks continue from before the reset, and a request admitted after
        it starts a new chain, so it never finds K/V computed before the reset."""
        self._num_resets += 1
        self._root = hash_block_tokens(ROOT_BLOCK_HASH, (), ("reset", self._num_resets))
        return self.pool.clear_cache()

    def new_weights(self, flush: bool = True) -> int:
        """New weights serve from now on: `weights_epoch` advances and, with `flush`, the
        prefix cache is reset and blocks tagged before now never hit again; returns the
        blocks the map held (0 without `flush`)."""
        self.weights_epoch += 1
        if not flush:
            return 0
        self._min_hit_epoch = self.weights_epoch
        return self.reset_prefix_cache()

    def _cached_block(self, key: tuple[bytes, int]) -> int | None:
        """The block cached under `key` (hash, group) that a request may reuse, or None: a
        block tagged before the last flush never is (`new_weights`)."""
        b = self.pool.get_cached_block(key)
        if b is None or self._block_epoch.get(b, 0) < self._min_hit_epoch:
            return None
        return b

    def forget_prefix(self, request: Request) -> None:
        """Take a salted request's prompt blocks out of the prefix-cache map (when its last
        sibling has ended, with prefix caching off); a no-op otherwise. The blocks stay
        where they are (in use or free); they just cannot be found any more."""
        if self.enable_prefix_caching or request.cache_salt is None:
            return
        hashes: list[bytes] = []
        self._extend_hashes(hashes, request.prompt_token_ids, request.cache_salt)
        for h in hashes:
            for g in range(len(self.specs)):
                self.pool.uncache((h, g))

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix every group can serve (nothing is taken yet; pass the
        result to `allocate_slots`). Empty when prefix caching is off.

        The hit length is found as in vLLM v1's `HybridKVCacheCoordinator`: each group finds
        its longest hit no longer than the current length, the length becomes the shortest of
        them, until all groups agree (lengths only shrink, so this ends).
        """
        num_groups = len(self.specs)
        if not self.shares_blocks(request):
            return PrefixHit([[] for _ in range(num_groups)], 0, 0)
        hashes = self.block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size  # the last token is recomputed
        while True:
            found = [self._find_hit(g, hashes, limit) for g in range(num_groups)]
            shortest = min(len(f) for f in found)
            if all(len(f) == shortest for f in found):
                break
            limit = shortest
        tags = [self._block_epoch.get(b, 0) for f in found for b in f if b != NULL_BLOCK_ID]
        return PrefixHit(found, shortest * self.block_size, request.num_tokens,
                         min(tags) if tags else None)

    def _find_hit(self, group: int, hashes: list[bytes], limit: int) -> list[int]:
        """One group's longest cached prefix of at most `limit` blocks."""
        spec = self.specs[group]
        if spec.attention_chunk_size is not None:
            return self._find_chunked_hit(group, hashes, limit)
        window = spec.sliding_window
        if window is None:
            blocks = []
            for i in range(limit):
                b = self._cached_block((hashes[i], group))
                if b is None:
                    break
                blocks.append(b)
            return blocks
        # Sliding window (vLLM v1 SlidingWindowManager.find_longest_cache_hit): scan from the
        # right for `need` consecutive cached blocks; the blocks before them are not read.
        need = math.ceil((window - 1) / self.block_size)
        blocks = [NULL_BLOCK_ID] * limit
        if need == 0:
            return blocks
        run = 0
        for i in range(limit - 1, -1, -1):
            b = self._cached_block((hashes[i], group))
            if b is None:
                run = 0
                continue
            blocks[i] = b
            run += 1
            if run >= need:
                return blocks[: i + run]
        return blocks[:run]  # a shorter run from block 0 is a hit too: nothing precedes it

    def _find_chunked_hit(self, group: int, hashes: list[bytes], limit: int) -> list[int]:
        """A chunked-local group's longest hit of at most `limit` blocks: a prefix of n blocks
        needs only the cached blocks of the chunk its next query (at position n * block_size)
        falls in, from the chunk's first block to block n - 1 (none when n starts a chunk);
        the earlier ones are null (vLLM v1 `ChunkedLocalAttentionManager`)."""
        per_chunk = self.specs[group].attention_chunk_size // self.block_size
        for n in range(limit, -1, -1):
            first = n // per_chunk * per_chunk
            blocks = [self._cached_block((hashes[i], group)) for i in range(first, n)]
            if None not in blocks:
                return [NULL_BLOCK_ID] * first + blocks
        return []

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        cache_blocks: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        First gives back the blocks a sliding-window group no longer needs, then takes the
        cached prefix `hit` (a new request only) and the new blocks, all or nothing, and enters
        the blocks that become full in the prefix-cache map.

        Args:
            request: the request; `request.num_computed_tokens` tokens are in the cache.
            num_new_tokens: tokens this step feeds (after the hit, if any).
            hit: from `get_computed_blocks`, for a request that holds no blocks yet.
            num_lookahead_tokens: slots past the new tokens that the step writes but does
                not compute (MTP drafts' KV, vLLM's lookahead); their blocks are never
                entered in the prefix-cache map for them.
            cache_blocks: False leaves the new full blocks out of the prefix-cache map (K/V
                that arrives from another instance later; `cache_computed` enters them).

        Returns:
            False (nothing taken) when the pool has too few free blocks.
        """
        rid = request.request_id
        tables = self.block_tables.get(rid)
        if tables is None:
            tables = [[] for _ in self.specs]
            epoch = hit.weights_epoch if hit is not None else None
            request.kv_weights_epoch = self.weights_epoch if epoch is None else epoch
        hit_blocks = hit.blocks if hit is not None else [[] for _ in self.specs]
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        total = num_computed + num_new_tokens
        for spec, table in zip(self.specs, tables, strict=True):
            self._remove_skipped(spec, table, num_computed)
        new_counts = []
        needed = 0
        for spec, table, cached in zip(self.specs, tables, hit_blocks, strict=True):
            n = max(spec.blocks_needed(total + num_lookahead_tokens) - len(table) - len(cached), 0)
            new_counts.append(n)
            needed += n + sum(1 for b in cached if self.pool.is_free(b))
        if needed > self.pool.num_free_blocks:
            return False
        if self.state_slots is not None and self.state_slots.allocate(rid) is None:
            return False
        for table, cached in zip(tables, hit_blocks, strict=True):  # before any eviction
            self.pool.touch(cached)
            table.extend(cached)
        for table, n in zip(tables, new_counts, strict=True):
            if n:
                table.extend(self.pool.allocate(n))
        self.block_tables[rid] = tables
        if hit is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += hit.num_queried
            self.prefix_cache_hits += hit.num_tokens
        if cache_blocks and self.shares_blocks(request):
            self._cache_full_blocks(request, tables, total)
        return True

    def cache_computed(self, request: Request) -> None:
        """Enter the request's full computed blocks in the prefix-cache map (after K/V that
        `allocate_slots(cache_blocks=False)` left out arrived)."""
        tables = self.block_tables.get(request.request_id)
        if tables is not None and self.shares_blocks(request):
            self._cache_full_blocks(request, tables, request.num_computed_tokens)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Give back the sliding-window and chunked blocks no query after the request's
        computed tokens reads (the scheduler calls it after each step, so that between steps a
        request holds at most ceil(window / block_size) + 1 blocks in a sliding group, those of
        the current chunk in a chunked one; `allocate_slots` does it
        too)."""
        tables = self.block_tables.get(request.request_id)
        if tables is None:
            return
        for g in self._freeing:
            self._remove_skipped(self.specs[g], tables[g], request.num_computed_tokens)

    def _remove_skipped(self, spec: KVCacheSpec, table: list[int], num_computed: int) -> None:
        """Replace the blocks no later query reads by the null block and free them."""
        n = min(spec.num_skipped_blocks(num_computed), len(table))
        removed = []
        for i in range(n - 1, -1, -1):
            if table[i] == NULL_BLOCK_ID:
                break  # the earlier ones were removed before
            removed.append(table[i])
            table[i] = NULL_BLOCK_ID
        if removed:
            self.pool.free(removed[::-1])  # the pool frees in reverse: the latest goes first

    def _cache_full_blocks(self, request: Request, tables: list[list[int]], total: int) -> None:
        """Enter the blocks that are full once `total` tokens are computed in the map (only
        the prompt's when the request shares them through its salt alone)."""
        rid = request.request_id
        limit = request.num_tokens if self.enable_prefix_caching else request.num_prompt_tokens
        num_full = min(total, limit) // self.block_size
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for g, table in enumerate(tables):
            for i in range(start, num_full):
                if self.pool.cache_block(table[i], (hashes[i], g)):
                    self._block_epoch[table[i]] = request.kv_weights_epoch
        self._num_cached[rid] = num_full

    def free(self, request_id: str) -> None:
        """Return every block the request holds (no-op for an unknown id); cached blocks stay
        in the prefix-cache map until reallocated."""
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if self.state_slots is not None:
            self.state_slots.free(request_id)
        tables = self.block_tables.pop(request_id, None)
        if tables is None:
            return
        for table in tables:
            self.pool.free(table)

    def state_slot(self, request_id: str) -> int:
        """The request's linear-attention state slot (`kv_cache.state`).

        Raises:
            KeyError: no state slots, or the request holds none.
        """
        slot = None if self.state_slots is None else self.state_slots.slot_of(request_id)
        if slot is None:
            raise KeyError(f"request {request_id!r} holds no state slot")
        return slot

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block ids in one group, in token order (null blocks included)."""
        return self.block_tables[request_id][group]

    def num_blocks_held(self, request_id: str, group: int = 0) -> int:
        """Real (non-null) blocks the request holds in one group."""
        return sum(1 for b in self.block_tables[request_id][group] if b != NULL_BLOCK_ID)

    def blocks_used_per_group(self) -> list[int]:
        """Distinct blocks held by live requests, per group (a shared block counts once)."""
        used = [set() for _ in self.specs]
        for tables in self.block_tables.values():
            for g, table in enumerate(tables):
                used[g].update(table)
        return [len(u - {NULL_BLOCK_ID}) for u in used]


def _describe(spec: KVCacheSpec) -> str:
    if spec.kind == MLA_ATTENTION:
        return "MLA latent + indexer keys" if getattr(spec, "index_head_dim", 0) else "MLA latent"
    if spec.attention_chunk_size is not None:
        return f"chunked attention {spec.attention_chunk_size}"
    window = spec.sliding_window
    return "full attention" if window is None else f"sliding window {window}"
