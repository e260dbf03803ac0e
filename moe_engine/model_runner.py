"""ModelRunner: turns a `SchedulerOutput` into flat batch tensors, runs the model, samples.

Tokens are laid out requests-contiguous, single-token queries (decodes) first, then prefill
chunks, so attention can treat each kind as one batch (see models/layers/attention.py).
"""

from __future__ import annotations

import torch

from moe_engine.kv_cache import KVCacheManager
from moe_engine.models import MoeCausalLM
from moe_engine.models.layers.attention import AttentionMetadata, build_attention_batch
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.sampler import Sampler, SamplerOutput
from moe_engine.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler.

    Args:
        model: the loaded model.
        num_blocks: KV blocks in the pool; block_size: tokens per block.
        kv_dtype: cache element type.
        sampler: picks the tokens.

    The cache is one pair of [num_blocks, block_size, num_kv_heads, head_dim] tensors per layer.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        spec = model.spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
            for _ in range(spec.num_layers)
        ]

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
        for layer in self.model.model.layers:
            if isinstance(layer.mlp, FusedMoE):
                layer.mlp(empty)

    def _prepare(
        self, ordered: list[ScheduledRequest], kv: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        for s in ordered:
            ids.extend(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        q_lens = torch.tensor([s.num_tokens for s in ordered], dtype=torch.int64)
        starts = torch.tensor([s.start for s in ordered], dtype=torch.int64)
        tables = [kv.block_table(s.request.request_id) for s in ordered]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(ordered)), q_lens)
        offsets = torch.cumsum(q_lens, 0) - q_lens
        positions = starts[row] + torch.arange(len(ids)) - offsets[row]
        slot_mapping = (
            block_tables[row, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        num_decodes = int((q_lens == 1).sum())
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
        meta = AttentionMetadata(slot_mapping=slot_mapping, batches=batches)
        return torch.tensor(ids, dtype=torch.int64), positions, meta
