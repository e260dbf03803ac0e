"""EngineCore: one rank's synchronous loop (schedule -> execute -> sample -> update -> outputs).

`core.build.build_engine_core` builds, loads and wires the parts (model, KV cache, scheduler,
runner, graphs, drafter) and hands them to `EngineCore`, which runs them; what the core reports
about itself (stats, expert load, model info) is in `core.reports`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_engine.core import reports
from moe_engine.core.detokenizer import IncrementalDetokenizer
from moe_engine.core.outputs import CoreStats, EngineCoreOutput, ExpertLoad, ModelInfo
from moe_engine.core.parallel_sampling import ParentRequest
from moe_engine.core.validation import (
    check_priority,
    check_routed_experts,
    truncate_prompt,
    validate_request,
)
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.kv_cache import KVCacheManager
from moe_engine.models.build import BuiltModel
from moe_engine.phase_timer import PhaseTimer
from moe_engine.request import FinishReason, Request
from moe_engine.runner.cuda_graphs import GraphCapture
from moe_engine.runner.model_runner import ModelRunner
from moe_engine.runner.sampler import Sampler
from moe_engine.runner.spec_decode.drafter import Drafter
from moe_engine.sampling_params import OUTPUT_FINAL_ONLY, SamplingParams
from moe_engine.scheduler import Scheduler
from moe_engine.skew.trace import PeriodicTraceWriter
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.rank_context import RankContext
from moe_engine.structured_output import StructuredOutputManager
from moe_engine.weight_update.control import RolloutControl

logger = logging.getLogger(__name__)


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


class EngineCore:
    """Owns one rank's scheduler, KV cache, model runner and live requests.

    Built by `core.build.build_engine_core` (use that); the arguments are its built parts.

    Args:
        config: the engine configuration, its QuantConfig resolved against config.json.
        built: the loaded model and what was decided on the way (`models.build.BuiltModel`:
            model, spec, architecture, plan, max_model_len, dtypes, kernels).
        rank_context: set on the ranks of an expert-parallel group (ep_size > 1): the model
            keeps only this rank's experts, and every `step` runs a forward pass (a zero-token
            one when nothing is scheduled) so that all ranks stay in lockstep.
        device: the engine's device; timer: the phase timer attached to the model;
        expert_load: the routing recorder attached to the MoE layers; trace: this rank's own
            expert trace writer, or None.
        tokenizer: the checkpoint's tokenizer, or None; eos_token_ids: the EOS ids.
        kv, scheduler, sampler, structured_output, runner: the KV cache manager, scheduler,
            sampler, grammar compiler and model runner (its decode graphs captured).
        graph_capture: how the decode graphs were captured (`recapture_graphs` uses it again).
        drafter: the speculative decoding drafter, None when off.
    """

    def __init__(
        self,
        config: EngineConfig,
        built: BuiltModel,
        *,
        rank_context: RankContext | None,
        device: torch.device,
        timer: PhaseTimer,
        expert_load: ExpertLoadRecorder,
        trace: PeriodicTraceWriter | None,
        tokenizer: Any | None,
        eos_token_ids: frozenset[int],
        kv: KVCacheManager,
        scheduler: Scheduler,
        sampler: Sampler,
        structured_output: StructuredOutputManager,
        runner: ModelRunner,
        graph_capture: GraphCapture,
        drafter: Drafter | None,
    ) -> None:
        self.config = config
        self.rank_context = rank_context
        #: The engine's device ("cpu" or a CUDA device), resolved once by the build.
        self.device = device
        self.architecture, self.spec, self.model = built.architecture, built.spec, built.model
        self.plan, self.max_model_len = built.plan, built.max_model_len
        self.weight_dtype, self.dtype = built.weight_dtype, built.dtype
        self.kernels = built.kernels
        self.timer = timer
        self.expert_load = expert_load
        #: Runtime EPLB's controller (`moe_engine.eplb.controller`), set by the expert-parallel
        #: rank loop with --enable-eplb; None otherwise (read by the stats and model info).
        self.eplb: Any = None
        self.last_step: StepRecord | None = None
        self._last_num_tokens = 0
        #: This rank's own expert trace (one rank only; under EP rank 0's loop writes one).
        self.trace = trace
        self.tokenizer = tokenizer
        self.vocab_size = built.spec.vocab_size
        self.eos_token_ids = eos_token_ids
        self.kv = kv
        self.scheduler = scheduler
        self.sampler = sampler
        #: Compiles structured-output grammars (builds nothing until a request asks for one).
        self.structured_output = structured_output
        self.runner = runner
        self._graph_capture = graph_capture
        self._detok: dict[str, IncrementalDetokenizer] = {}
        #: Tokens (and their logprobs) sampled but not yet sent, per request id: with
        #: `stream_interval` > 1 a request's output waits for that many tokens.
        self._unsent: dict[str, tuple[list[int], list]] = {}
        self.stream_interval = config.scheduler.stream_interval
        #: Proposes each running request's draft tokens after every step (speculative
        #: decoding), None when off.
        self.drafter = drafter
        #: Live requests with n > 1, by the client's id.
        self._parents: dict[str, ParentRequest] = {}
        #: Routing replay: the routing of requests that ended and asked for it, by internal id,
        #: gathered before their blocks were freed, until their final output takes it.
        self._routed: dict[str, np.ndarray] = {}
        if runner.routing_replay is not None:
            scheduler.on_finish = self._gather_routed_experts
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
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, self.max_model_len)
        validate_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        check_priority(params, self.scheduler.config.policy)
        check_routed_experts(params, self.runner.routing_replay is not None)
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
                self._detok[req.request_id] = IncrementalDetokenizer.from_params(
                    self.tokenizer, params
                )
        if params.n > 1:
            self._parents[request_id] = parent
        self.counters["prompt_tokens_total"] += len(prompt_token_ids)

    def _gather_routed_experts(self, req: Request) -> None:
        """Keep an ending request's routing (`Scheduler.on_finish`: it still holds its
        blocks) when it asked for it."""
        if req.sampling_params.return_routed_experts:
            self._routed[req.request_id] = self.runner.routing_replay.gather(self.kv, req)

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
        now = time.monotonic()
        epoch = self.kv.weights_epoch
        for scheduled in out.scheduled:
            req = scheduled.request
            if req.scheduled_time is None:
                req.scheduled_time = now
            if req.kv_weights_epoch != epoch:  # it reads K/V of weights no longer serving
                req.kv_from_other_weights = True
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
            if new:
                req.note_weight_version(self.rollout.weight_version, before[req.request_id])
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
        if tokens:
            req.note_weight_version(self.rollout.weight_version,
                                    req.num_output_tokens - len(tokens))
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
        outranks the length limit; a stop token id or EOS outranks both, and the text of
        the token that ended the request that way is left out unless the request asks for
        include_stop_str_in_output)."""
        detok = self._detok.get(req.request_id)
        if detok is None:
            return
        params = req.sampling_params
        if req.finish_reason == FinishReason.STOP and not params.include_stop_str_in_output:
            return  # EOS or a stop token id ended it: its text stays out (as vLLM's)
        check_stop = req.num_output_tokens >= params.min_tokens
        if not detok.add(req.output_token_ids[-1], check_stop):
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
        if final and detok is not None and detok.stopped and req.finish_reason == (
            FinishReason.LENGTH
        ):  # a stop string that matched only in the final flush outranks the length limit
            req.finish_reason = FinishReason.STOP
            req.stop_reason = detok.stop_string
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
            weight_versions=list(req.weight_versions) if final else None,
            kv_from_other_weights=final and req.kv_from_other_weights,
            **(self._intervals(req) if final else {}),
            **(self._routed_experts(req) if final else {}),
        )

    def _routed_experts(self, req: Request) -> dict[str, Any]:
        """A finished request's `routed_experts` (raw little-endian int32, C order) and
        `routed_experts_shape` [tokens, moe_layers, top_k] where it asked for them."""
        rows = self._routed.pop(req.request_id, None)
        if rows is None:
            return {}
        return {"routed_experts": rows.astype("<i4", copy=False).tobytes(),
                "routed_experts_shape": tuple(int(d) for d in rows.shape)}

    @staticmethod
    def _intervals(req: Request) -> dict[str, float | None]:
        """A finished request's queue and prefill intervals (seconds; `EngineCoreOutput`)."""
        scheduled = req.scheduled_time
        if scheduled is None:  # aborted while waiting
            return {"queue_s": time.monotonic() - req.queued_time, "prefill_s": None}
        first = req.first_token_time
        return {"queue_s": scheduled - req.queued_time,
                "prefill_s": None if first is None else first - scheduled}

    @staticmethod
    def _decode_s(req: Request) -> float | None:
        """Seconds from the request's first token to now (None before one): a final-only
        request's front end dates its first token from it."""
        if req.sampling_params.output_kind != OUTPUT_FINAL_ONLY or req.first_token_time is None:
            return None
        return time.monotonic() - req.first_token_time

    def close(self) -> None:
        """Write out what is buffered (the expert trace); call once when the engine stops."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def get_stats(self) -> CoreStats:
        """Queue, KV and token counters (`reports.core_stats`)."""
        return reports.core_stats(self)

    def get_expert_load(self) -> ExpertLoad:
        """Tokens routed to each expert of each MoE layer since startup, and per-layer
        summaries (`reports.expert_load`)."""
        return reports.expert_load(self)

    def weight_info(self) -> dict:
        """Weight bytes of this rank by kind and how the routed experts are stored
        (`reports.weight_info`)."""
        return reports.weight_info(self)

    def model_info(self) -> ModelInfo:
        """Static facts about the served model and the engine's limits
        (`reports.model_info`)."""
        return reports.model_info(self)
