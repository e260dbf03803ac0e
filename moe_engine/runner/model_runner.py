"""ModelRunner: turns a `SchedulerOutput` into flat batch tensors, runs the model, samples.

Tokens are laid out requests-contiguous, single-token queries (decodes) first, then prefill
chunks, so attention can treat each kind as one batch (see models/layers/attention.py).

KV-cache groups (kv_cache/spec.py): every group has its own block tables, slot mapping and
attention batches (`AttentionMetadata.groups`); each layer reads its group's
(`KVCacheLayer.kv_group`). Layer `group.layers[j]` of every group uses the same cache tensor
pair `j`, so the cache holds (layers per group) pairs of [num_blocks + 1, block_size,
num_kv_heads, head_dim] tensors, block 0 being the null block; MLA groups (`MLAAttentionSpec`)
hold one latent tensor [num_blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim] per slot
instead of a pair (with DeepSeek Sparse Attention, the latent and the indexer keys).

Devices: the KV cache lives on the engine's device. Each step's small tensors (ids, positions,
query lengths, block tables, slot mappings, gather indices) are built on the host, vectorised;
on a CPU they are used as they are (no copy), on CUDA each is copied once into a persistent
device buffer (`step_inputs.StepInputBuffers`, pinned and non-blocking). The step's one host
sync is the sampler's read-back of the sampled ids (and logprobs, in the same copy).
`profile_run` is the forward that `--gpu-memory-utilization` measures (`moe_engine.startup.memory`).

Expert parallelism: every forward of a step (`execute`, `execute_idle`, `profile_run`) starts
with `Communicator.begin_step(num_tokens)` on the MoE layers' communicator, once per step on
every rank: the ranks agree there, with one host-side all-reduce, on the step's largest token
count, which sizes the fixed-capacity all-to-all and picks DeepEP's kernels, so the dispatches
and combines of the step's layers read nothing back to the host (`comm.step_sync`).

CUDA graphs (`moe_engine.runner.cuda_graphs`): with `scratch_block=True` the cache holds one more
block (id num_blocks + 1, beyond the pool) for the padding rows of replayed decode graphs;
after `capture_decode_graphs`, decode-only steps that fit the largest captured size replay a
graph (`DecodeGraphs.run`), every other step runs eagerly as above.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from comm.base import Communicator
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
    KVCacheLayer,
)
from moe_engine.models.layers.gated_delta_net import LinearAttentionMetadata
from moe_engine.runner.cuda_graphs import DecodeGraphs, GraphCapture, GraphTarget
from moe_engine.runner.inputs import StepInputBuilder
from moe_engine.runner.routed_experts import RoutingReplay
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
        #: Builds each step's input tensors (`inputs.StepInputBuilder`).
        self.inputs = StepInputBuilder(self.device, block_size)
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
                index_head_dim=spec.index_head_dim,
            )
        self.kv_groups = kv_groups
        #: The MoE layers' communicators, each once (`begin_step` at every step).
        self.communicators = _communicators(model)
        #: The padding rows' KV block (beyond the pool's ids 1..num_blocks), or None.
        self.scratch_block = num_blocks + 1 if scratch_block else None
        #: The captured decode graphs (`capture_decode_graphs`), or None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        #: Routing replay (`--enable-return-routed-experts`, `runner.routed_experts`): set by
        #: the build before graphs are captured; None: off.
        self.routing_replay: RoutingReplay | None = None
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
                if attn.attention_chunk_size != group.spec.attention_chunk_size:
                    raise ValueError(
                        f"layer {index}: attention chunk {attn.attention_chunk_size}, but its "
                        f"KV cache group {g} has chunk {group.spec.attention_chunk_size}"
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
            MTPDrafter(
                self.model,
                self.inputs,
                self.mtp_kv_caches[0],
                num_speculative_tokens,
                disable_drafts_at,
            )
            if num_mtp
            else None
        )

    @property
    def input_buffers(self) -> StepInputBuffers | None:
        """The persistent device buffers of the step inputs (`StepInputBuilder.buffers`);
        None on a CPU."""
        return self.inputs.buffers

    @input_buffers.setter
    def input_buffers(self, buffers: StepInputBuffers | None) -> None:
        self.inputs.buffers = buffers

    def reserve_inputs(self, max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Size the persistent input buffers for the largest step up front, so that their
        addresses never change (what a CUDA-graph capture relies on); no-op on a CPU
        (`StepInputBuilder.reserve`)."""
        self.inputs.reserve(max_num_tokens, max_num_seqs, max_model_len, len(self.kv_groups))

    def capture_decode_graphs(
        self, sizes: list[int], max_model_len: int, capture: GraphCapture
    ) -> DecodeGraphs:
        """Capture decode graphs at these batch sizes (`cuda_graphs.capture_sizes`); from now
        on decode-only steps of at most max(sizes) requests replay them.

        Raises:
            ValueError: the runner was made without a scratch block.
        """
        target = GraphTarget(
            self.model,
            self.kv_caches,
            len(self.kv_groups),
            self.device,
            self.block_size,
            self.scratch_block,
        )
        graphs = DecodeGraphs(target, sizes, max_model_len)
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
        self.begin_step(len(ids))
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers([s.num_tokens for s in ordered]):
            hidden, logits_indices = graphs.run(ids, starts, tables, logits_indices)
        else:
            if len(ids) == len(ordered):  # decodes only: one token per request
                step = self.inputs.decode_host_inputs(ids, start_list, tables)
            elif any(s.draft_token_ids for s in ordered):
                step = self.inputs.verify_host_inputs(ids, ordered, tables)
            else:
                step = self.inputs.host_inputs(ids, q_lens, starts, tables)
            input_ids, positions, meta, logits_indices = self.inputs.on_device(step, logits_indices)
            if self.state_spec is not None:
                meta.linear = LinearAttentionMetadata.of(
                    [kv.state_slot(s.request.request_id) for s in ordered],
                    [s.num_tokens for s in ordered],
                    start_list,
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
            emitted = {
                s.request.request_id: t for s, t in zip(rows, samples.token_ids, strict=True)
            }
            samples.proposals = self.mtp.propose(ordered, hidden, emitted, tables, rows)
        if self.routing_replay is not None:  # after the sampler's sync: the copy does not wait
            self.routing_replay.store_step(ordered, tables)
        return rows, samples

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """The forwards of the largest steps, for the activation peak (`memory.
        profile_activation_peak` measures the peak over all of them):

        1. `num_tokens` tokens as prefill chunks of at most `max_model_len`, each ending at
           position max_model_len - 1 (the longest keys), whose block tables hold only the null
           block; then the logits of min(max_num_seqs, num_tokens) rows and their log-softmax
           (the sampler's share);
        2. the largest decode step, min(max_num_seqs, num_tokens) one-token requests at
           position max_model_len - 1, and every smaller decode size at which a communicator
           takes another path with other buffers (`Communicator.profile_token_counts`, e.g.
           DeepEP's low-latency kernels, whose receive buffer and expert rows a prefill-sized
           step never allocates); each with its logits and log-softmax.

        Every rank of an expert-parallel group runs the same forwards (`begin_step` first).
        Leaves nothing behind: no KVCacheManager is involved, the null block it wrote is
        zeroed again, the MoE layers' load recorders are detached meanwhile and the
        communicator's counters restored.
        """
        chunk = min(num_tokens, max_model_len)
        chunks = [chunk] * (num_tokens // chunk)
        if num_tokens % chunk:
            chunks.append(num_tokens % chunk)
        chunks.sort(key=lambda n: n > 1)  # a one-token remainder is a decode: first
        width = -(-max_model_len // self.block_size)
        decode = min(max_num_seqs, num_tokens)
        sizes = {decode}.union(*(c.profile_token_counts(decode) for c in self.communicators))
        with _quiet_moe_layers(self.model):
            self._profile_forward(chunks, max_model_len, width, min(max_num_seqs, num_tokens))
            for size in sorted(sizes, reverse=True):
                self._profile_forward([1] * size, max_model_len, width, size)
        for cache in self.kv_caches:
            for t in (cache,) if isinstance(cache, torch.Tensor) else cache:
                t[0].zero_()  # the null block stays all-zero

    @torch.inference_mode()
    def dummy_run(self, q_lens: Sequence[int], context_len: int, num_logits: int) -> None:
        """One forward of requests of `q_lens` tokens each, every one ending at position
        `context_len` - 1 over block tables of the null block only, then `num_logits` rows of
        logits and their log-softmax (the kernel warm-up's step, `runner.warmup`). Leaves
        nothing behind, as `profile_run`; every rank of an expert-parallel group must run the
        same ones (`begin_step`).

        Args:
            q_lens: tokens per request, each <= context_len (all 1: a decode step).
            context_len: keys per request (tokens).
            num_logits: rows that sample (<= sum(q_lens)).
        """
        width = -(-context_len // self.block_size)
        with _quiet_moe_layers(self.model):
            self._profile_forward(sorted(q_lens, key=lambda n: n > 1), context_len, width,
                                  num_logits)  # fmt: skip
        for cache in self.kv_caches:
            for t in (cache,) if isinstance(cache, torch.Tensor) else cache:
                t[0].zero_()  # the null block stays all-zero

    def _profile_forward(
        self, q_lens: list[int], max_model_len: int, width: int, num_logits: int
    ) -> None:
        """One profile forward: requests of `q_lens` tokens ending at max_model_len - 1 on
        null-block tables `width` blocks wide, then `num_logits` rows of logits and their
        log-softmax."""
        lens = torch.tensor(q_lens, dtype=torch.int64)
        starts = max_model_len - lens
        tables = [[[0] * width for _ in q_lens] for _ in self.kv_groups]
        num_tokens = int(lens.sum())
        if num_tokens == len(q_lens):
            step = self.inputs.decode_host_inputs([0] * num_tokens, starts.tolist(), tables)
        else:
            step = self.inputs.host_inputs([0] * num_tokens, lens, starts, tables)
        logits_indices = torch.arange(num_logits, dtype=torch.int64)
        self.begin_step(num_tokens)
        input_ids, positions, meta, logits_indices = self.inputs.on_device(step, logits_indices)
        if self.state_spec is not None:  # every request on the null slot, zeroed afterwards
            zeros = [0] * len(q_lens)
            meta.linear = LinearAttentionMetadata.of(zeros, q_lens, zeros)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        self.model.compute_logits(hidden[logits_indices]).log_softmax(dim=-1)

    def begin_step(self, num_tokens: int) -> None:
        """Tell every communicator that a forward of `num_tokens` tokens on this rank follows
        (`Communicator.begin_step`; under expert parallelism every rank calls it once per
        step, a rank with nothing to run with 0)."""
        for communicator in self.communicators:
            communicator.begin_step(num_tokens)

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A zero-token step for a rank with nothing scheduled under expert parallelism: each
        MoE layer still joins its dispatch and combine (and runs its experts on the tokens
        other ranks send), so every all-to-all has all its participants (DESIGN.md section 1).
        """
        spec = self.model.spec
        dtype = self.model.model.embed_tokens.weight.dtype
        empty = torch.empty(0, spec.hidden_size, dtype=dtype, device=self.device)
        self.begin_step(0)
        for _, moe in self.model.moe_layers():
            moe(empty)


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


def _communicators(model: MoeCausalLM) -> list[Communicator]:
    """The distinct communicators of the model's MoE layers, in layer order (one under expert
    parallelism: every layer shares the rank's)."""
    found: dict[int, Communicator] = {}
    for _, moe in model.moe_layers():
        found.setdefault(id(moe.communicator), moe.communicator)
    return list(found.values())


@contextmanager
def _quiet_moe_layers(model: MoeCausalLM) -> Iterator[None]:
    """Detach the MoE layers' load recorders and routing-replay captures and keep the
    communicators' counters as they were, for a forward that serves no request (the profile
    run)."""
    layers = [moe for _, moe in model.moe_layers()]
    recorders = [moe.load_recorder for moe in layers]
    captures = [(moe.routed_capture, moe.routed_row) for moe in layers]
    stats = [getattr(moe.communicator, "stats", None) for moe in layers]
    saved = [(s.last.copy(), s.total.copy()) if s is not None else None for s in stats]
    for moe in layers:
        moe.load_recorder = None
        moe.attach_routed_capture(None)
    try:
        yield
    finally:
        for moe, recorder, (capture, row) in zip(layers, recorders, captures, strict=True):
            moe.load_recorder = recorder
            moe.attach_routed_capture(capture, row)
        for s, kept in zip(stats, saved, strict=True):
            if s is not None and kept is not None:
                s.last, s.total = kept


def _allocate_slot(
    spec: KVCacheSpec, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """One layer slot's zeroed cache on `device`: a (K, V) pair of [num_blocks + 1,
    block_size, num_kv_heads, head_dim], or for MLA one latent tensor [num_blocks + 1,
    block_size, latent_dim], with indexer keys (`index_head_dim`) the pair (latent, indexer keys
    [num_blocks + 1, block_size, index_head_dim]) at the same slots (block 0 the null block;
    num_blocks counts a scratch block)."""
    if isinstance(spec, MLAAttentionSpec):
        shape: tuple[int, ...] = (num_blocks + 1, spec.block_size, spec.latent_dim)
        latent = torch.zeros(shape, dtype=dtype, device=device)
        if not spec.index_head_dim:
            return latent
        keys = (num_blocks + 1, spec.block_size, spec.index_head_dim)
        return latent, torch.zeros(keys, dtype=dtype, device=device)
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
