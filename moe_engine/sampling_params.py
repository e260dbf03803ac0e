"""How to pick each next token and when to stop: `SamplingParams` (vLLM v1's names), the
JSON constraint `StructuredOutputsParams`, and the limits both are checked against.

User mistakes raise `ParamError` naming the field, the value and the limit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from moe_engine.errors import ParamError
from moe_engine.param_checks import as_list, integer, logit_bias_map, real

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
#: Most completions one request may ask for (`SamplingParams.n`); each is a Request of its own.
MAX_N = 128
#: The largest `top_k` (a 32-bit integer, as the gRPC field; past the vocabulary it keeps all).
MAX_TOP_K = 2**31 - 1
#: `priority` bounds: the gRPC field's int32 range, the same on every front end.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: Seeds torch's generator accepts (a 64-bit value, signed or unsigned).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: OpenAI's (and vLLM's) range of `frequency_penalty` and `presence_penalty`.
MAX_ABS_PENALTY = 2.0


#: Longest JSON schema text a request may carry (characters): compiling is linear in its size,
#: and the compiled grammar is cached by this text.
MAX_JSON_SCHEMA_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion to JSON (vLLM's `StructuredOutputsParams`, its JSON half).

    Exactly one of the two is set. The engine compiles the grammar with xgrammar when the
    request is added (`moe_engine.structured_output`); a schema xgrammar cannot compile is
    refused then (RequestError INVALID_ARGUMENT, field "response_format").

    Attributes:
        json: a JSON schema as JSON text (its top level an object, e.g. '{"type": "object"}');
            the output is a JSON value that validates against it.
        json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).

    Raises:
        ParamError: field "response_format": neither or both set, `json` not a string, not
            valid JSON, not a JSON object, or over MAX_JSON_SCHEMA_CHARS characters.
    """

    json: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ParamError(
                "response_format", f"response_format: json_object must be a bool, got "
                f"{self.json_object!r}",
            )  # fmt: skip
        if (self.json is None) == (not self.json_object):
            raise ParamError(
                "response_format",
                "response_format: set exactly one of json (a JSON schema) and json_object",
            )
        if self.json is not None:
            _check_schema_text(self.json)

    @property
    def cache_key(self) -> str:
        """What the compiled grammar is cached under: the schema text ("" for json_object)."""
        return self.json if self.json is not None else ""


def _check_schema_text(text: object) -> None:
    """Refuse a schema that is not the JSON text of an object (ParamError "response_format")."""
    if not isinstance(text, str):
        raise ParamError(
            "response_format",
            f"response_format: json must be a JSON schema as text, got {type(text).__name__}",
        )
    if len(text) > MAX_JSON_SCHEMA_CHARS:
        raise ParamError(
            "response_format",
            f"response_format: the JSON schema has {len(text)} characters, at most "
            f"{MAX_JSON_SCHEMA_CHARS}",
        )
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ParamError(
            "response_format", f"response_format: the JSON schema is not valid JSON: {e}"
        ) from None
    if not isinstance(schema, dict):
        raise ParamError(
            "response_format",
            f"response_format: a JSON schema must be a JSON object, got {type(schema).__name__}",
        )


#: `SamplingParams.output_kind`: an output per step (or `--stream-interval`), or one at the end.
OUTPUT_DELTA = "delta"
OUTPUT_FINAL_ONLY = "final_only"
OUTPUT_KINDS = (OUTPUT_DELTA, OUTPUT_FINAL_ONLY)


@dataclass
class SamplingParams:
    """How to choose tokens and when to stop (vLLM's `SamplingParams`, the fields it shares).

    Every field is checked at construction (`__post_init__`); limits that need the model
    (vocabulary size, the engine's logprobs cap) are checked by `verify`.

    Attributes:
        max_tokens: most tokens to generate per completion (tokens, >= 1).
        min_tokens: stop conditions (EOS, stop ids, stop strings) are ignored before this many.
        temperature: below GREEDY_TEMPERATURE (e.g. 0) means greedy; otherwise logits are
            divided by it before softmax.
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 keeps all.
        seed: per-request seed in [-2**63, 2**64 - n]; the same seed and prompt give the same
            tokens; completion i of a request with n > 1 uses seed + i (as vLLM does).
        stop: stop strings (one string is one stop string); the matched string is not
            included in the text (unless include_stop_str_in_output).
        stop_token_ids: extra token ids that end a completion (one int is one id; the token
            is kept in the ids).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: number of top logprobs to return per generated token (None: none).
        n: completions to generate from the prompt (parallel sampling, 1..MAX_N); they share
            the prompt's KV blocks.
        structured_outputs: constrain the output to JSON (a schema, or any object); None: free.
            Each completion is constrained on its own; it finishes with "stop" once its JSON
            is complete (and the grammar took EOS). Cut by max_tokens, the text need not parse.
        output_kind: "delta" (an output per step, or every `--stream-interval` tokens, with
            the tokens since the previous one) or "final_only" (one output per completion, when
            it finishes, with all its tokens and text: what a caller that does not stream needs;
            vLLM's `RequestOutputKind.FINAL_ONLY`, which its OpenAI server uses for
            `stream: false`). The tokens are the same either way.
        repetition_penalty: > 0; 1 is off. Each token of the prompt or the output so far has
            its logit divided by it when positive, multiplied when not (CTRL, Keskar et al.
            2019; transformers' `RepetitionPenaltyLogitsProcessor`, vLLM's).
        frequency_penalty, presence_penalty: in [-2, 2]; 0 is off. Each token's logit is
            lowered by frequency_penalty * (its count in the output so far) + presence_penalty
            * (1 if it occurs there) (OpenAI's definition: output tokens only).
        min_p: in [0, 1]; 0 is off. Random sampling keeps the tokens whose probability (after
            temperature) is at least min_p times the most likely token's (vLLM's `min_p`).
        logit_bias: token id -> bias in [-100, 100] added to its logit before everything else
            (OpenAI's `logit_bias`); ids are checked against the vocabulary in `verify`.
        truncate_prompt_tokens: keep only the prompt's last k tokens (k >= 1), or -1 for the
            last max_model_len (vLLM's); None keeps the whole prompt.
        priority: the scheduler's order under `--scheduling-policy priority` (lower runs
            earlier, ties by arrival; vLLM's `priority`, which vLLM passes beside the params);
            must be 0 under the default "fcfs" policy (the engine refuses others, as vLLM).
        include_stop_str_in_output: keep the matched stop string at the end of the text (the
            text after it is still cut), and the text of a stop token id or EOS that ended the
            completion (vLLM's field; default False: both are left out of the text).
        skip_special_tokens: leave special tokens (the tokenizer's added special tokens: BOS,
            EOS, chat markers) out of the text (vLLM's default True); False keeps their text.
        return_routed_experts: return the top-k logical expert ids of every MoE layer for
            every token the model ran for this completion (routing replay for RL; SGLang's
            field): needs a server started with `--enable-return-routed-experts`.

    Penalties, logit_bias and greedy: logit_bias and the three penalties change the logits
    before the argmax, so they apply to greedy requests too; min_p, like top-k and top-p, only
    to random sampling (vLLM v1's sampler order: logit_bias, penalties, then greedy or
    temperature, min_p, top-k/top-p).

    Raises:
        ParamError: at construction, for a field of the wrong type or outside its limits
            (names the field, the value and the limit).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    stop_token_ids: int | list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: str = OUTPUT_DELTA
    # -- logits processors, prompt truncation and priority (issue 44, the sampling part) --
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    # Detokenizer fields (issue 44, "text" part): how token ids become the returned text.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Routing replay (issue 45).
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        self.stop = as_list("stop", self.stop, str)
        self.stop_token_ids = as_list("stop_token_ids", self.stop_token_ids, int)
        self._check()

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE

    def verify(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Check every field again (they may have been changed since construction), then the
        limits that need the model.

        Args:
            vocab_size: stop_token_ids must be in [0, vocab_size).
            max_logprobs: the engine's cap on `logprobs`.

        Raises:
            ParamError: naming the field, the value and the limit.
        """
        self.stop = as_list("stop", self.stop, str)
        self.stop_token_ids = as_list("stop_token_ids", self.stop_token_ids, int)
        self._check()
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ParamError(
                "logprobs", f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}"
            )
        out_of_vocab = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        if out_of_vocab:
            raise ParamError(
                "logit_bias",
                f"logit_bias token id {out_of_vocab[0]} is outside [0, {vocab_size}) "
                f"(vocab_size {vocab_size})",
            )
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise ParamError(
                    "stop_token_ids",
                    f"stop_token_ids entry {tok} is outside [0, {vocab_size}) "
                    f"(vocab_size {vocab_size})",
                )

    def _check(self) -> None:
        """The checks that need no model; normalises ints and floats in place."""
        self.n = integer("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ParamError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        self.max_tokens = integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        self.min_tokens = integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        self.temperature = real("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        self.top_p = real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:  # NaN fails both comparisons
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = integer("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0 or self.top_k > MAX_TOP_K:
            raise ParamError(
                "top_k", f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}] (a value past the "
                f"vocabulary keeps every token), got {self.top_k}",
            )
        self._check_seed()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "return_routed_experts"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ParamError(name, f"{name} must be a bool, got {value!r}")
        if self.logprobs is not None:
            self.logprobs = integer("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ParamError("logprobs", f"logprobs must be >= 0, got {self.logprobs}")
        self._check_stop()
        if self.output_kind not in OUTPUT_KINDS:
            raise ParamError(
                "output_kind",
                f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}",
            )
        self._check_processors()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ParamError(
                "structured_outputs",
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}",
            )

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties is on (the sampler's penalty path)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def has_logits_processors(self) -> bool:
        """True when a penalty, min_p or logit_bias changes the logits (such a request takes
        no speculative drafts: `spec_decode.drafter`)."""
        return self.has_penalties or self.min_p > 0.0 or bool(self.logit_bias)

    def _check_processors(self) -> None:
        """Penalties, min_p, logit_bias, truncate_prompt_tokens and priority (vLLM's limits)."""
        self.repetition_penalty = real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = real(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ParamError(
                    name, f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], "
                    f"got {value}",
                )  # fmt: skip
            setattr(self, name, value)
        self.min_p = real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        self.logit_bias = logit_bias_map(self.logit_bias)
        if self.truncate_prompt_tokens is not None:
            k = integer("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if k < 1 and k != -1:
                raise ParamError(
                    "truncate_prompt_tokens",
                    f"truncate_prompt_tokens must be an integer >= 1 or -1 (max_model_len), "
                    f"got {k}",
                )
            self.truncate_prompt_tokens = k
        self.priority = integer("priority", self.priority)
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ParamError(
                "priority", f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}] (a 32-bit "
                f"integer, as the gRPC field), got {self.priority}",
            )

    def _check_seed(self) -> None:
        if self.seed is None:
            return
        self.seed = integer("seed", self.seed)
        top = SEED_MAX - (self.n - 1)  # completion i draws with seed + i
        if not SEED_MIN <= self.seed <= top:
            extra = f" (with n={self.n}: completion i uses seed + i)" if self.n > 1 else ""
            raise ParamError(
                "seed",
                f"seed must be in [{SEED_MIN}, {top}] (a 64-bit seed){extra}, got {self.seed}",
            )

    def _check_stop(self) -> None:
        stop, ids = self.stop, self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError(
                "stop_token_ids", f"stop_token_ids: {len(ids)} given, at most {MAX_STOP_TOKEN_IDS}"
            )
        negative = [t for t in ids if t < 0]
        if negative:
            raise ParamError(
                "stop_token_ids", f"stop_token_ids entry {negative[0]} is negative (ids are >= 0)"
            )
        if len(stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop: {len(stop)} strings given, at most {MAX_STOP_STRINGS}")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ParamError(
                "stop", f"stop: a string of {longest} characters, at most {MAX_STOP_STRING_CHARS}"
            )
        if any(not s for s in stop):
            raise ParamError("stop", "stop strings must not be empty")
