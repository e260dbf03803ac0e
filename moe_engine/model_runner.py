"""ModelRunner: turns a `SchedulerOutput` into flat batch tensors, runs the model, samples.

Tokens are laid out requests-contiguous, single-token queries (decodes) first, then prefill
chunks, so attention can treat each kind as one batch (see models/layers/attention.py).

KV-cache groups (kv_cache/spec.py): every group has its own block tables, slot mapping and
attention batches (`AttentionMetadata.groups`); each layer reads its group's
(`KVCacheLayer.kv_group`). Layer `group.layers[j]` of every group uses the same cache tensor
pair `j`, so the cache holds (layers per group) pairs of [num_blocks + 1, block_size,
num_kv_heads, head_dim] tensors, block 0 being the null block; MLA groups (`MLAAttentionSpec`)
hold one latent tensor [num_blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim] per slot
instead of a pair.
"""

from __future__ import annotations

import torch

from moe_engine.kv_cache import (
    KVCacheGroup,
    KVCacheManager,
    KVCacheSpec,
    MLAAttentionSpec,
    make_kv_cache_groups,
)
from moe_engine.models import MoeCausalLM
from moe_engine.models.layers.attention import (
    AttentionMetadata,
    KVCacheLayer,
    build_attention_batch,
)
from moe_engine.sampler import Sampler, SamplerOutput
from moe_engine.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler.

    Args:
        model: the loaded model.
        num_blocks: usable KV blocks in the pool (the null block comes on top);
            block_size: tokens per block.
        kv_dtype: cache element type.
        sampler: picks the tokens.
        kv_groups: the KV-cache groups (as the KVCacheManager's specs, in the same order);
            None: made from `model.kv_cache_groups()`.

    `kv_caches[i]` is layer i's (K, V) pair, each [num_blocks + 1, block_size, num_kv_heads,
    head_dim], or for an MLA group one latent tensor [num_blocks + 1, block_size,
    kv_lora_rank + qk_rope_head_dim]; layers in the same slot of different groups share it.

    Raises:
        ValueError: a layer in no group, or a group whose kind or window differs from its
            layers' (`KVCacheLayer.cache_kind`, `sliding_window`).
    """

    def __init__(
        self,
        model: MoeCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        sampler: Sampler,
        kv_groups: list[KVCacheGroup] | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        spec = model.spec
        if kv_groups is None:
            kv_groups = make_kv_cache_groups(
                model.kv_cache_groups(),
                block_size=block_size,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=kv_dtype,
                kv_lora_rank=spec.kv_lora_rank,
                qk_rope_head_dim=spec.qk_rope_head_dim,
            )
        self.kv_groups = kv_groups
        slots = [
            _allocate_slot(kv_groups[0].spec, num_blocks, kv_dtype)
            for _ in range(len(kv_groups[0].layers))
        ]
        caches: list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None]
        caches = [None] * spec.num_layers
        for g, group in enumerate(kv_groups):
            for j, index in enumerate(group.layers):
                caches[index] = slots[j]
                attn = _kv_cache_layer(model, index)
                if attn.cache_kind != group.spec.kind:
                    raise ValueError(
                        f"layer {index}: attention kind {attn.cache_kind!r}, but its KV cache "
                        f"group {g} is {group.spec.kind!r}"
                    )
                if attn.sliding_window != group.spec.sliding_window:
                    raise ValueError(
                        f"layer {index}: attention window {attn.sliding_window}, but its KV "
                        f"cache group {g} has window {group.spec.sliding_window}"
                    )
                attn.kv_group = g
        missing = [i for i, c in enumerate(caches) if c is None]
        if missing:
            raise ValueError(f"layers {missing} are in no KV cache group")
        self.kv_caches = caches

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[ScheduledRequest], SamplerOutput]:
        """Run one step.

        Returns:
            (the scheduled requests that sampled a token, in row order; their sampler output).
        """
        ordered = sorted(out.scheduled, key=lambda s: s.num_tokens > 1)  # stable: decodes first
        input_ids, positions, meta = self._prepare(ordered, kv)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        ends = torch.tensor([s.num_tokens for s in ordered]).cumsum(0) - 1
        sampling = [i for i, s in enumerate(ordered) if s.samples]
        rows = [ordered[i] for i in sampling]
        if not rows:
            return [], SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[ends[sampling]])
        return rows, self.sampler(logits, [s.request for s in rows])

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A zero-token step for a rank with nothing scheduled under expert parallelism: each
        MoE layer still joins its dispatch and combine (and runs its experts on the tokens
        other ranks send), so every all-to-all has all its participants (DESIGN.md section 1).
        """
        spec = self.model.spec
        dtype = self.model.model.embed_tokens.weight.dtype
        empty = torch.empty(0, spec.hidden_size, dtype=dtype)
        for _, moe in self.model.moe_layers():
            moe(empty)

    def _prepare(
        self, ordered: list[ScheduledRequest], kv: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        for s in ordered:
            ids.extend(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        q_lens = torch.tensor([s.num_tokens for s in ordered], dtype=torch.int64)
        starts = torch.tensor([s.start for s in ordered], dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(ordered)), q_lens)
        offsets = torch.cumsum(q_lens, 0) - q_lens
        positions = starts[row] + torch.arange(len(ids)) - offsets[row]
        num_decodes = int((q_lens == 1).sum())
        metas = [
            self._group_metadata(g, ordered, kv, q_lens, starts, row, positions, num_decodes)
            for g in range(len(self.kv_groups))
        ]
        meta = metas[0]
        if len(metas) > 1:
            meta = AttentionMetadata(meta.slot_mapping, meta.batches, groups=metas)
        return torch.tensor(ids, dtype=torch.int64), positions, meta

    def _group_metadata(
        self,
        group: int,
        ordered: list[ScheduledRequest],
        kv: KVCacheManager,
        q_lens: torch.Tensor,
        starts: torch.Tensor,
        row: torch.Tensor,
        positions: torch.Tensor,
        num_decodes: int,
    ) -> AttentionMetadata:
        """One KV-cache group's slot mapping and attention batches (block tables padded with
        the null block 0)."""
        tables = [kv.block_table(s.request.request_id, group) for s in ordered]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        slot_mapping = (
            block_tables[row, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        batches = []
        if num_decodes:
            batches.append(
                build_attention_batch(
                    0,
                    q_lens[:num_decodes],
                    starts[:num_decodes],
                    block_tables[:num_decodes],
                    self.block_size,
                )
            )
        if num_decodes < len(ordered):
            batches.append(
                build_attention_batch(
                    num_decodes,
                    q_lens[num_decodes:],
                    starts[num_decodes:],
                    block_tables[num_decodes:],
                    self.block_size,
                )
            )
        return AttentionMetadata(slot_mapping=slot_mapping, batches=batches)


def _allocate_slot(
    spec: KVCacheSpec, num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """One layer slot's zeroed cache: a (K, V) pair of [num_blocks + 1, block_size,
    num_kv_heads, head_dim], or for MLA one latent tensor [num_blocks + 1, block_size,
    latent_dim] (block 0 the null block)."""
    if isinstance(spec, MLAAttentionSpec):
        return torch.zeros(num_blocks + 1, spec.block_size, spec.latent_dim, dtype=dtype)
    shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _kv_cache_layer(model: MoeCausalLM, index: int) -> KVCacheLayer:
    """The one KV-cache-owning module (`PagedAttention`, `MLAAttention`) of decoder layer
    `index`.

    Raises:
        ValueError: when the layer has none or several.
    """
    found = [m for m in model.model.layers[index].modules() if isinstance(m, KVCacheLayer)]
    if len(found) != 1:
        raise ValueError(f"layer {index} has {len(found)} KV cache attention modules, expected 1")
    return found[0]
