"""Iteration-level continuous batching (Orca, OSDI'22; vLLM v1's unified scheduler).

Each `schedule()` call builds one step under a token budget (`max_num_batched_tokens`) and a
sequence cap (`max_num_seqs`): running requests first (decodes and unfinished prefill chunks),
then waiting requests in arrival order, each prefill cut into chunks that fit the budget.
When the KV pool runs out, the newest running request is preempted: its blocks are freed and it
is recomputed later from its prompt plus the tokens it already generated.

Under `SchedulerConfig.policy` "priority" (vLLM's `--scheduling-policy priority`) the waiting
queue is kept sorted by (`SamplingParams.priority`, arrival time), lower first, a preempted
request going back to its place in that order; the preemption victim is the running request
with the largest (priority, arrival time), i.e. the least urgent, newest among equals, even one
already scheduled earlier in the step (its share of the step is taken back), as vLLM v1.

With prefix caching, a request taken from the queue first looks up its cached prefix
(`KVCacheManager.get_computed_blocks`): those tokens count as computed, so its first chunk, the
token budget and the blocks it needs cover only the uncached rest.

Parallel sampling (`moe_engine.core.parallel_sampling`): the completions of one request are
Requests of their own, queued together, that share the prompt's full blocks through that
lookup. The first (the lead) is admitted first, and a prefill chunk cut by the token budget
leaves no budget for anyone after it, so the others are admitted only once the lead has
scheduled its whole prompt: they find every shared block instead of computing it again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_engine.kv_cache import KVCacheManager
from moe_engine.kv_cache.manager import PrefixHit
from moe_engine.request import FinishReason, Request, RequestStatus
from moe_engine.startup.config import SchedulerConfig


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_tokens: tokens fed this step (prefill chunk length, or 1 for a decode; with
            speculative decoding 1 + the drafts).
        start: position of the first fed token (= tokens already in the KV cache).
        draft_token_ids: the drafts fed after the request's last token (the last
            len(draft_token_ids) of the num_tokens), verified by this step.
    """

    request: Request
    num_tokens: int
    start: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so a token is sampled."""
        fed = self.num_tokens - len(self.draft_token_ids)
        return self.start + fed == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """The batch of one step, in the order the model runner lays the tokens out."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides which requests run each step and keeps their KV blocks.

    Args:
        config: the batch limits.
        kv_cache_manager: where blocks come from.
        num_lookahead_tokens: KV slots each scheduled request also gets past its step's
            tokens (MTP drafts write ahead, `SpeculativeConfig.num_lookahead_tokens`), never
            past its prompt + max_tokens - 1; they are not computed, so never hashed.
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
        num_lookahead_tokens: int = 0,
    ) -> None:  # fmt: skip
        self.config = config
        self.kv = kv_cache_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: Prefill-only requests that finished and keep their blocks until sent to a decode
        #: instance (`Request.hold_kv`; `release_held`).
        self.held: dict[str, Request] = {}
        #: Decode side: requests whose prompt blocks are allocated while their K/V arrives
        #: from a prefill instance (`park_for_remote_kv`, `remote_kv_arrived`); in `requests`,
        #: in neither queue.
        self.awaiting_kv: dict[str, Request] = {}
        #: Called with each request that ends (`finish_request`), its finish reason set, while
        #: it still holds its blocks (routing replay gathers through its block table).
        self.on_finish: Callable[[Request], None] | None = None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        """Queue a request (its id must be new; the engine checks).

        Raises:
            ValueError: the request could never fit in the KV pool, even alone (see
                `check_fits`); queuing it would re-prefill it forever.
        """
        self.check_fits(request)
        self.requests[request.request_id] = request
        if self.config.policy == "priority":
            self._insert_waiting(request, after_equals=True)
        else:
            self.waiting.append(request)

    @staticmethod
    def _priority_key(req: Request) -> tuple[int, float]:
        return req.sampling_params.priority, req.arrival_time

    def _insert_waiting(self, req: Request, after_equals: bool) -> None:
        """Put `req` in the priority-ordered queue: after the requests of the same key (a new
        request: siblings of one n > 1 request stay in order) or before them (a preempted
        one, which was admitted first)."""
        key = self._priority_key(req)
        for pos, other in enumerate(self.waiting):
            k = self._priority_key(other)
            if k > key or (k == key and not after_equals):
                self.waiting.insert(pos, req)
                return
        self.waiting.append(req)

    def _victim(self) -> Request:
        """The running request to preempt: the newest (fcfs), or the one with the largest
        (priority, arrival time)."""
        if self.config.policy == "priority":
            return max(reversed(self.running), key=self._priority_key)
        return self.running[-1]

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never run, however empty the pool.

        Raises:
            ValueError: see `KVCacheManager.check_fits`.
        """
        self.kv.check_fits(self.max_context(request), self.config.max_num_batched_tokens)

    @staticmethod
    def max_context(request: Request) -> int:
        """Most tokens the request ever has in the KV cache: prompt + max_tokens - 1 (the last
        sampled token is never fed)."""
        return request.num_prompt_tokens + request.sampling_params.max_tokens - 1

    def schedule(self) -> SchedulerOutput:
        """Build the next step; allocates the blocks it needs, preempting when they run out."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, drafts = self._running_tokens(req, budget)
            if drafts and not self._allocate(req, n):
                n, drafts = n - len(drafts), []  # drafts go before anyone is preempted
            while not self._allocate(req, n):
                victim = self._victim()
                at = self.running.index(victim)
                self.running.pop(at)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    return budget
                if at < i:  # scheduled earlier in this step (priority policy): take it back
                    i -= 1
                    budget += self._unschedule(out, victim)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, drafts))
            budget -= n
            i += 1
        return budget

    @staticmethod
    def _unschedule(out: SchedulerOutput, req: Request) -> int:
        """Drop `req`'s share of the step being built; returns its tokens."""
        at = next(j for j, s in enumerate(out.scheduled) if s.request is req)
        return out.scheduled.pop(at).num_tokens

    @staticmethod
    def _running_tokens(req: Request, budget: int) -> tuple[int, list[int]]:
        """(tokens to feed, drafts among them) for a running request: its uncomputed tokens,
        plus its drafts when it decodes (the budget counts them; the drafts are taken from
        the request, so a step that does not verify them never sees them again)."""
        left = req.num_tokens - req.num_computed_tokens
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if left != 1 or not drafts:
            return min(left, budget), []
        drafts = drafts[: budget - 1]
        return 1 + len(drafts), drafts

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]  # waiting requests hold no blocks: num_computed_tokens is 0
            hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not self._allocate(req, n, hit):
                break
            req.num_computed_tokens = hit.num_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n

    def _allocate(self, req: Request, n: int, hit: PrefixHit | None = None) -> bool:
        """`KVCacheManager.allocate_slots` for n tokens plus the lookahead that fits."""
        done = req.num_computed_tokens + (hit.num_tokens if hit is not None else 0) + n
        ahead = max(0, min(self.num_lookahead_tokens, self.max_context(req) - done))
        return self.kv.allocate_slots(req, n, hit, num_lookahead_tokens=ahead)

    def retract_running(self) -> int:
        """Send every running request back to the head of the queue (in order) with its KV
        freed, as a preemption (recomputed when scheduled again); returns how many."""
        retracted = self.running
        self.running = []
        for req in reversed(retracted):
            self._preempt(req)
        return len(retracted)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            self._insert_waiting(req, after_equals=False)
        else:
            self.waiting.appendleft(req)

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int | list[int]],
        on_token: Callable[[Request], None] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """Advance the step's requests and append the sampled tokens.

        A request whose step verified drafts gets its accepted drafts and one more token (a
        list); its computed tokens advance past the accepted ones only, so the rejected
        drafts' K/V slots are overwritten by the next step (their blocks stay the request's).
        Tokens are appended one at a time and a stop condition ends the request at once: the
        tokens after it are dropped.

        Args:
            out: the step that ran.
            sampled: request id -> sampled token id (or ids: accepted drafts + 1), for the
                requests whose step `samples`.
            on_token: called after each appended token of a request that is still running
                (the engine's stop-string check, which may finish the request).

        Returns:
            (requests that got new tokens, those of them that finished by token or length).
        """
        advanced: list[Request] = []
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id) if s.samples else None
            tokens = [tokens] if isinstance(tokens, int) else tokens
            rejected = len(s.draft_token_ids) - (len(tokens) - 1) if tokens else 0
            req.num_computed_tokens += s.num_tokens - rejected
            self.kv.remove_skipped_blocks(req)
            if not s.samples:
                continue
            advanced.append(req)
            if self._append(req, tokens, on_token):
                finished.append(req)
        return advanced, finished

    def _append(
        self, req: Request, tokens: list[int], on_token: Callable[[Request], None] | None
    ) -> bool:
        """Append `tokens` until one ends the request; True when a token id or the length
        limit ended it (a stop string found by `on_token` finishes it there too)."""
        for token in tokens:
            req.append_token(token)
            reason = req.check_stop_token()
            if reason is not None:
                self.finish_request(req.request_id, reason)
            if on_token is not None:
                on_token(req)
            if req.is_finished:
                return reason is not None
        return False

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request and free its blocks; returns it, or None when unknown or done.

        The last completion of a parallel-sampling request to end also takes the prompt's
        salted blocks out of the prefix-cache map (`KVCacheManager.forget_prefix`).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.awaiting_kv.pop(request_id, None) is not None:
            pass
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.grammar = None  # its matcher is no longer needed
        if self.on_finish is not None:
            self.on_finish(req)
        if req.hold_kv and reason != FinishReason.ABORT:
            self.held[request_id] = req  # its blocks go to a decode instance first
        else:
            self.kv.free(request_id)
        parent = req.parent
        if parent is not None:
            parent.num_finished += 1
            if parent.finished:
                self.kv.forget_prefix(req)
        return req

    def release_held(self, request_id: str) -> bool:
        """Free a held prefill's blocks (sent, or given up); False when none is held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def park_for_remote_kv(self, request_id: str) -> int | None:
        """Decode side: take a just-added request out of the queue and allocate blocks for
        its whole prompt, whose K/V a prefill instance writes into them; a prefix-cache hit
        keeps the blocks this instance already holds. Nothing is entered in the prefix-cache
        map until the K/V arrived (`remote_kv_arrived`), so no other request reads the blocks
        before.

        Returns:
            The prompt tokens the hit already covers (the blocks before them need no
            transfer), or None when the batch or the pool has no room now (the request is
            then left queued, as any new request).
        """
        req = self.requests[request_id]
        if len(self.running) + len(self.awaiting_kv) >= self.config.max_num_seqs:
            return None
        hit = self.kv.get_computed_blocks(req)
        if not self.kv.allocate_slots(req, req.num_prompt_tokens - hit.num_tokens, hit,
                                      cache_blocks=False):
            return None
        self.waiting.remove(req)
        self.awaiting_kv[request_id] = req
        return hit.num_tokens

    def remote_kv_arrived(self, request_id: str, first_token: int,
                          on_token: Callable[[Request], None] | None = None) -> Request:
        """Decode side: the prompt's K/V is in the parked request's blocks; it runs from here
        with the prefill's first token appended (which may already end it).

        Raises:
            KeyError: the request is not parked (aborted meanwhile, or never parked).
        """
        req = self.awaiting_kv.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed(req)
        self.kv.remove_skipped_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._append(req, [first_token], on_token)
        return req
