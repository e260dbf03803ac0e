"""Attention over the paged KV cache (PagedAttention, Kwon et al., SOSP'23), CPU-friendly.

Each step's tokens are laid out flat; the model runner groups the requests into at most two
batches: single-token queries (decodes) and multi-token queries (prefill chunks). For each batch
one `scaled_dot_product_attention` call reads the keys through the block tables (whole blocks
gathered with one `index_select`), with a mask that is causal from each request's start
position. So the cost per layer is two batched calls per step, never a loop per request;
except for a CPU's prefill chunks of full attention without sinks, which attend one request at a
time over its own keys (`prefill_rows`: the padded, masked batch did about 6x the work of the
causal triangles on the bench's mixed prompt lengths).

That is the torch path. The kernel registry hands each layer its decode and prefill kernels
once (`PagedAttention.bind_kernels`, `KernelPlan.attention`, kernels/attention/paged.py):
native-cpu decode and bfloat16 prefill read the cache in place through the block tables;
triton runs both batch kinds through them (varlen queries by `query_start_loc`); a kernel of
None is this torch path.

Two gpt-oss features live here as well, both off (and free) for the other models:
- Sliding-window layers (Beltagy et al. 2020, "Longformer"; transformers'
  `sliding_window_overlay`): a key at position k is visible to the query at position q iff
  q - window < k <= q, i.e. the query sees itself and the window - 1 tokens before it. The
  window is a mask on key positions (a request's gathered blocks start at position 0, so a key's
  index is its position, whatever the cache still holds before the window), built once per step
  and batch and shared by all sliding layers (`AttentionBatch.mask_for`); full-attention layers
  use the causal mask as before.
- Attention sinks (gpt-oss; Xiao et al. 2023, "Efficient Streaming Language Models with
  Attention Sinks"): a learned logit s_h per query head joins each softmax denominator as a
  virtual key with no value, softmax([scores, s_h])[:-1] in transformers' `eager_attention_forward`.
  With lse the log-sum-exp of a row's visible scores, that is the plain attention output times
  exp(lse) / (exp(lse) + exp(s_h)) = sigmoid(lse - s_h). On a CPU the kernel that
  `scaled_dot_product_attention` dispatches to (flash attention for CPU) returns lse alongside
  the output, so sinks cost one multiply; elsewhere the scores are computed explicitly
  (`attention_with_sinks`, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kernels.attention.paged import PagedAttentionKernels
from kernels.attention.torch_rows import prefill_rows
from kernels.plan import KernelPlan
from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION


@dataclass
class AttentionBatch:
    """Requests of one step whose queries are attended together.

    Attributes:
        token_start, token_end: their tokens' range in the step's flat token layout.
        tok_b: [n] int64, batch row of each of the n tokens.
        tok_q: [n] int64, query column of each token within its row.
        block_ids: [B * nb] int64, the rows' block tables cut to nb = ceil(Lk / block_size)
            blocks and flattened (0 for padding).
        max_q: Lq, the longest query in the batch (tokens).
        q_pos: [B, Lq] int64, absolute position of each query row (padding rows included).
        block_tables: [B, max_blocks] int64 block tables (padded with the null block 0) and
        seq_lens: [B] int64 keys per row after this step (tokens); what the native decode
            kernel reads instead of gathered blocks.
        num_keys: nb * block_size, the gathered key columns of the torch path.
        query_start_loc: [B + 1] int64, where each row's queries start in the batch's tokens
            (cumulative query lengths; the varlen layout of the Triton kernels).

    Every tensor lives on the device of the block tables (the engine's device).

    The masks (`mask`, `mask_for`) are built on first use only: the native decode kernel needs
    none, so a decode batch on a CPU with the native kernels builds no mask at all.
    """

    token_start: int
    token_end: int
    tok_b: torch.Tensor
    tok_q: torch.Tensor
    block_ids: torch.Tensor
    max_q: int
    q_pos: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_keys: int
    query_start_loc: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    def with_tensors(self, **tensors: torch.Tensor) -> AttentionBatch:
        """This batch with some tensors replaced (e.g. by their device copies), and no masks
        built yet (they follow the new tensors)."""
        return replace(self, **tensors, _masks={})

    def clear_masks(self) -> None:
        """Forget the masks built so far (after this batch's tensors changed in place)."""
        self._masks.clear()

    def store(self, key: tuple, value: torch.Tensor | None) -> None:
        """Keep a per-step value of one layer for the later layers of the step (a sparse
        attention's key selection, which layers without an indexer reuse); forgotten with
        the masks."""
        self._masks[key] = value

    def stored(self, key: tuple) -> torch.Tensor | None:
        """The value `store` kept under `key` in this step.

        Raises:
            KeyError: nothing was stored under it (naming the key).
        """
        if key not in self._masks:
            raise KeyError(f"no per-step value {key!r} was stored by an earlier layer")
        return self._masks[key]

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, Lq, nb * block_size] bool, True where the query may attend the key (causal,
        full attention); built once per batch."""
        if "causal" not in self._masks:
            key_pos = torch.arange(self.num_keys, device=self.q_pos.device)
            visible = (key_pos[None, None, :] <= self.q_pos[:, :, None]) & (
                key_pos[None, None, :] < self.seq_lens[:, None, None]
            )
            self._masks["causal"] = visible.unsqueeze(1)
        return self._masks["causal"]

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The bool mask of a layer: `mask` itself for full attention; for a sliding window
        also key_pos > q_pos - sliding_window (transformers' convention). Built once per batch
        and window, then shared by the layers.

        Returns:
            [B, 1, Lq, nb * block_size] bool.
        """
        if sliding_window is None:
            return self.mask
        key = ("window", sliding_window)
        if key not in self._masks:
            key_pos = torch.arange(self.num_keys, device=self.q_pos.device)
            inside = key_pos > self.q_pos[:, None, :, None] - sliding_window
            self._masks[key] = self.mask & inside
        return self._masks[key]

    def additive_mask_for(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """`mask_for(sliding_window)` as 0 / -inf in `dtype` (what the CPU flash kernel takes),
        cached like it. Returns [B, 1, Lq, nb * block_size]."""
        key = ("additive", sliding_window, dtype)
        if key not in self._masks:
            visible = self.mask_for(sliding_window)
            zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = zeros.masked_fill_(~visible, float("-inf"))
        return self._masks[key]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step.

    Attributes:
        slot_mapping: [T] int64, cache slot (block_id * block_size + offset) of each new token.
        batches: the query batches, covering [0, T) in order.
        groups: with several KV-cache groups, one metadata per group (its own slot_mapping
            and batches, from its own block tables); the fields above are group 0's. None: one
            group, this metadata itself.
        linear: the requests' state slots for linear-attention layers
            (`gated_delta_net.LinearAttentionMetadata`); None in a model without them.
    """

    slot_mapping: torch.Tensor
    batches: list[AttentionBatch]
    groups: list[AttentionMetadata] | None = None
    linear: object | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV-cache group `group` (a layer's `PagedAttention.kv_group`)."""
        return self if self.groups is None else self.groups[group]


def build_attention_batch(
    token_start: int,
    q_lens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionBatch:
    """Build one query batch's gather indices (its masks come on first use), vectorised over
    its requests.

    Args:
        token_start: flat index of the batch's first token.
        q_lens: [B] int64, tokens fed per request this step.
        starts: [B] int64, tokens already cached per request (position of its first query).
        block_tables: [B, max_blocks] int64, padded with 0.
        block_size: tokens per block.
    """
    seq_lens = starts + q_lens
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    b = q_lens.numel()
    device = block_tables.device
    tok_b = torch.repeat_interleave(torch.arange(b, device=device), q_lens)
    ends = torch.cumsum(q_lens, 0)
    offsets = ends - q_lens
    tok_q = torch.arange(int(ends[-1]), device=device) - offsets[tok_b]
    num_blocks = (max_k + block_size - 1) // block_size
    # [B, Lq] absolute positions
    q_pos = starts[:, None] + torch.arange(max_q, device=device)[None, :]
    return AttentionBatch(
        token_start=token_start,
        token_end=token_start + int(q_lens.sum()),
        tok_b=tok_b,
        tok_q=tok_q,
        block_ids=block_tables[:, :num_blocks].reshape(-1),
        max_q=max_q,
        q_pos=q_pos,
        block_tables=block_tables,
        seq_lens=seq_lens,
        num_keys=num_blocks * block_size,
        query_start_loc=torch.cat([ends.new_zeros(1), ends]),
    )


def build_decode_batch(starts: list[int], block_tables: torch.Tensor,
                       block_size: int) -> AttentionBatch:
    """`build_attention_batch` for a batch of decodes only (one query token per request, the
    batch starting at token 0), from the host's plain ints: the same tensors in fewer ops
    (a decode step's host work is per-op overhead at small batches).

    Args:
        starts: tokens already cached per request (each query's position), B >= 1 of them.
        block_tables: [B, max_blocks] int64, padded with 0.
        block_size: tokens per block.
    """
    b = len(starts)
    device = block_tables.device
    start = torch.tensor(starts, dtype=torch.int64, device=device)
    num_blocks = (max(starts) + block_size) // block_size  # ceil((max start + 1) / size)
    rows = torch.arange(b + 1, device=device)
    return AttentionBatch(
        token_start=0,
        token_end=b,
        tok_b=rows[:b],
        tok_q=torch.zeros(b, dtype=torch.int64, device=device),
        block_ids=block_tables[:, :num_blocks].reshape(-1),
        max_q=1,
        q_pos=start[:, None],
        block_tables=block_tables,
        seq_lens=start + 1,
        num_keys=num_blocks * block_size,
        query_start_loc=rows,
    )


class KVCacheLayer(torch.nn.Module):
    """What the ModelRunner needs of the one module per decoder layer that owns the layer's KV
    cache slot (`PagedAttention`, `mla.MLAAttention`): the attention kind and window it
    expects of its cache group, and the group it reads (set by the runner).

    Attributes:
        sliding_window: keys a query attends, itself included; None for full attention.
        kv_group: index of the KV-cache group whose block tables and slot mapping it reads
            (`AttentionMetadata.for_group`); 0 until the ModelRunner sets it.
    """

    sliding_window: int | None = None
    kv_group: int = 0
    #: Tokens per chunk of chunked local attention (`chunked_attention`); None: other kinds.
    attention_chunk_size: int | None = None

    @property
    def cache_kind(self) -> str:
        """The `KVCacheSpec.kind` of the group this layer's cache must belong to."""
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION


class PagedAttention(KVCacheLayer):
    """Writes this step's K/V into the layer's cache and attends through the block tables.

    Args:
        num_heads: query heads; num_kv_heads: key/value heads (GQA when fewer); head_dim.
        scale: softmax scale (head_dim ** -0.5 for the models here).
        sliding_window: keys older than this many tokens (the query included) are masked;
            None: full attention (see the module docstring for the convention).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token, got {sliding_window}")
        self.sliding_window = sliding_window
        #: The KV-cache group whose block tables this layer reads (set by the ModelRunner).
        self.kv_group = 0
        #: The decode and prefill kernels (`bind_kernels`; the torch path until bound).
        self.kernels = PagedAttentionKernels()
        #: The torch path on a CPU: sinks through the CPU flash kernel's log-sum-exp.
        self._cpu_flash = False

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's decode and prefill kernels for this layer
        (`KernelPlan.attention`)."""
        self.kernels = plan.attention(self.num_heads, self.num_kv_heads)
        self._cpu_flash = plan.device == "cpu" and _CPU_FLASH_WITH_LSE is not None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], or both None when the caller has written them into
        the cache (`kernels.dense.ops.qk_norm_rope_cache`); kv_cache: two [num_blocks,
        block_size, Hkv, D]; sinks: optional [Hq] per-head sink logits (gpt-oss), None for
        plain softmax.

        Returns:
            [T, Hq * D] attention output, q's dtype.
        """
        meta = meta.for_group(self.kv_group)
        k_cache, v_cache = kv_cache
        if k is not None:  # None: the caller wrote this step's keys and values already
            for cache, new in ((k_cache, k), (v_cache, v)):
                cache.view(-1, *new.shape[1:]).index_copy_(0, meta.slot_mapping,
                                                           new.to(cache.dtype))
        t = q.shape[0]
        batches = self.query_batches(meta, k_cache.shape[1])
        if len(batches) == 1 and (batches[0].token_start, batches[0].token_end) == (0, t):
            # one batch (a decode step): its output is the layer's, no copy into a buffer
            return self._attend(q, k_cache, v_cache, batches[0], sinks).reshape(t, -1)
        out = torch.empty_like(q)
        for batch in batches:
            out[batch.token_start : batch.token_end] = self._attend(
                q[batch.token_start : batch.token_end], k_cache, v_cache, batch, sinks
            )
        return out.view(t, -1)

    def query_batches(self, meta: AttentionMetadata, block_size: int) -> list[AttentionBatch]:
        """The batches this layer attends (the step's own here; chunked local attention
        rewrites them, `chunked_attention.ChunkedLocalPagedAttention`)."""
        return meta.batches

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel = self.kernels.decode if batch.max_q == 1 else self.kernels.prefill
        if kernel is not None:
            out = kernel(q, k_cache, v_cache, batch, self.scale, self.sliding_window, sinks)
            if out is not None:  # None: a call the kernel hands to the torch path below
                return out
        if (batch.max_q > 1 and sinks is None and self.sliding_window is None
                and q.device.type == "cpu"):
            return prefill_rows(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                batch.query_start_loc, self.scale,
            )
        b = batch.seq_lens.shape[0]
        keys, values = (_gather_blocks(c, batch.block_ids, b) for c in (k_cache, v_cache))
        if batch.max_q == 1:
            # Decode: a KV head's G query heads become its G query rows, so one
            # non-GQA call covers the batch (faster on CPU than enable_gqa).
            groups = self.num_heads // self.num_kv_heads
            q_rows = q.view(b, self.num_kv_heads, groups, self.head_dim)
            row_sinks = None if sinks is None else sinks.view(self.num_kv_heads, groups)
            o = self._sdpa(q_rows, keys, values, batch, row_sinks)
            return o.reshape(b, self.num_heads, self.head_dim)
        q_pad = q.new_zeros(b, batch.max_q, self.num_heads, self.head_dim)
        q_pad[batch.tok_b, batch.tok_q] = q
        head_sinks = None if sinks is None else sinks.view(self.num_heads, 1)
        o = self._sdpa(q_pad.transpose(1, 2), keys, values, batch, head_sinks)
        return o.transpose(1, 2)[batch.tok_b, batch.tok_q]  # [B, Lq, Hq, D] -> [n, Hq, D]

    def _sdpa(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        batch: AttentionBatch,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """q: [B, Hk, Lq, D] (GQA when Hk > keys' heads); keys/values: [B, Hkv, Lk, D];
        sinks: None, or sink logits [Hk, Lq] (decode: one per query row) or [Hk, 1] (one per
        head) -> [B, Hk, Lq, D]."""
        gqa = q.shape[1] != keys.shape[1]
        if sinks is None:
            mask = batch.mask_for(self.sliding_window)
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        if self._cpu_flash:
            mask = batch.additive_mask_for(self.sliding_window, q.dtype)
            # GQA: the CPU kernel maps query head h to KV head h // (Hq / Hkv) itself.
            out, lse = _CPU_FLASH_WITH_LSE(q, keys, values, attn_mask=mask, scale=self.scale)
            keep = torch.sigmoid(lse.float() - sinks.float())  # [B, Hk, Lq]
            return (out.float() * keep.unsqueeze(-1)).to(q.dtype)
        return attention_with_sinks(
            q, keys, values, batch.mask_for(self.sliding_window), sinks, self.scale
        )


#: `aten::_scaled_dot_product_flash_attention_for_cpu` (what `scaled_dot_product_attention`
#: runs on a CPU; returns the output and the log-sum-exp of each row), None when absent.
_CPU_FLASH_WITH_LSE = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


def attention_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention whose softmax has one more, value-less column per head: the sink logit
    (gpt-oss; transformers `eager_attention_forward` of `modeling_gpt_oss`). Explicit scores
    in float32: the reference, and the path off the CPU.

    Args:
        q: [B, Hq, Lq, D]; keys, values: [B, Hkv, Lk, D] with Hkv dividing Hq.
        mask: [B, 1, Lq, Lk] bool, True where visible.
        sinks: [Hq, 1] or [Hq, Lq] sink logits (per head, or per query row).
        scale: multiplies q . k.

    Returns:
        [B, Hq, Lq, D] in q's dtype.
    """
    groups = q.shape[1] // keys.shape[1]
    keys, values = (t.repeat_interleave(groups, dim=1).float() for t in (keys, values))
    scores = (q.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_col = sinks.float().expand(q.shape[1], q.shape[2]).unsqueeze(-1)
    logits = torch.cat([scores, sink_col.expand(q.shape[0], -1, -1, -1)], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; block_ids: [rows * nb] -> [rows, Hkv, L, D].

    Whole blocks are copied as contiguous rows, which is several times faster than gathering
    key slots one by one.
    """
    num_blocks, block_size, heads, dim = cache.shape
    flat = cache.view(num_blocks, -1).index_select(0, block_ids)
    return flat.view(rows, -1, heads, dim).transpose(1, 2)
