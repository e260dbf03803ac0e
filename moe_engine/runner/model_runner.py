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

Devices: the KV cache lives on the engine's device. Each step's small tensors (ids, positions,
query lengths, block tables, slot mappings, gather indices) are built on the host, vectorised;
on a CPU they are used as they are (no copy), on CUDA each is copied once into a persistent
device buffer (`step_inputs.StepInputBuffers`, pinned and non-blocking). The step's one host
sync is the sampler's read-back of the sampled ids (and logprobs, in the same copy).
`profile_run` is the forward that `--gpu-memory-utilization` measures (`moe_engine.startup.memory`).

CUDA graphs (`moe_engine.runner.cuda_graphs`): with `scratch_block=True` the cache holds one more
block (id num_blocks + 1, beyond the pool) for the padding rows of replayed decode graphs;
after `capture_decode_graphs`, decode-only steps that fit the largest captured size replay a
graph (`DecodeGraphs.run`), every other step runs eagerly as above.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from moe_engine.kv_cache import (
    KVCacheGroup,
    KVCacheManager,
    KVCacheSpec,
    MLAAttentionSpec,
    make_kv_cache_groups,
)
from moe_engine.kv_cache.state import MambaSpec
from moe_engine.models import MoeCausalLM
from moe_engine.models.layers.attention import (
    AttentionMetadata,
    KVCacheLayer,
    build_attention_batch,
    build_decode_batch,
)
from moe_engine.models.layers.gated_delta_net import LinearAttentionMetadata
from moe_engine.runner.cuda_graphs import DecodeGraphs, GraphCapture
from moe_engine.runner.sampler import Sampler, StepSamples
from moe_engine.runner.spec_decode.mtp import MTPDrafter
from moe_engine.runner.spec_decode.verify import sample_with_drafts
from moe_engine.runner.step_inputs import StepInputBuffers
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
        device: the engine's device (the model's): the KV cache is allocated there and each
            step's inputs are copied there once (`StepInputBuffers`); default CPU.
        scratch_block: give the cache one more block (`scratch_block` = num_blocks + 1),
            never in the pool, for the padding rows of CUDA-graph decode steps.
        num_speculative_tokens, disable_drafts_at: with MTP layers in the model, the drafts
            per request and step its `MTPDrafter` proposes, and the step size (sampling
            requests) from which it proposes none (0: never off).

    `kv_caches[i]` is layer i's (K, V) pair, each [num_blocks + 1 (+ 1 scratch), block_size,
    num_kv_heads, head_dim], or for an MLA group one latent tensor [num_blocks + 1 (+ 1),
    block_size, kv_lora_rank + qk_rope_head_dim]; layers in the same slot of different groups
    share it.

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
        device: torch.device | str | None = None,
        scratch_block: bool = False,
        num_speculative_tokens: int = 0,
        disable_drafts_at: int = 0,
        num_state_slots: int = 0,
    ) -> None:
        self.model = model
        #: Where the KV cache and the step's tensors live (the model's device).
        self.device = torch.device(device or "cpu")
        #: Persistent device buffers of the step inputs (`StepInputBuffers`: input_ids,
        #: positions, seq_lens, logits_indices, slot_mapping.<g>, block_tables.<g>,
        #: batch.<g>.<i>); None on a CPU, which uses the host tensors as they are.
        self.input_buffers = (
            None if self.device.type == "cpu" else StepInputBuffers(self.device)
        )
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
        #: The padding rows' KV block (beyond the pool's ids 1..num_blocks), or None.
        self.scratch_block = num_blocks + 1 if scratch_block else None
        #: The captured decode graphs (`capture_decode_graphs`), or None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        physical = num_blocks + (1 if scratch_block else 0)
        slots = [
            _allocate_slot(kv_groups[0].spec, physical, kv_dtype, self.device)
            for _ in range(len(kv_groups[0].layers))
        ]
        caches: list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None]
        num_mtp = getattr(spec, "num_mtp_layers", 0)  # an ArchSpec's (a bare ModelShape: 0)
        caches = [None] * (spec.num_layers + num_mtp)
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
        linear = spec.linear_attention_layers()
        #: The linear-attention layers' per-request state (`kv_cache.state`), None without.
        self.state_spec = (
            MambaSpec(linear, *spec.linear_state_shapes(), kv_dtype) if linear else None
        )
        if self.state_spec is not None:
            states = self.state_spec.allocate(num_state_slots, self.device)
            for index, state in zip(linear, states, strict=True):
                caches[index] = state
        missing = [i for i, c in enumerate(caches) if c is None]
        if missing:
            raise ValueError(f"layers {missing} are in no KV cache group")
        self.kv_caches = caches[: spec.num_layers]
        #: The MTP layers' caches (layers num_layers.. of the first group), [] without them.
        self.mtp_kv_caches = caches[spec.num_layers :]
        #: Proposes MTP drafts after each step (`spec_decode.mtp`), None without MTP layers.
        self.mtp = (
            MTPDrafter(self, num_speculative_tokens, disable_drafts_at)
            if num_mtp else None
        )

    def reserve_inputs(self, max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Size the persistent input buffers for the largest step up front, so that their
        addresses never change (what a CUDA-graph capture relies on); no-op on a CPU.

        Args:
            max_num_tokens: tokens per step (max_num_batched_tokens); max_num_seqs: requests
                per step; max_model_len: longest request (tokens), bounding a block table.
        """
        buffers = self.input_buffers
        if buffers is None:
            return
        width = -(-max_model_len // self.block_size)
        for name in ("input_ids", "positions", "logits_indices"):
            buffers.reserve(name, max_num_tokens)
        buffers.reserve("seq_lens", max_num_seqs)
        for g in range(len(self.kv_groups)):
            buffers.reserve(f"slot_mapping.{g}", max_num_tokens)
            buffers.reserve(f"block_tables.{g}", max_num_seqs * width)

    def capture_decode_graphs(
        self, sizes: list[int], max_model_len: int, capture: GraphCapture
    ) -> DecodeGraphs:
        """Capture decode graphs at these batch sizes (`cuda_graphs.capture_sizes`); from now
        on decode-only steps of at most max(sizes) requests replay them.

        Raises:
            ValueError: the runner was made without a scratch block.
        """
        graphs = DecodeGraphs(self, sizes, max_model_len)
        graphs.capture(capture)
        self.decode_graphs = graphs
        return graphs

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[ScheduledRequest], StepSamples]:
        """Run one step.

        Returns:
            (the scheduled requests that sampled a token, in row order; per request the
            tokens it emits: one, or with drafts the accepted ones and one more).
        """
        # stable: decodes first, then draft verifications, then prefill chunks
        ordered = sorted(out.scheduled, key=_row_kind)
        ids: list[int] = []
        for s in ordered:
            fed = s.num_tokens - len(s.draft_token_ids)
            ids.extend(s.request.all_token_ids[s.start : s.start + fed])
            ids.extend(s.draft_token_ids)
        q_lens = torch.tensor([s.num_tokens for s in ordered], dtype=torch.int64)
        start_list = [s.start for s in ordered]
        starts = torch.tensor(start_list, dtype=torch.int64)
        tables = [
            [kv.block_table(s.request.request_id, g) for s in ordered]
            for g in range(len(self.kv_groups))
        ]
        sampling = [i for i, s in enumerate(ordered) if s.samples]
        logits_indices = _logits_indices(q_lens, [ordered[i] for i in sampling], sampling)
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers([s.num_tokens for s in ordered]):
            hidden, logits_indices = graphs.run(ids, starts, tables, logits_indices)
        else:
            if len(ids) == len(ordered):  # decodes only: one token per request
                step = self._decode_host_inputs(ids, start_list, tables)
            elif any(s.draft_token_ids for s in ordered):
                step = self._verify_host_inputs(ids, ordered, tables)
            else:
                step = self._host_inputs(ids, q_lens, starts, tables)
            input_ids, positions, meta, logits_indices = self._on_device(step, logits_indices)
            if self.state_spec is not None:
                meta.linear = LinearAttentionMetadata.of(
                    [kv.state_slot(s.request.request_id) for s in ordered],
                    [s.num_tokens for s in ordered], start_list,
                )
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        rows = [ordered[i] for i in sampling]
        samples = StepSamples([], [], [])
        if rows:
            logits = self.model.compute_logits(hidden[logits_indices])
            if not any(s.draft_token_ids for s in rows):
                samples = StepSamples.of(self.sampler(logits, [s.request for s in rows]))
            else:
                samples = sample_with_drafts(self.sampler, logits, rows)
        if self.mtp is not None:
            emitted = {s.request.request_id: t for s, t in zip(rows, samples.token_ids,
                                                               strict=True)}
            samples.proposals = self.mtp.propose(ordered, hidden, emitted, tables, rows)
        return rows, samples

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """One forward at the largest step, for the activation peak (`memory.
        profile_activation_peak`): `num_tokens` tokens as prefill chunks of at most
        `max_model_len`, each ending at position max_model_len - 1 (the longest keys), whose
        block tables hold only the null block; then the logits of min(max_num_seqs,
        num_tokens) rows and their log-softmax (the sampler's share).

        Leaves nothing behind: no KVCacheManager is involved, the null block it wrote is
        zeroed again, the MoE layers' load recorders are detached meanwhile and the
        communicator's counters restored.
        """
        chunk = min(num_tokens, max_model_len)
        chunks = [chunk] * (num_tokens // chunk)
        if num_tokens % chunk:
            chunks.append(num_tokens % chunk)
        chunks.sort(key=lambda n: n > 1)  # a one-token remainder is a decode: first
        q_lens = torch.tensor(chunks, dtype=torch.int64)
        starts = max_model_len - q_lens
        width = -(-max_model_len // self.block_size)
        tables = [[[0] * width for _ in chunks] for _ in self.kv_groups]
        step = self._host_inputs([0] * num_tokens, q_lens, starts, tables)
        logits_indices = torch.arange(min(max_num_seqs, num_tokens), dtype=torch.int64)
        with _quiet_moe_layers(self.model):
            input_ids, positions, meta, logits_indices = self._on_device(step, logits_indices)
            if self.state_spec is not None:  # every chunk on the null slot, zeroed below
                zeros = [0] * len(chunks)
                meta.linear = LinearAttentionMetadata.of(zeros, chunks, zeros)
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            self.model.compute_logits(hidden[logits_indices]).log_softmax(dim=-1)
        for cache in self.kv_caches:
            for t in (cache,) if isinstance(cache, torch.Tensor) else cache:
                t[0].zero_()  # the null block stays all-zero

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A zero-token step for a rank with nothing scheduled under expert parallelism: each
        MoE layer still joins its dispatch and combine (and runs its experts on the tokens
        other ranks send), so every all-to-all has all its participants (DESIGN.md section 1).
        """
        spec = self.model.spec
        dtype = self.model.model.embed_tokens.weight.dtype
        empty = torch.empty(0, spec.hidden_size, dtype=dtype, device=self.device)
        for _, moe in self.model.moe_layers():
            moe(empty)

    def _host_inputs(
        self,
        ids: list[int],
        q_lens: torch.Tensor,
        starts: torch.Tensor,
        tables: list[list[list[int]]],
    ) -> _HostStep:
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
        return _HostStep(
            torch.tensor(ids, dtype=torch.int64), positions, metas, block_tables, starts + q_lens
        )

    def _decode_host_inputs(
        self, ids: list[int], starts: list[int], tables: list[list[list[int]]]
    ) -> _HostStep:
        """`_host_inputs` of a step of decodes only, from plain ints (each request's one token
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
        return _HostStep(torch.tensor(ids, dtype=torch.int64), positions, metas, block_tables,
                         positions + 1)

    def _verify_host_inputs(
        self, ids: list[int], ordered: list[ScheduledRequest], tables: list[list[list[int]]]
    ) -> _HostStep:
        """`_host_inputs` of a step with draft verifications (each verifying request feeds its
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
            return self._decode_host_inputs(ids, starts, row_tables)
        return self._host_inputs(ids, torch.tensor(q_lens, dtype=torch.int64),
                                 torch.tensor(starts, dtype=torch.int64), row_tables)

    def _on_device(
        self, step: _HostStep, logits_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logits_indices) on the engine's device:
        the host tensors themselves on a CPU; on CUDA copies into the persistent buffers
        (`StepInputBuffers`), asynchronously, without a host sync."""
        buffers = self.input_buffers
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
            batches.append(replace(
                b, tok_b=tok_b, tok_q=tok_q, block_ids=block_ids, q_pos=q_pos,
                block_tables=tables[rows], seq_lens=seq_lens[rows],
                query_start_loc=query_start_loc, _masks={},
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
class _HostStep:
    """One step's inputs built on the host (`ModelRunner._host_inputs`).

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


def _row_kind(s: ScheduledRequest) -> int:
    """A scheduled request's place in the step's rows: 0 one-token decodes, 1 draft
    verifications, 2 prefill chunks."""
    if s.num_tokens == 1:
        return 0
    return 1 if s.draft_token_ids else 2


def _logits_indices(
    q_lens: torch.Tensor, rows: list[ScheduledRequest], sampling: list[int]
) -> torch.Tensor:
    """[sum over `rows` of 1 + drafts] int64: the token positions whose logits are needed, per
    sampling row its last token's, or with drafts its last 1 + drafts tokens' (the real
    token's, then each draft's), in row order.

    Args:
        q_lens: [B] int64 tokens per scheduled request; sampling: the rows that sample.
    """
    ends = torch.cumsum(q_lens, 0)[sampling] - 1
    counts = torch.tensor([1 + len(s.draft_token_ids) for s in rows], dtype=torch.int64)
    if int(counts.sum()) == len(rows):
        return ends
    last = torch.repeat_interleave(ends, counts)
    back = torch.repeat_interleave(torch.cumsum(counts, 0), counts) - 1
    return last - (back - torch.arange(len(last)))


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


@contextmanager
def _quiet_moe_layers(model: MoeCausalLM) -> Iterator[None]:
    """Detach the MoE layers' load recorders and keep the communicators' counters as they
    were, for a forward that serves no request (the profile run)."""
    layers = [moe for _, moe in model.moe_layers()]
    recorders = [moe.load_recorder for moe in layers]
    stats = [getattr(moe.communicator, "stats", None) for moe in layers]
    saved = [(s.last.copy(), s.total.copy()) if s is not None else None for s in stats]
    for moe in layers:
        moe.load_recorder = None
    try:
        yield
    finally:
        for moe, recorder in zip(layers, recorders, strict=True):
            moe.load_recorder = recorder
        for s, kept in zip(stats, saved, strict=True):
            if s is not None and kept is not None:
                s.last, s.total = kept


def _allocate_slot(
    spec: KVCacheSpec, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """One layer slot's zeroed cache on `device`: a (K, V) pair of [num_blocks + 1,
    block_size, num_kv_heads, head_dim], or for MLA one latent tensor [num_blocks + 1,
    block_size, latent_dim] (block 0 the null block; num_blocks counts a scratch block)."""
    if isinstance(spec, MLAAttentionSpec):
        shape: tuple[int, ...] = (num_blocks + 1, spec.block_size, spec.latent_dim)
        return torch.zeros(shape, dtype=dtype, device=device)
    shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return (
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
    )


def _kv_cache_layer(model: MoeCausalLM, index: int) -> KVCacheLayer:
    """The one KV-cache-owning module (`PagedAttention`, `MLAAttention`) of decoder layer
    `index` (num_layers + j: MTP layer j).

    Raises:
        ValueError: when the layer has none or several.
    """
    num_layers = len(model.model.layers)
    layers = model.model.layers
    layer = layers[index] if index < num_layers else model.mtp_layers[index - num_layers]
    found = [m for m in layer.modules() if isinstance(m, KVCacheLayer)]
    if len(found) != 1:
        raise ValueError(f"layer {index} has {len(found)} KV cache attention modules, expected 1")
    return found[0]
