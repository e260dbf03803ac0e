"""The step-input builder: one step's flat tensors from its scheduled requests' token ids,
positions and block tables (host side, vectorised), then on the engine's device.

Tokens are laid out requests-contiguous, single-token queries (decodes) first, then prefill
chunks. Every KV-cache group gets its own block tables, slot mapping and attention batches
(`AttentionMetadata.groups`). On a CPU the host tensors are used as they are; on CUDA each is
copied once into a persistent device buffer (`step_inputs.StepInputBuffers`, pinned and
non-blocking), so a step's inputs cost no host sync.

`ModelRunner` builds its steps with it; the MTP drafter (`spec_decode.mtp`) and the CUDA-graph
runner use the same public methods rather than the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine.models.layers.attention import (
    AttentionMetadata,
    build_attention_batch,
    build_decode_batch,
)
from moe_engine.runner.step_inputs import StepInputBuffers
from moe_engine.scheduler import ScheduledRequest


class StepInputBuilder:
    """Builds each step's inputs (`host_inputs` and its decode/verify variants, then
    `on_device`).

    Args:
        device: the engine's device; on CUDA the inputs go through persistent buffers.
        block_size: tokens per KV block.

    Attributes:
        buffers: the persistent device buffers of the step inputs (`StepInputBuffers`:
            input_ids, positions, seq_lens, logits_indices, slot_mapping.<g>,
            block_tables.<g>, batch.<g>.<i>); None on a CPU, which uses the host tensors.
    """

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.block_size = block_size
        self.buffers: StepInputBuffers | None = (
            None if device.type == "cpu" else StepInputBuffers(device)
        )

    def reserve(
        self, max_num_tokens: int, max_num_seqs: int, max_model_len: int, num_groups: int
    ) -> None:
        """Size the persistent input buffers for the largest step up front, so that their
        addresses never change (what a CUDA-graph capture relies on); no-op on a CPU.

        Args:
            max_num_tokens: tokens per step (max_num_batched_tokens); max_num_seqs: requests
                per step; max_model_len: longest request (tokens), bounding a block table;
                num_groups: KV-cache groups.
        """
        buffers = self.buffers
        if buffers is None:
            return
        width = -(-max_model_len // self.block_size)
        for name in ("input_ids", "positions", "logits_indices"):
            buffers.reserve(name, max_num_tokens)
        buffers.reserve("seq_lens", max_num_seqs)
        for g in range(num_groups):
            buffers.reserve(f"slot_mapping.{g}", max_num_tokens)
            buffers.reserve(f"block_tables.{g}", max_num_seqs * width)

    def host_inputs(
        self,
        ids: list[int],
        q_lens: torch.Tensor,
        starts: torch.Tensor,
        tables: list[list[list[int]]],
    ) -> HostStep:
        """One step's inputs on the host, vectorised over the requests.

        Args:
            ids: the step's token ids, requests-contiguous, decodes first.
            q_lens, starts: [B] int64 tokens fed and tokens already cached per request.
            tables: per KV-cache group, each request's block ids.
        """
        row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        offsets = torch.cumsum(q_lens, 0) - q_lens
        positions = starts[row] + torch.arange(len(ids)) - offsets[row]
        num_decodes = int((q_lens == 1).sum())
        block_tables = [_pad_tables(t) for t in tables]
        metas = [
            self._group_metadata(bt, q_lens, starts, row, positions, num_decodes)
            for bt in block_tables
        ]
        return HostStep(
            torch.tensor(ids, dtype=torch.int64), positions, metas, block_tables, starts + q_lens
        )

    def decode_host_inputs(
        self, ids: list[int], starts: list[int], tables: list[list[list[int]]]
    ) -> HostStep:
        """`host_inputs` of a step of decodes only, from plain ints (each request's one token
        sits at position `starts[i]`): the same tensors in fewer ops."""
        bs = self.block_size
        positions = torch.tensor(starts, dtype=torch.int64)
        block_tables = [_pad_tables(t) for t in tables]
        metas = []
        for table, padded in zip(tables, block_tables, strict=True):
            slots = [(row[p // bs] if p // bs < len(row) else 0) * bs + p % bs  # as padded
                     for row, p in zip(table, starts, strict=True)]
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                batches=[build_decode_batch(starts, padded, bs)],
            ))
        return HostStep(torch.tensor(ids, dtype=torch.int64), positions, metas, block_tables,
                         positions + 1)

    def verify_host_inputs(
        self, ids: list[int], ordered: list[ScheduledRequest], tables: list[list[list[int]]]
    ) -> HostStep:
        """`host_inputs` of a step with draft verifications (each verifying request feeds its
        one real token and its drafts; `ordered` has them after the decodes and before any
        prefill chunk): every verified token becomes its own decode row over its request's
        block table, with keys up to its own position. All rows' keys and values are written
        before any row attends (the module path and the native decode layer both write the
        step's slot mapping first), so row j of a request sees the real token and drafts
        1..j: the causal attention of a (1 + k)-token query, computed by the decode kernels a
        decode step uses (in bfloat16 the native decode layer when no prefill chunk shares the
        step), which keeps a verified token's logits those of the same token decoded one step
        at a time. Prefill chunks stay one row each, in the prefill batch.

        Attention layers only: a layer with per-request recurrent state (linear attention)
        would need the request's tokens as one row.
        """
        q_lens, starts, row_of = [], [], []
        for i, s in enumerate(ordered):
            rows = s.num_tokens if s.draft_token_ids else 1
            q_lens += [1] * rows if s.draft_token_ids else [s.num_tokens]
            starts += [s.start + j for j in range(rows)]
            row_of += [i] * rows
        row_tables = [[group[i] for i in row_of] for group in tables]
        if len(q_lens) == len(ids):
            return self.decode_host_inputs(ids, starts, row_tables)
        return self.host_inputs(ids, torch.tensor(q_lens, dtype=torch.int64),
                                 torch.tensor(starts, dtype=torch.int64), row_tables)

    def on_device(
        self, step: HostStep, logits_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logits_indices) on the engine's device:
        the host tensors themselves on a CPU; on CUDA copies into the persistent buffers
        (`StepInputBuffers`), asynchronously, without a host sync."""
        buffers = self.buffers
        if buffers is None:
            return step.input_ids, step.positions, _combined(step.metas), logits_indices
        buffers.begin_step()
        input_ids = buffers.put("input_ids", step.input_ids)
        positions = buffers.put("positions", step.positions)
        logits_indices = buffers.put("logits_indices", logits_indices)
        seq_lens = buffers.put("seq_lens", step.seq_lens)
        metas = [
            self._group_to_device(buffers, g, meta, step.block_tables[g], seq_lens)
            for g, meta in enumerate(step.metas)
        ]
        buffers.end_step()
        return input_ids, positions, _combined(metas), logits_indices

    @staticmethod
    def _group_to_device(
        buffers: StepInputBuffers,
        group: int,
        meta: AttentionMetadata,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> AttentionMetadata:
        """One group's host metadata as device tensors: slot mapping and block tables in
        their persistent buffers, each batch's gather indices through one copy."""
        slot_mapping = buffers.put(f"slot_mapping.{group}", meta.slot_mapping)
        tables = buffers.put(f"block_tables.{group}", block_tables)
        batches, row = [], 0
        for i, b in enumerate(meta.batches):
            rows = slice(row, row + b.seq_lens.numel())
            row = rows.stop
            tok_b, tok_q, block_ids, q_pos, query_start_loc = buffers.put_many(
                f"batch.{group}.{i}", [b.tok_b, b.tok_q, b.block_ids, b.q_pos, b.query_start_loc]
            )
            batches.append(b.with_tensors(
                tok_b=tok_b, tok_q=tok_q, block_ids=block_ids, q_pos=q_pos,
                block_tables=tables[rows], seq_lens=seq_lens[rows],
                query_start_loc=query_start_loc,
            ))
        return AttentionMetadata(slot_mapping=slot_mapping, batches=batches)

    def _group_metadata(
        self,
        block_tables: torch.Tensor,
        q_lens: torch.Tensor,
        starts: torch.Tensor,
        row: torch.Tensor,
        positions: torch.Tensor,
        num_decodes: int,
    ) -> AttentionMetadata:
        """One KV-cache group's slot mapping and attention batches (host tensors).

        Args:
            block_tables: [B, max_blocks] int64, padded with the null block 0.
        """
        slot_mapping = (
            block_tables[row, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        batches = []
        for rows in (slice(0, num_decodes), slice(num_decodes, len(q_lens))):
            if rows.stop > rows.start:
                batches.append(
                    build_attention_batch(
                        rows.start,  # decodes are one token each
                        q_lens[rows],
                        starts[rows],
                        block_tables[rows],
                        self.block_size,
                    )
                )
        return AttentionMetadata(slot_mapping=slot_mapping, batches=batches)


@dataclass
class HostStep:
    """One step's inputs built on the host (`StepInputBuilder.host_inputs`).

    Attributes:
        input_ids, positions: [T] int64.
        metas: per KV-cache group, its attention metadata (host tensors).
        block_tables: per group [B, max_blocks] int64 (null-block padded).
        seq_lens: [B] int64 keys per request after the step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]
    block_tables: list[torch.Tensor]
    seq_lens: torch.Tensor


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables [B, width] int64, each row padded with the null block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _combined(metas: list[AttentionMetadata]) -> AttentionMetadata:
    """The step's metadata: group 0's, carrying every group's when there are several."""
    meta = metas[0]
    if len(metas) > 1:
        meta = AttentionMetadata(meta.slot_mapping, meta.batches, groups=metas)
    return meta
