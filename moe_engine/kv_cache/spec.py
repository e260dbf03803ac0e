"""What each KV-cache group needs per block (vLLM v1's `KVCacheSpec` family) and how the layers
are split into groups.

A group is a set of layers with the same attention kind; each request holds one block table per
group, and all groups draw their blocks from one `BlockPool`. As in vLLM v1's hybrid allocator,
every group has the same number of layers: layer `j` of each group shares one physical
[num_blocks + 1, block_size, num_kv_heads, head_dim] tensor pair, so a block id means the same
bytes whichever group holds it, and a block of a sliding-window group costs only the bytes of that
group's layers.

Specs:
- `FullAttentionSpec`: every token of the context stays in the cache.
- `SlidingWindowSpec(sliding_window=W)`: a query at position p reads keys (p - W, p]
  (W keys including itself, `transformers`' `sliding_window_overlay`); blocks wholly before the
  window of the next query are given back to the pool and replaced by the null block.
- `ChunkedLocalAttentionSpec(attention_chunk_size=C)`: chunked local attention (Llama 4): a
  query at position p reads keys [floor(p / C) * C, p], those of its own chunk; blocks wholly
  before the next query's chunk are given back as a sliding window's are (vLLM v1's
  `ChunkedLocalAttentionSpec`). C must be a multiple of block_size, so that a chunk starts on
  a block and each chunk's keys are whole blocks of the block table.
- `MLAAttentionSpec`: multi-head latent attention (DeepSeek-V2/V3): one latent vector of
  kv_lora_rank + qk_rope_head_dim values per token and layer (the normalised c_kv, then the
  roped k_pe), no separate V; the cache per layer is [num_blocks + 1, block_size, latent_dim]
  (vLLM's `MLAAttentionSpec`). Blocks behave as full attention's, so prefix caching is unchanged.
  With `index_head_dim` set (DeepSeek Sparse Attention, DeepSeek-V3.2 / GLM-5): each layer also
  holds the lightning indexer's key of index_head_dim values per token in a second tensor
  [num_blocks + 1, block_size, index_head_dim] at the same slots, so a block id names the same
  tokens in both and a cached prefix block carries its indexer keys too (they are a function of
  the prefix, as the latent is).
A fixed-size linear-attention state (a `MambaSpec` later) fits the same interface: its
`max_blocks_held` is a constant and `num_skipped_blocks` drops every block but the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Block 0 of the physical cache: never allocated, never written, all zeros. Block tables use
#: it for padding and for the blocks a sliding-window group has given back (vLLM's null block).
NULL_BLOCK_ID = 0

#: Attention kinds a model may declare (`transformers` `layer_types` names map onto them).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: Multi-head latent attention (DeepSeek-V2 sec. 2.1): the cache holds the compressed latent.
MLA_ATTENTION = "mla"
#: Chunked local attention (Llama 4's `attention_chunk_size`): a query sees its own chunk only.
CHUNKED_LOCAL_ATTENTION = "chunked_attention"
#: Linear attention (Gated DeltaNet): no paged KV, a fixed state per request (`kv_cache.state`).
LINEAR_ATTENTION = "linear_attention"


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

    @property
    def kind(self) -> str:
        """The attention kind (`FULL_ATTENTION`, `SLIDING_ATTENTION`,
        `CHUNKED_LOCAL_ATTENTION` or `MLA_ATTENTION`)."""
        return FULL_ATTENTION

    @property
    def sliding_window(self) -> int | None:
        """Keys a query attends (including itself); None for full attention."""
        return None

    @property
    def attention_chunk_size(self) -> int | None:
        """Tokens per attention chunk of chunked local attention; None for other kinds."""
        return None

    @property
    def frees_blocks(self) -> bool:
        """Whether blocks before the next query's first key go back to the pool
        (`num_skipped_blocks` > 0 for some context): sliding and chunked groups."""
        return False

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token leaves in this group's layers: 2 x layers x kv_heads x d x
        itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """`bytes_per_token * block_size`."""
        return self.bytes_per_token * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Length of the block table (real or null entries) that covers `num_tokens` tokens."""
        return math.ceil(num_tokens / self.block_size)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at a position >= `num_computed_tokens` reads (0 here)."""
        return 0

    def max_blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most real blocks one request of `num_tokens` tokens of context holds at once in
        this group, when each step feeds it at most `max_chunk` tokens (None: unlimited)."""
        return self.blocks_needed(num_tokens)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token of the context stays in the cache."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Only the last `window` tokens are attended; older blocks go back to the pool.

    Attributes:
        window: keys a query attends, itself included (config.json `sliding_window`).

    Raises:
        ValueError: window < 1.
    """

    window: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {self.window}")

    @property
    def kind(self) -> str:
        return SLIDING_ATTENTION

    @property
    def sliding_window(self) -> int | None:
        return self.window

    @property
    def frees_blocks(self) -> bool:
        return True

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before position `num_computed_tokens - window + 1`, the first key the
        next query (at `num_computed_tokens`) reads (vLLM v1 `SlidingWindowManager`)."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """A step that feeds `c` tokens from position `s` holds the blocks of positions
        [s - window + 1, s + c): at most ceil((window - 1 + c) / block_size) + 1 blocks, which is
        ceil(window / block_size) + 1 for a decode (c = 1); never more than the whole context."""
        chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
        span = math.ceil((self.window - 1 + chunk) / self.block_size) + 1
        return min(self.blocks_needed(num_tokens), span)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Chunked local attention: the context is cut into chunks of `chunk` tokens from position
    0 and a query at position p attends keys [floor(p / chunk) * chunk, p] (transformers'
    `chunked_overlay` with causal masking; Llama 4's iRoPE local layers; vLLM v1
    `ChunkedLocalAttentionSpec`).

    Attributes:
        chunk: `attention_chunk_size` (tokens), a multiple of block_size.

    Raises:
        ValueError: chunk < 1 or not a multiple of block_size.
    """

    chunk: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.chunk % self.block_size:
            raise ValueError(
                f"attention_chunk_size {self.chunk} must be a positive multiple of the KV "
                f"block size {self.block_size} (tokens): each chunk's keys are whole blocks; "
                f"serve it with a --block-size that divides {self.chunk}"
            )

    @property
    def kind(self) -> str:
        return CHUNKED_LOCAL_ATTENTION

    @property
    def attention_chunk_size(self) -> int | None:
        return self.chunk

    @property
    def frees_blocks(self) -> bool:
        return True

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks before the chunk of the next query (at `num_computed_tokens`)."""
        return (num_computed_tokens // self.chunk) * self.chunk // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """A step that feeds `c` tokens from position `s` holds the blocks of positions
        [floor(s / chunk) * chunk, s + c): at most ceil((chunk - 1 + c) / block_size) blocks
        (the first starts a block), never more than the whole context."""
        fed = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
        span = math.ceil((self.chunk - 1 + fed) / self.block_size)
        return min(self.blocks_needed(num_tokens), span)


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: per token and layer one latent vector [c_kv | k_pe] of
    `kv_lora_rank + qk_rope_head_dim` values, shared by every head (DeepSeek-V2, Liu et al. 2024,
    sec. 2.1 "low-rank key-value joint compression"; vLLM v1 `MLAAttentionSpec`).

    The base fields read num_kv_heads = 1 and head_dim = the latent dim; blocks need the
    whole context, as full attention's.

    Attributes:
        kv_lora_rank: width of the compressed c_kv (config.json `kv_lora_rank`).
        qk_rope_head_dim: width of the decoupled, roped key k_pe (`qk_rope_head_dim`).
        index_head_dim: DeepSeek Sparse Attention's indexer key per token and layer
            (config.json `index_head_dim`; the "lightning indexer" of the DeepSeek-V3.2-Exp
            report; vLLM keeps it in a cache layer of its own, [num_blocks, block_size,
            head_size] in `DeepseekV32IndexerBackend`), held here in a second tensor at the
            same slots; 0: dense MLA, no indexer keys.

    Raises:
        ValueError: kv_lora_rank < 1, qk_rope_head_dim or index_head_dim < 0, or
            num_kv_heads / head_dim other than 1 / kv_lora_rank + qk_rope_head_dim.
    """

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kv_lora_rank < 1 or self.qk_rope_head_dim < 0 or self.index_head_dim < 0:
            raise ValueError(
                f"MLA cache: kv_lora_rank {self.kv_lora_rank} must be >= 1, "
                f"qk_rope_head_dim {self.qk_rope_head_dim} and index_head_dim "
                f"{self.index_head_dim} >= 0"
            )
        if self.num_kv_heads != 1 or self.head_dim != self.latent_dim:
            raise ValueError(
                f"MLA cache: num_kv_heads {self.num_kv_heads} / head_dim {self.head_dim} must be "
                f"1 / kv_lora_rank + qk_rope_head_dim = {self.latent_dim}"
            )

    @classmethod
    def make(
        cls,
        block_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        num_layers: int,
        index_head_dim: int = 0,
    ) -> MLAAttentionSpec:
        """The spec from the MLA dims (num_kv_heads 1, head_dim the latent dim)."""
        latent = kv_lora_rank + qk_rope_head_dim
        return cls(block_size, 1, latent, dtype, num_layers, kv_lora_rank, qk_rope_head_dim,
                   index_head_dim)

    @property
    def kind(self) -> str:
        return MLA_ATTENTION

    @property
    def latent_dim(self) -> int:
        """Values per token and layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Latent (and indexer key) bytes one token leaves in this group's layers: layers x
        (kv_lora_rank + qk_rope_head_dim + index_head_dim) x itemsize (DeepSeek-V3 at bf16:
        61 x 576 x 2 = 70,272 B; V3.2 adds 61 x 128 x 2)."""
        return self.num_layers * (self.latent_dim + self.index_head_dim) * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV-cache group: its spec and its decoder-layer indices (in tensor-slot order: layer
    `layers[j]` uses the shared cache tensor pair `j`)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


#: What a model declares: (attention kind, sliding window or None, decoder-layer indices); for
#: `CHUNKED_LOCAL_ATTENTION` the second entry is the attention_chunk_size (tokens).
AttentionGroup = tuple[str, int | None, tuple[int, ...]]


def make_kv_cache_groups(
    attention_groups: list[AttentionGroup],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int = 0,
    index_head_dim: int = 0,
) -> list[KVCacheGroup]:
    """Split a model's layers into equal-sized KV-cache groups.

    Layers of one attention kind (and window) are cut, in index order, into groups of
    gcd(layers per kind) layers, so every group has the same size and one physical tensor pair
    per group slot serves all groups (vLLM v1 `_get_kv_cache_config_uniform_page_size`; the
    gcd leaves no padding layer). A model of one kind gets one group with all its layers.

    Args:
        attention_groups: (kind, window, layers) per attention kind, from
            `MoeCausalLM.kv_cache_groups_for`; kind is "full_attention", "sliding_attention",
            "chunked_attention" (window: the attention_chunk_size) or "mla" (window None).
        block_size, num_kv_heads, head_dim, dtype: the cache shape (num_kv_heads and head_dim
            unused by MLA groups).
        kv_lora_rank, qk_rope_head_dim: the latent's parts (`MLAAttentionSpec`); needed only
            when a group is "mla"; index_head_dim: its indexer keys (0: none).

    Raises:
        ValueError: an unknown kind, a sliding kind without a window, a chunked kind whose
            chunk is not a multiple of block_size, an MLA kind without
            kv_lora_rank or beside other kinds (their cache tensors differ in shape), an empty
            group, or a layer in two groups.
    """
    kinds = [(kind, window, tuple(layers)) for kind, window, layers in attention_groups if layers]
    if not kinds:
        raise ValueError("the model declares no attention layers")
    seen: set[int] = set()
    for _, _, layers in kinds:
        if seen & set(layers):
            raise ValueError(f"layers {sorted(seen & set(layers))} are in two attention groups")
        seen |= set(layers)
    if any(k == MLA_ATTENTION for k, _, _ in kinds) and len({k for k, _, _ in kinds}) > 1:
        raise ValueError(
            f"attention kinds {sorted({k for k, _, _ in kinds})}: MLA layers cannot share "
            f"cache tensors with other kinds (their per-layer cache shapes differ)"
        )
    size = math.gcd(*(len(layers) for _, _, layers in kinds))
    groups = []
    for kind, window, layers in kinds:
        if kind == MLA_ATTENTION:
            if not kv_lora_rank:
                raise ValueError("an mla group needs kv_lora_rank (config.json) >= 1")
            spec: KVCacheSpec = MLAAttentionSpec.make(
                block_size, kv_lora_rank, qk_rope_head_dim, dtype, size, index_head_dim
            )
        elif kind == FULL_ATTENTION:
            spec = FullAttentionSpec(block_size, num_kv_heads, head_dim, dtype, size)
        elif kind == SLIDING_ATTENTION:
            if not window:
                raise ValueError("a sliding_attention group needs a sliding window (tokens)")
            spec = SlidingWindowSpec(block_size, num_kv_heads, head_dim, dtype, size, window)
        elif kind == CHUNKED_LOCAL_ATTENTION:
            spec = ChunkedLocalAttentionSpec(
                block_size, num_kv_heads, head_dim, dtype, size, window or 0
            )
        else:
            raise ValueError(
                f"attention kind {kind!r} is not supported; use {FULL_ATTENTION!r}, "
                f"{SLIDING_ATTENTION!r}, {CHUNKED_LOCAL_ATTENTION!r} or {MLA_ATTENTION!r}"
            )
        groups += [KVCacheGroup(spec, layers[i : i + size]) for i in range(0, len(layers), size)]
    return groups
