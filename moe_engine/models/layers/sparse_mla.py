"""Sparse multi-head latent attention: MLA over the keys a lightning indexer selects (DeepSeek
Sparse Attention, DSA: DeepSeek-V3.2, GLM-5).

The layer is `mla.MLAAttention` (projections, latent cache, expanded prefill, absorbed
decode) whose causal mask is narrowed, per query, to the `index_topk` keys the indexer
(`layers/indexer.py`) scores highest: transformers 5.24's `DeepseekV32Attention` folds the
same selection into its attention mask (eager / SDPA), and vLLM's sparse FlashMLA kernels read
only the selected latents. Here the selection is a bool mask over the gathered latents
(`AttentionBatch.mask`'s shape), so both attention paths are unchanged; a decode with a
selection runs the torch absorbed path (the decode kernel reads whole contexts); a batch whose
rows all see at most index_topk keys keeps the causal mask and the kernels.

The layer's cache is the pair (latent [num_blocks + 1, block_size, kv_lora_rank + rope],
indexer keys [num_blocks + 1, block_size, index_head_dim]) at the same slots
(`kv_cache.MLAAttentionSpec.index_head_dim`). A layer without an indexer of its own (GLM-5's
`indexer_types` "shared") reuses the selection of the latest layer with one: that layer keeps
it per query batch for the step (`AttentionBatch.store`).
"""

from __future__ import annotations

from typing import Any

import torch

from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.indexer import LightningIndexer
from moe_engine.models.layers.mla import MLAAttention


class SparseMLAAttention(MLAAttention):
    """`MLAAttention` restricted to the indexer's keys.

    Args:
        *args, **kwargs: `MLAAttention`'s (a query LoRA is required: the indexer reads
            q_resid).
        indexer: this layer's `LightningIndexer`, or None to reuse another layer's selection.
        topk_source: decoder index of the layer whose selection this one uses (its own index
            when it has an indexer).

    Raises:
        ValueError: no q_lora_rank, or an indexer whose rope width is not the rotary's.
    """

    def __init__(
        self, *args: Any, indexer: LightningIndexer | None, topk_source: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.q_lora_rank is None:
            raise ValueError("sparse MLA: the lightning indexer needs q_lora_rank (a query LoRA)")
        if indexer is not None and indexer.rope_dim != self.rotary.head_dim:
            raise ValueError(
                f"sparse MLA: indexer rope width {indexer.rope_dim} != qk_rope_head_dim "
                f"{self.rotary.head_dim}"
            )
        self.indexer = indexer
        self.topk_source = topk_source

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """h: [T, H], positions: [T] int64; kv_cache: (latent, indexer keys) of this layer.
        Returns [T, H] in h's dtype."""
        latent, index_keys = kv_cache
        meta = meta.for_group(self.kv_group)
        q_nope, q_pe, q_resid, gate = self.project_and_cache(h, positions, meta, latent)
        key = ("index_topk", self.topk_source)
        if self.indexer is not None:
            q, weights = self.indexer(
                h, q_resid, positions, self.rotary, index_keys, meta.slot_mapping
            )
            for batch in meta.batches:
                rows = slice(batch.token_start, batch.token_end)
                batch.store(key, self.indexer.select(q[rows], weights[rows], index_keys, batch))
        masks = [batch.stored(key) for batch in meta.batches]
        return self.attend_batches(h, q_nope, q_pe, latent, meta, masks, gate)
