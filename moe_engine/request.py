"""Requests as the scheduler sees them.

Names follow vLLM v1: a `Request` is one prompt and its generated tokens; its `SamplingParams`
(`moe_engine.sampling_params`) say how to pick each next token and when to stop. What one step
produces for a request is an `EngineCoreOutput` (`moe_engine.core.outputs`).
"""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

from moe_engine.sampling_params import SamplingParams


class Grammar(Protocol):
    """What a request needs of its grammar matcher (`structured_output.RequestGrammar`)."""

    @property
    def is_terminated(self) -> bool:
        """True once the grammar allows no further token (the output is complete)."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        ...

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed tokens of the next step into row `row` of `bitmask`."""
        ...


class Parent(Protocol):
    """What a completion needs of its n > 1 request (`core.parallel_sampling.ParentRequest`).

    Attributes:
        request_id: the client's id for the whole request.
        num_finished: completions finished so far (the scheduler counts them).
        finished: True once all n have finished.
    """

    request_id: str
    num_finished: int

    @property
    def finished(self) -> bool: ...


class FinishReason(enum.StrEnum):
    """Why a request stopped: a stop token or string, its length limit, or an abort."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    """Where a request is in its life: waiting (never run or preempted), running, finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One prompt and its generated tokens, as the scheduler sees it.

    `num_computed_tokens` counts the tokens whose K/V are already in the cache; the scheduler
    moves it forward each step (chunked prefill, then one token per decode step) and resets it
    to 0 when the request is preempted (recompute).

    A request with `SamplingParams.n > 1` is a `ParentRequest` of n such Requests, one per
    completion (`parent`, `index`); they share the prompt's KV blocks through the prefix-cache
    map, under `cache_salt` when prefix caching is off (so that only siblings find them).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        *,
        parent: Parent | None = None,
        index: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        #: When the engine core queued it and first scheduled it (time.monotonic() seconds of
        #: the core's process): vLLM's QUEUED and SCHEDULED events, for the queue and prefill
        #: intervals of its metrics.
        self.queued_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.parent = parent
        self.index = index
        self.cache_salt = cache_salt
        #: With finish_reason STOP: the stop string or stop token id that ended the request.
        self.stop_reason: int | str | None = None
        #: The grammar matcher of a request with `structured_outputs` (set by the engine when
        #: the request is added, advanced with each appended token, dropped when it finishes).
        self.grammar: Grammar | None = None
        #: Draft tokens proposed for the next step (speculative decoding): fed after the
        #: request's last token and verified by that step's forward; never part of
        #: `all_token_ids` (nor of any prefix-cache hash) until accepted.
        self.spec_token_ids: list[int] = []
        #: The most drafts this request takes next (None: num_speculative_tokens) and the
        #: steps it skips drafting, both set from its last verification (`Drafter.record`).
        self.draft_limit: int | None = None
        self.draft_cooldown = 0
        #: Prefill-only (prefill/decode disaggregation): when it finishes, its blocks are
        #: kept (`Scheduler.held`) until sent to a decode instance.
        self.hold_kv = False
        #: Which weights computed the output tokens: [(weight_version, first output-token
        #: index)], in order (`note_weight_version`).
        self.weight_versions: list[tuple[str, int]] = []
        #: The weight update count (`KVCacheManager.weights_epoch`) of the oldest weights
        #: that computed K/V (or linear-attention state) the request holds now; set when it
        #: takes its first blocks (from a prefix-cache hit's blocks, or the weights serving).
        self.kv_weights_epoch = 0
        #: Set once a step ran the request on other weights than those of K/V (or state) it
        #: reads: an update landed while it held computed tokens and was not retracted, or a
        #: prefix-cache hit on blocks of older weights (`--keep-prefix-cache`). Never unset.
        self.kv_from_other_weights = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a sampled token; the grammar (if any) accepts it too.

        A preempted request recomputes its K/V from `all_token_ids` but appends nothing new
        until its next sampled token, so its grammar state stays that of its output so far.
        """
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def note_weight_version(self, version: str, start: int) -> None:
        """Record that the output tokens from index `start` on were sampled on `version`'s
        weights (a no-op when the last entry already names it)."""
        if not self.weight_versions or self.weight_versions[-1][0] != version:
            self.weight_versions.append((version, start))

    @property
    def external_id(self) -> str:
        """The id the client knows: the parent's for a completion of an n > 1 request."""
        return self.parent.request_id if self.parent is not None else self.request_id

    def check_stop_token(self) -> FinishReason | None:
        """The finish reason the last generated token causes, if any (stop strings aside);
        a stop token id from `stop_token_ids` is also kept as `stop_reason` (EOS is not).
        A terminated grammar (structured output) stops the request whatever min_tokens and
        ignore_eos say: it allows no further token."""
        params = self.sampling_params
        n = self.num_output_tokens
        if self.grammar is not None and self.grammar.is_terminated:
            return FinishReason.STOP  # the JSON is complete and its EOS taken (min_tokens aside)
        if n >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if n >= params.max_tokens:
            return FinishReason.LENGTH
        return None
