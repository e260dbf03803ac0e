"""Requests, their sampling parameters and their outputs.

Names follow vLLM v1: a `Request` is one prompt and its generated tokens; `SamplingParams` says
how to pick each next token and when to stop. What one step produces for a request is an
`EngineCoreOutput` (`moe_engine.engine.messages`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from moe_engine.errors import ParamError

#: The largest number of top logprobs a request may ask for per token.
MAX_LOGPROBS = 20
#: Caps on stop conditions: every stop string is checked against each new token's text inside
#: the step loop, so their number and length bound the work one request adds to every step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
#: Temperatures below this are greedy: dividing float32 logits by less overflows (vLLM's
#: _SAMPLING_EPS is the same value).
GREEDY_TEMPERATURE = 1e-5


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


@dataclass
class SamplingParams:
    """How to choose tokens and when to stop.

    Attributes:
        max_tokens: most tokens to generate (tokens, >= 1).
        min_tokens: stop conditions (EOS, stop ids, stop strings) are ignored before this many.
        temperature: below GREEDY_TEMPERATURE (e.g. 0) means greedy; otherwise logits are
            divided by it before softmax.
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 keeps all.
        seed: per-request seed; the same seed and prompt give the same tokens.
        stop: stop strings; the matched string is not included in the text.
        stop_token_ids: extra token ids that end the request (the token is kept in the ids).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: number of top logprobs to return per generated token (None: none).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE

    def verify(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Check every field against its limit.

        Raises:
            ParamError: naming the field (`.field`), the value and the limit.
        """
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= "
                             f"max_tokens ({self.max_tokens})")
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", "temperature must be a finite number >= 0, got "
                             f"{self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ParamError("top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ParamError("logprobs", f"logprobs must be in [0, {max_logprobs}], got "
                             f"{self.logprobs}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError("stop_token_ids", f"stop_token_ids: {len(self.stop_token_ids)} "
                             f"given, at most {MAX_STOP_TOKEN_IDS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop: {len(self.stop)} strings given, at most "
                             f"{MAX_STOP_STRINGS}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ParamError("stop", f"stop: a string of {longest} characters, at most "
                             f"{MAX_STOP_STRING_CHARS}")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise ParamError("stop_token_ids", f"stop_token_ids entry {tok} is outside "
                                 f"[0, {vocab_size})")
        for s in self.stop:
            if not s:
                raise ParamError("stop", "stop strings must not be empty")


class Request:
    """One prompt and its generated tokens, as the scheduler sees it.

    `num_computed_tokens` counts the tokens whose K/V are already in the cache; the scheduler
    moves it forward each step (chunked prefill, then one token per decode step) and resets it
    to 0 when the request is preempted (recompute).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
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
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> FinishReason | None:
        """The finish reason the last generated token causes, if any (stop strings aside)."""
        params = self.sampling_params
        n = self.num_output_tokens
        if n >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                return FinishReason.STOP
        if n >= params.max_tokens:
            return FinishReason.LENGTH
        return None
