"""Request validation: every refusal names the field, the value and the limit.

`validate_request` is called by `EngineCore.add_request` and, earlier, by the front end (which
knows the same limits from the model info) so that bad requests never reach the step loop.
A sampling parameter at fault comes as `ParamError`, which names its field (`param_error`).
"""

from __future__ import annotations

from moe_engine.errors import ErrorCode, ParamError, RequestError
from moe_engine.sampling_params import MAX_LOGPROBS, SamplingParams


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int = MAX_LOGPROBS,
) -> None:
    """Refuse a request the engine cannot run.

    Args:
        prompt_token_ids: the prompt, token ids.
        params: its sampling parameters.
        vocab_size: token ids must be in [0, vocab_size).
        max_model_len: prompt + max_tokens must fit (tokens).
        max_logprobs: the cap on `params.logprobs`.

    Raises:
        RequestError: INVALID_ARGUMENT for a bad field ("prompt", "prompt_ids", a sampling
            field), OUT_OF_RANGE ("prompt" or "max_tokens") when the request does not fit in
            max_model_len.
    """
    _check_prompt(prompt_token_ids, vocab_size, max_model_len)
    _check_params(params, vocab_size, max_logprobs)
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise RequestError(
            ErrorCode.OUT_OF_RANGE,
            "max_tokens",
            f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
            f"({params.max_tokens}) = {total} exceeds max_model_len {max_model_len}",
        )


def truncate_prompt(
    prompt_token_ids: list[int], params: SamplingParams | int | None, max_model_len: int
) -> list[int]:
    """The prompt as `truncate_prompt_tokens` k cuts it (given as such, or as the params that
    hold it): its last k tokens (-1: the last max_model_len), vLLM's semantics; the prompt
    itself when k is None or the prompt is no longer. Idempotent, so the front end and the
    core may both apply it.

    Raises:
        RequestError: INVALID_ARGUMENT "truncate_prompt_tokens" when k is neither >= 1 nor
            -1, or k > max_model_len (as vLLM refuses it).
    """
    k = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else params
    if k is None:
        return prompt_token_ids
    if k < 1 and k != -1:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be an integer >= 1 or -1 (max_model_len), got {k}",
        )
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens: {k} is greater than max_model_len {max_model_len}",
        )
    return list(prompt_token_ids[-k:])


def check_priority(params: SamplingParams, policy: str) -> None:
    """Refuse a non-zero `priority` unless the scheduler orders by it (vLLM refuses it the
    same way: "Got priority ... but Priority scheduling is not enabled").

    Raises:
        RequestError: INVALID_ARGUMENT "priority".
    """
    if params.priority != 0 and policy != "priority":
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "priority",
            f"priority: got {params.priority}, but priority scheduling is not enabled "
            f"(--scheduling-policy {policy}; start the server with --scheduling-policy "
            "priority, or send priority 0)",
        )


def check_routed_experts(params: SamplingParams, enabled: bool) -> None:
    """Refuse `return_routed_experts` from an engine started without
    `--enable-return-routed-experts` (vLLM's flag of that name: the routing is recorded only
    when the engine was started to).

    Raises:
        RequestError: INVALID_ARGUMENT "return_routed_experts".
    """
    if params.return_routed_experts and not enabled:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "return_routed_experts",
            "return_routed_experts: this engine does not record the routed experts; start it "
            "with --enable-return-routed-experts (LLM(..., enable_return_routed_experts=True))"
            " to return them",
        )


def _check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, "prompt", "prompt: must not be empty (got 0 tokens)"
        )
    bad = _first_out_of_vocab(prompt_token_ids, vocab_size)
    if bad is not None:
        index, token = bad
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "prompt_ids",
            f"prompt_ids: token id {token} at index {index} is outside [0, {vocab_size}) "
            f"(vocab_size {vocab_size})",
        )
    if n > max_model_len:
        raise RequestError(
            ErrorCode.OUT_OF_RANGE,
            "prompt",
            f"prompt: {n} tokens is longer than max_model_len {max_model_len}; a prompt may "
            f"have at most {max_model_len - 1} tokens (--max-prompt-tokens, --max-model-len)",
        )
    if n == max_model_len:
        raise RequestError(
            ErrorCode.OUT_OF_RANGE,
            "prompt",
            f"prompt: {n} tokens leaves no room for one generated token "
            f"(max_model_len {max_model_len}; the prompt may have at most {max_model_len - 1}: "
            f"--max-prompt-tokens, --max-model-len)",
        )


def _first_out_of_vocab(token_ids: list[int], vocab_size: int) -> tuple[int, int] | None:
    """The (index, id) of the first id outside [0, vocab_size), or None."""
    if min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return None
    for i, tok in enumerate(token_ids):
        if not 0 <= tok < vocab_size:
            return i, tok
    return None


def param_error(exc: ParamError) -> RequestError:
    """The INVALID_ARGUMENT refusal for a sampling parameter at fault (its field from `exc`)."""
    message = exc.message if exc.message.startswith(exc.field) else f"{exc.field}: {exc.message}"
    return RequestError(ErrorCode.INVALID_ARGUMENT, exc.field, message)


def _check_params(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    try:
        params.verify(vocab_size, max_logprobs)
    except ParamError as exc:
        raise param_error(exc) from exc
    except (ValueError, TypeError) as exc:  # not one field's fault
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, "sampling_params", f"sampling_params: {exc}"
        ) from exc
