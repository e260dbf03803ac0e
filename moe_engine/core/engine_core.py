"""EngineCore: one rank's synchronous loop (schedule -> execute -> sample -> update -> outputs).

Startup order (DESIGN.md section 10): the architecture from config.json, the kernel backends
(kernels/registry.py; the native CPU kernels built once, then cached), config arithmetic
(`plan.py`, fails fast with numbers), then weights with a progress bar, then the KV cache.
Each phase is told to the `progress` callback, which the core process forwards to the front end
as StartupProgress (what health and UNAVAILABLE messages say while it starts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moe_engine.core.detokenizer import IncrementalDetokenizer
from moe_engine.core.device import engine_device, kv_groups_of, plan_kv_on_device
from moe_engine.core.outputs import (
    CoreStats,
    EngineCoreOutput,
    ExpertLoad,
    KVCacheGroupStats,
    ModelInfo,
)
from moe_engine.core.parallel_sampling import ParentRequest
from moe_engine.core.tokenizer import load_tokenizer
from moe_engine.core.validation import validate_request
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.instrumentation import ExpertLoadRecorder, balancedness, imbalance_ratio
from moe_engine.kv_cache import KVCacheManager
from moe_engine.kv_cache.state import StateSlotPool
from moe_engine.models import resolve_quant_config
from moe_engine.models.build import build_model, sizes_kv_on_device
from moe_engine.phase_timer import PhaseTimer
from moe_engine.request import FinishReason, Request
from moe_engine.runner.cuda_graphs import (
    CudaGraphCapture,
    GraphCapture,
    capture_sizes,
    graphs_off_reason,
)
from moe_engine.runner.model_runner import ModelRunner
from moe_engine.runner.sampler import Sampler
from moe_engine.runner.spec_decode.drafter import Drafter
from moe_engine.sampling_params import OUTPUT_FINAL_ONLY, SamplingParams
from moe_engine.scheduler import Scheduler
from moe_engine.skew.trace import PeriodicTraceWriter
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.env import default_threads
from moe_engine.startup.memory import cuda_device_memory
from moe_engine.startup.progress import StartupProgressFn
from moe_engine.startup.rank_context import RankContext
from moe_engine.structured_output import StructuredOutputManager
from moe_engine.weight_update.control import RolloutControl
from quant.compressed_tensors import parse_quantization_config
from quant.fp8 import parse_fp8_config
from quant.mxfp4 import MXFP4_BLOCK_SIZE

logger = logging.getLogger(__name__)


def eos_token_ids_of(model_dir: str, hf_config) -> frozenset[int]:
    """EOS ids from generation_config.json (preferred) or config.json; int or list accepted."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    sources = [getattr(hf_config, "eos_token_id", None)]
    if gen.is_file():
        import json

        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


@dataclass
class StepRecord:
    """One step's routing and timing, for the expert trace (`moe_engine.skew.trace`).

    Attributes:
        counts: [num_moe_layers, num_experts] int64 token-expert pairs routed by this rank.
        rank_tokens: [num_moe_layers, ep_size] int64, this rank's column only: the token-expert
            pairs its experts processed (the sum over ranks is every rank's expert load);
            None for one rank.
        step_time_s: the step's wall time (seconds); num_tokens: tokens it ran.
    """

    counts: torch.Tensor
    rank_tokens: torch.Tensor | None
    step_time_s: float
    num_tokens: int


def _resolve_quant(config: EngineConfig) -> EngineConfig:
    """`config` with its QuantConfig resolved against config.json (`resolve_quant_config`);
    an unsupported quantization_config is refused here, before the kernels are prepared.

    Raises:
        StartupError: an unsupported quantization_config, or flags that conflict with it.
    """
    try:
        hf_config = config.model.hf_config()
    except FileNotFoundError:
        return config  # AutoConfig reports the missing checkpoint
    try:
        quant = resolve_quant_config(config.quant, hf_config, config.model.torch_dtype())
        parse_quantization_config(hf_config) or parse_fp8_config(hf_config)
    except ValueError as e:
        raise StartupError(str(e)) from e
    return replace(config, quant=quant)


def _no_progress(phase: str, detail: str = "", eta_s: float | None = None) -> None:
    """The progress callback of a core nobody watches start (the offline API)."""


class EngineCore:
    """Owns one rank's scheduler, KV cache, model runner and live requests.

    Args:
        config: the engine configuration.
        rank_context: set on the ranks of an expert-parallel group (ep_size > 1): the model
            keeps only this rank's experts, and every `step` runs a forward pass (a zero-token
            one when nothing is scheduled) so that all ranks stay in lockstep.
        progress: told each startup phase (phase, detail, seconds left or None); any thread
            may call it (the kernel build reports from its own).
        graph_capture: how decode graphs are captured (`moe_engine.runner.cuda_graphs`); None: the
            real `CudaGraphCapture`. Tests pass `EagerReplayCapture` to run the graph path on
            a CPU. Whether graphs apply is decided once here and logged ("CUDA graphs: ...").

    Raises:
        StartupError: unsupported architecture, a KV cache too small for one max_model_len
            request, missing weights (messages give the numbers and the flags that fix them).
    """

    def __init__(
        self,
        config: EngineConfig,
        rank_context: RankContext | None = None,
        *,
        progress: StartupProgressFn | None = None,
        graph_capture: GraphCapture | None = None,
    ) -> None:
        progress = progress or _no_progress
        config = _resolve_quant(config)
        self.config = config
        self.rank_context = rank_context
        #: The engine's device ("cpu" or a CUDA device), resolved once here.
        self.device = engine_device(config)
        torch.set_num_threads(config.parallel.num_threads or default_threads())
        device_memory = cuda_device_memory(self.device) if self.device.type == "cuda" else None
        built = build_model(config, rank_context, progress, self.device, device_memory)
        self.architecture, self.spec, self.model = built.architecture, built.spec, built.model
        self.plan, self.max_model_len = built.plan, built.max_model_len
        self.weight_dtype, self.dtype = built.weight_dtype, built.dtype
        self.kernels = built.kernels
        spec, model_dir, hf_config = built.spec, config.model.model, built.hf_config
        kv_groups = kv_groups_of(built, config.cache.block_size)
        if sizes_kv_on_device(config, self.device):  # before the recorder and timer attach
            progress("profiling activation memory", str(self.device), None)
            self.plan = built.plan = plan_kv_on_device(config, built, kv_groups, self.device)
        self.timer = PhaseTimer()
        self.model.attach_timer(self.timer)
        ep_size = rank_context.ep_size if rank_context is not None else 1
        # group-limited routing (GLM-4.5, DeepSeek): the trace and reports show per-group load
        n_group = getattr(spec, "n_group", None)
        self.expert_load = ExpertLoadRecorder(
            sorted(spec.moe_layers), spec.num_experts, ep_size,
            n_group=n_group if n_group and n_group > 1 else None,
            device=self.device,
        )
        self.last_step: StepRecord | None = None
        self._last_num_tokens = 0
        # One rank writes its own trace; under EP rank 0's loop writes the summed one.
        self.trace: PeriodicTraceWriter | None = None
        if config.expert_trace and rank_context is None:
            self.trace = PeriodicTraceWriter(
                config.expert_trace,
                sorted(spec.moe_layers),
                spec.num_experts,
                meta=dict(model=model_dir, top_k=spec.top_k, **self.expert_load.layout_meta()),
            )
        for index, moe in self.model.moe_layers():
            moe.attach_recorder(self.expert_load, index)
        progress("loading the tokenizer", "", None)
        self.tokenizer = load_tokenizer(model_dir)
        progress("allocating the KV cache", f"{self.plan.num_blocks} blocks", None)
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = eos_token_ids_of(model_dir, hf_config)
        self.kv = KVCacheManager(
            [g.spec for g in kv_groups],
            self.plan.num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            state_slots=StateSlotPool(self.plan.num_state_slots) if self.plan.num_state_slots
            else None,
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv, config.speculative.num_lookahead_tokens
        )
        self.sampler = Sampler(config.model.seed, config.scheduler.max_num_seqs)
        #: Compiles structured-output grammars (builds nothing until a request asks for one).
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        capture = graph_capture or CudaGraphCapture()
        self._graph_capture = capture
        graphs_off = graphs_off_reason(
            self.device, enforce_eager=config.device.enforce_eager, kernels=self.kernels,
            kv_kinds=[g.spec.kind for g in kv_groups]
            + (["linear_attention"] if self.plan.num_state_slots else []),
            quant_method=config.quant.method,
            ep_size=ep_size, capture_devices=capture.device_types,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model,
            self.plan.num_blocks,
            config.cache.block_size,
            self.dtype,
            self.sampler,
            kv_groups=kv_groups,
            device=self.device,
            scratch_block=graphs_off is None,
            num_speculative_tokens=config.speculative.num_speculative_tokens,
            disable_drafts_at=config.speculative.disable_by_batch_size,
            num_state_slots=self.plan.num_state_slots,
        )
        sched = config.scheduler
        self.runner.reserve_inputs(
            sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len
        )
        self._capture_graphs(graphs_off, capture, progress)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        #: Tokens (and their logprobs) sampled but not yet sent, per request id: with
        #: `stream_interval` > 1 a request's output waits for that many tokens.
        self._unsent: dict[str, tuple[list[int], list]] = {}
        self.stream_interval = config.scheduler.stream_interval
        if self.stream_interval > 1:
            logger.info("stream interval: a request's tokens are sent every %d tokens (the first "
                        "at once, the rest with the final output)", self.stream_interval)
        spec = config.speculative
        #: Proposes each running request's draft tokens after every step (speculative
        #: decoding), None when off.
        self.drafter = Drafter(spec) if spec.enabled else None
        if self.drafter is not None:
            logger.info(
                "speculative decoding: %s, %d draft tokens per request and step%s%s",
                spec.method, spec.num_speculative_tokens,
                f" (n-grams {spec.ngram_min}..{spec.ngram_max})" if spec.method == "ngram" else "",
                f", off at {spec.disable_by_batch_size}+ running requests"
                if spec.disable_by_batch_size else "",
            )  # fmt: skip
        #: Live requests with n > 1, by the client's id.
        self._parents: dict[str, ParentRequest] = {}
        #: Pause state, weight version and weight updates (`moe_engine.weight_update`).
        self.rollout = RolloutControl(self, config.model.weight_version)
        self.counters = dict(
            prompt_tokens_total=0,
            generation_tokens_total=0,
            num_finished=0,
            num_aborted=0,
            num_rejected=0,
            num_steps=0,
        )

    def _capture_graphs(
        self, off_reason: str | None, capture: GraphCapture, progress: StartupProgressFn
    ) -> None:
        """Capture the decode graphs when they apply; log the decision in one line either way.
        The phase timer forgets the capture's forwards.

        Raises:
            StartupError: a capture failed (naming the batch size and --enforce-eager).
        """
        if off_reason is not None:
            logger.info("CUDA graphs: off (%s)", off_reason)
            return
        sched = self.config.scheduler
        sizes = capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)
        progress("capturing CUDA graphs", f"decode batch sizes {sizes}", None)
        try:
            graphs = self.runner.capture_decode_graphs(sizes, self.max_model_len, capture)
        except RuntimeError as exc:
            raise StartupError(
                f"CUDA graph capture failed at {exc}; pass --enforce-eager to run every step "
                "eagerly"
            ) from exc
        self.timer.reset()
        logger.info("%s", graphs.describe())

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again, at the same sizes (after a weight update: the
        captured graphs read the old tensors' addresses); a no-op without graphs."""
        graphs = self.runner.decode_graphs
        if graphs is not None:
            self.runner.capture_decode_graphs(graphs.sizes, self.max_model_len,
                                              self._graph_capture)
            logger.info("CUDA graphs captured again for the new weights: %s", graphs.sizes)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; with `params.n > 1`, its n completions (a
        `ParentRequest`; outputs carry `request_id` and the completion's `index`).

        With `params.structured_outputs`, the grammar is compiled here (cached by schema
        text) and each completion gets its own matcher.

        Raises:
            RequestError: a bad field (see `validate_request`; "response_format" for a schema
                that does not compile), a duplicate live id (ALREADY_EXISTS), or a full queue
                (RESOURCE_EXHAUSTED). Nothing is queued then.
        """
        validate_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self._check_new_id(request_id, params.n)
        self._check_queue(params.n)
        so = params.structured_outputs
        compiled = self.structured_output.compile(so) if so is not None else None
        arrival = arrival_time or time.monotonic()
        if params.n == 1:
            reqs = [Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival)]
        else:
            parent = ParentRequest(request_id, params)
            salt = None if self.kv.enable_prefix_caching else f"n:{request_id}"
            reqs = parent.make_children(prompt_token_ids, self.eos_token_ids, arrival, salt)
        try:
            self.scheduler.check_fits(reqs[0])  # the same for every completion
        except ValueError as e:  # could never fit in the KV pool, even alone
            raise RequestError(ErrorCode.OUT_OF_RANGE, "max_tokens", f"max_tokens: {e}") from e
        for req in reqs:
            if compiled is not None:
                req.grammar = self.structured_output.new_grammar(compiled)
            self.scheduler.add_request(req)
            if self.tokenizer is not None:
                self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        if params.n > 1:
            self._parents[request_id] = parent
        self.counters["prompt_tokens_total"] += len(prompt_token_ids)

    def _check_new_id(self, request_id: str, n: int) -> None:
        """Refuse an id that is live (or that a live request's completion uses)."""
        ids = [request_id]
        if n > 1:
            ids += [ParentRequest.child_id(request_id, i) for i in range(n)]
        if request_id in self._parents or any(i in self.scheduler.requests for i in ids):
            raise RequestError(
                ErrorCode.ALREADY_EXISTS,
                "request_id",
                f"request_id {request_id!r} is already running",
            )

    def _check_queue(self, n: int) -> None:
        """Refuse `n` more requests when the queue is full (each completion is one)."""
        # Waiting requests that the next step can still admit (free batch slots) do not
        # count against the queue limit: a burst between two steps is not an overload.
        free_slots = max(0, self.config.scheduler.max_num_seqs - len(self.scheduler.running))
        queued = len(self.scheduler.waiting) - free_slots
        limit = self.config.scheduler.max_waiting
        if n > limit + self.config.scheduler.max_num_seqs:  # could never be queued: not a retry
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "n",
                f"n: {n} completions can never be queued: at most max_num_seqs "
                f"{self.config.scheduler.max_num_seqs} run and max_waiting (--max-waiting-"
                f"requests) {limit} wait",
            )
        if queued + n > limit:
            self.counters["num_rejected"] += 1
            asked = f", and this request's n={n} completions would wait too" if n > 1 else ""
            raise RequestError(
                ErrorCode.RESOURCE_EXHAUSTED,
                "queue",
                f"queue: {max(queued, 0)} requests waiting for a batch slot{asked}, the limit "
                f"(max_waiting, --max-waiting-requests) is {limit}; retry later",
            )

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """End live requests (every completion of an n > 1 request); unknown or finished ids
        are ignored. One terminal output per completion ended."""
        outputs = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            children = [c.request_id for c in parent.children] if parent else [rid]
            for child in children:
                req = self.scheduler.finish_request(child, FinishReason.ABORT)
                if req is None:
                    continue
                self.counters["num_aborted"] += 1
                outputs.append(self._flush(req, final=True))
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether a step would run a request (False while generation is paused)."""
        return not self.rollout.paused and self.scheduler.num_unfinished > 0

    @property
    def weight_version(self) -> str:
        """The version of the weights serving now."""
        return self.rollout.weight_version

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduler step; returns this step's output deltas."""
        self.counters["num_steps"] += 1
        start = time.perf_counter()
        with self.timer.phase("step"):
            outputs = self._step()
        self.last_step = StepRecord(
            counts=self.expert_load.take_step_counts(),
            rank_tokens=self.expert_load.take_step_rank_tokens()
            if self.rank_context is not None
            else None,
            step_time_s=time.perf_counter() - start,
            num_tokens=self._last_num_tokens,
        )
        if self.trace is not None:
            r = self.last_step
            self.trace.add_step(r.counts, r.step_time_s, r.num_tokens, r.rank_tokens)
            self.trace.maybe_flush()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self.rollout.paused:  # an expert-parallel step while paused: take part, run nothing
            if self.rank_context is not None:
                self.runner.execute_idle()
            return []
        out = self.scheduler.schedule()
        self._last_num_tokens = out.total_num_tokens
        if out.is_empty:
            if self.rank_context is not None:
                self.runner.execute_idle()
            return []
        rows, sampled = self.runner.execute(out, self.kv)
        tokens = {s.request.request_id: t for s, t in zip(rows, sampled.token_ids, strict=True)}
        logprobs = {s.request.request_id: lp for s, lp in zip(rows, sampled.logprobs, strict=True)}
        before = {s.request.request_id: s.request.num_output_tokens for s in rows}
        if self.drafter is not None:
            for s, a in zip(rows, sampled.num_accepted, strict=True):
                if s.draft_token_ids:
                    self.drafter.record(s.request, len(s.draft_token_ids), a)
        advanced, _ = self.scheduler.update(out, tokens, on_token=self._check_stop_strings)
        outputs = []
        for req in advanced:
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            new = req.output_token_ids[before[req.request_id] :]
            self.counters["generation_tokens_total"] += len(new)
            lps = logprobs.get(req.request_id)
            out = self._buffered(req, new, lps[: len(new)] if lps is not None else None)
            if out is not None:
                outputs.append(out)
        if self.drafter is not None:
            proposals = None
            if sampled.proposals is not None:
                proposals = {s.request.request_id: d
                             for s, d in zip(rows, sampled.proposals, strict=True)}
            self.drafter.propose(self.scheduler.running, proposals)
        return outputs

    def _buffered(self, req: Request, tokens: list[int], lps: list | None
                  ) -> EngineCoreOutput | None:
        """`tokens` (and their logprobs entries, if asked for) added to what the request has
        not sent yet; its output once `stream_interval` tokens wait, at its first token, or when
        it finished (only then for `output_kind` "final_only"); else None."""
        ids, unsent_lps = self._unsent.setdefault(req.request_id, ([], []))
        ids.extend(tokens)
        if lps is not None:
            unsent_lps.extend(lps)
        final = req.is_finished
        if not final and req.sampling_params.output_kind == OUTPUT_FINAL_ONLY:
            return None
        if not final and req.num_output_tokens > 1 and len(ids) < self.stream_interval:
            return None
        return self._flush(req, final)

    def _flush(self, req: Request, final: bool) -> EngineCoreOutput:
        """The request's output carrying every token (and logprobs entry) not yet sent."""
        ids, lps = self._unsent.pop(req.request_id, ([], []))
        return self._output(req, ids, lps or None, final=final)

    def emit_tokens(self, req: Request, tokens: list[int], lps: list | None = None
                    ) -> list[EngineCoreOutput]:
        """The output for tokens appended outside a step (a disaggregated request's first
        token, from its prefill instance: `disagg.handoff.DecodeHandoff`), with their logprobs
        entries `lps` when the request asks for logprobs. A seeded request's generator skips
        each token's draw, so its later tokens are the ones one instance would sample."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.counters["generation_tokens_total"] += len(tokens)
        for _ in tokens:
            self.sampler.skip_draw(req, self.vocab_size)
        out = self._buffered(req, tokens, lps)
        return [out] if out is not None else []

    def check_stop_strings(self, req: Request) -> None:
        """`_check_stop_strings`, for tokens appended outside a step."""
        self._check_stop_strings(req)

    def _check_stop_strings(self, req: Request) -> None:
        """Detokenize the request's new token; a stop string it completes ends the request
        with "stop", also when the same token reached max_tokens (vLLM: a stop string
        outranks the length limit; a stop token id or EOS outranks both)."""
        detok = self._detok.get(req.request_id)
        check_stop = req.num_output_tokens >= req.sampling_params.min_tokens
        if detok is None or not detok.add(req.output_token_ids[-1], check_stop):
            return
        if not req.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP)
        elif req.finish_reason != FinishReason.LENGTH:
            return
        req.finish_reason = FinishReason.STOP
        req.stop_reason = detok.stop_string

    def _output(self, req: Request, new_ids: list[int], lps: list | None, final: bool
                ) -> EngineCoreOutput:
        detok = self._detok.get(req.request_id)
        text = detok.take_delta(final) if detok is not None else ""
        if final:
            self._detok.pop(req.request_id, None)
            self.sampler.forget(req.request_id)
            if req.finish_reason != FinishReason.ABORT:
                self.counters["num_finished"] += 1
            if req.parent is not None and req.parent.finished:
                self._parents.pop(req.parent.request_id, None)
        return EngineCoreOutput(
            request_id=req.external_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=final,
            finish_reason=req.finish_reason if final else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=lps,
            index=req.index,
            stop_reason=req.stop_reason if final else None,
            weight_version=self.rollout.weight_version,
            decode_s=self._decode_s(req) if final else None,
        )

    @staticmethod
    def _decode_s(req: Request) -> float | None:
        """Seconds from the request's first token to now (None before one): a final-only
        request's front end dates its first token from it."""
        if req.sampling_params.output_kind != OUTPUT_FINAL_ONLY or req.first_token_time is None:
            return None
        return time.monotonic() - req.first_token_time

    def get_stats(self) -> CoreStats:
        """Queue, KV and token counters (see the contract in the server's GetServerStats)."""
        pool = self.kv.pool
        comm = self._comm_counts()
        return CoreStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_used=pool.num_blocks - pool.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            kv_cached_blocks=pool.num_cached_blocks,
            kv_groups=self._kv_group_stats(),
            num_preemptions=self.scheduler.num_preemptions,
            **self.counters,
            dispatch_bytes_sent=comm.dispatch_bytes_sent if comm else 0,
            combine_bytes_sent=comm.combine_bytes_sent if comm else 0,
            min_dispatch_bytes=comm.min_dispatch_bytes if comm else 0,
            tokens_in=comm.tokens_in if comm else 0,
            tokens_received=comm.tokens_received if comm else 0,
            phase_seconds=self.timer.snapshot(),
            **self._spec_stats(),
            state_slots_total=self.kv.state_slots.num_slots if self.kv.state_slots else 0,
            state_slots_free=self.kv.state_slots.num_free if self.kv.state_slots else 0,
            paused=self.rollout.paused,
            weight_version=self.rollout.weight_version,
            rank=self.rank_context.rank if self.rank_context else 0,
        )

    def _spec_stats(self) -> dict[str, Any]:
        """The speculative-decoding counters of `CoreStats` (zeros when it is off)."""
        if self.drafter is None:
            return {}
        s = self.drafter.stats
        return dict(
            spec_decode_num_drafts=s.num_drafts,
            spec_decode_num_draft_tokens=s.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(s.accepted_per_pos),
        )

    def _kv_group_stats(self) -> list[KVCacheGroupStats]:
        """Per KV-cache group: kind, window (0 for full attention), layers, KV bytes per token
        and the distinct blocks live requests hold in it."""
        used = self.kv.blocks_used_per_group()
        return [
            KVCacheGroupStats(
                group=g,
                kind=spec.kind,
                sliding_window=spec.sliding_window or 0,
                num_layers=spec.num_layers,
                kv_bytes_per_token=spec.bytes_per_token,
                blocks_used=used[g],
            )
            for g, spec in enumerate(self.kv.specs)
        ]

    def close(self) -> None:
        """Write out what is buffered (the expert trace); call once when the engine stops."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def _comm_counts(self) -> Any:
        """This rank's dispatch/combine counters since startup (`comm.stats.CommCounts`:
        tokens and bytes), None for one rank."""
        if self.rank_context is None:
            return None
        stats = getattr(self.rank_context.communicator, "stats", None)
        return stats.total if stats is not None else None

    def get_expert_load(self) -> ExpertLoad:
        """Tokens routed to each expert of each MoE layer since startup, and per-layer summaries
        (`rank_tokens`: this rank's column of the per-rank load, under expert parallelism)."""
        counts = self.expert_load.snapshot()
        rank_tokens = None
        if self.rank_context is not None:
            rank_tokens = self.expert_load.rank_tokens.tolist()
        return ExpertLoad(
            moe_layers=list(self.expert_load.moe_layers),
            counts=counts.tolist(),
            window_counts=self.expert_load.window_counts().tolist(),
            window_steps=min(self.expert_load.num_steps, self.expert_load.window_steps),
            imbalance_ratio=imbalance_ratio(counts).tolist(),
            balancedness=balancedness(counts).tolist(),
            rank_tokens=rank_tokens,
        )

    def weight_info(self) -> dict:
        """Weight bytes of this rank by kind (`MoeCausalLM.weight_bytes_by_kind`, read from the
        loaded tensors) and how the routed experts are stored.

        Returns:
            weight_bytes_experts / _attention / _embeddings / _other (bytes);
            expert_weight_format "none" | "int4" | "mxfp4"; expert_group_size (values per
            scale, 0 for none); expert_checkpoint_format ("" when quantized at load time or
            not at all); expert_zero_points (int4 asymmetric).
        """
        q = self.config.quant
        group_size = {"int4": q.group_size, "mxfp4": MXFP4_BLOCK_SIZE}.get(q.method, 0)
        info = {f"weight_bytes_{k}": v for k, v in self.model.weight_bytes_by_kind().items()}
        return dict(
            info,
            expert_weight_format=q.method,
            expert_group_size=group_size,
            expert_checkpoint_format=q.checkpoint_format or "",
            expert_zero_points=q.method == "int4" and not q.symmetric,
        )

    def model_info(self) -> ModelInfo:
        """Static facts about the served model and the engine's limits (with `weight_info`)."""
        s, c = self.spec, self.config
        return ModelInfo(
            **self.weight_info(),
            model=c.model.model,
            architecture=self.architecture,
            dtype=str(self.dtype).removeprefix("torch."),
            vocab_size=s.vocab_size,
            max_model_len=self.max_model_len,
            num_layers=s.num_layers,
            num_experts=s.num_experts,
            num_experts_per_tok=s.top_k,
            hidden_size=s.hidden_size,
            block_size=c.cache.block_size,
            num_kv_blocks=self.plan.num_blocks,
            max_num_seqs=c.scheduler.max_num_seqs,
            max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
            ep_size=c.parallel.ep_size,
            has_tokenizer=self.tokenizer is not None,
            device=self.kernels.device,
            kernel_backends=self.kernels.info(),
            weight_version=self.rollout.weight_version,
            rank=self.rank_context.rank if self.rank_context else 0,
            local_experts=list(self.rank_context.local_experts)
            if self.rank_context
            else list(range(s.num_experts)),
        )
