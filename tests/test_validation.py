"""validate_request: each bad request names its field, value and limit."""

from __future__ import annotations

import math

import pytest

from moe_engine.core.validation import validate_request
from moe_engine.errors import ErrorCode, ParamError, RequestError
from moe_engine.sampling_params import SamplingParams

CASES = [
    ([], {}, ErrorCode.INVALID_ARGUMENT, "prompt", "0 tokens"),
    ([1, -1], {}, ErrorCode.INVALID_ARGUMENT, "prompt_ids", "-1"),
    ([1, 100], {}, ErrorCode.INVALID_ARGUMENT, "prompt_ids", "[0, 100)"),
    ([1] * 65, {}, ErrorCode.OUT_OF_RANGE, "prompt", "64"),
    ([1] * 64, {}, ErrorCode.OUT_OF_RANGE, "prompt", "at most 63"),
    ([1] * 60, {"max_tokens": 5}, ErrorCode.OUT_OF_RANGE, "max_tokens", "60"),
    ([1], {"max_tokens": 0}, ErrorCode.INVALID_ARGUMENT, "max_tokens", "got 0"),
    ([1], {"min_tokens": 3, "max_tokens": 2}, ErrorCode.INVALID_ARGUMENT, "min_tokens", "3"),
    ([1], {"temperature": math.nan}, ErrorCode.INVALID_ARGUMENT, "temperature", "nan"),
    ([1], {"temperature": -1.0}, ErrorCode.INVALID_ARGUMENT, "temperature", "-1"),
    ([1], {"top_p": 0.0}, ErrorCode.INVALID_ARGUMENT, "top_p", "(0, 1]"),
    ([1], {"top_k": 0}, ErrorCode.INVALID_ARGUMENT, "top_k", "got 0"),
    ([1], {"logprobs": 21}, ErrorCode.INVALID_ARGUMENT, "logprobs", "20"),
    ([1], {"stop": [""]}, ErrorCode.INVALID_ARGUMENT, "stop", "empty"),
    ([1], {"stop_token_ids": [100]}, ErrorCode.INVALID_ARGUMENT, "stop_token_ids", "100"),
    # stop conditions are checked on every token inside the step loop: bounded per request
    ([1], {"stop": ["a"] * 65}, ErrorCode.INVALID_ARGUMENT, "stop", "at most 64"),
    ([1], {"stop": ["a" * 1025]}, ErrorCode.INVALID_ARGUMENT, "stop", "at most 1024"),
    ([1], {"stop_token_ids": [1] * 1025}, ErrorCode.INVALID_ARGUMENT, "stop_token_ids",
     "at most 1024"),
]


@pytest.mark.parametrize(("prompt", "fields", "code", "field", "needle"), CASES)
def test_refusals_name_field_and_limit(prompt, fields, code, field, needle) -> None:
    # Limits that need no model are refused by SamplingParams itself (ParamError, at
    # construction); the vocabulary and logprobs caps by validate_request (RequestError).
    with pytest.raises((RequestError, ParamError)) as info:
        validate_request(prompt, SamplingParams(**fields), vocab_size=100, max_model_len=64)
    err = info.value
    assert isinstance(err, RequestError) or code == ErrorCode.INVALID_ARGUMENT
    assert getattr(err, "code", ErrorCode.INVALID_ARGUMENT) == code and err.field == field
    assert field in err.message and needle in err.message


def test_out_of_range_states_limit_and_both_counts() -> None:
    with pytest.raises(RequestError) as info:
        validate_request([1] * 60, SamplingParams(max_tokens=7), vocab_size=100, max_model_len=64)
    assert all(str(n) in info.value.message for n in (60, 7, 64))


def test_fitting_request_passes() -> None:
    validate_request([1] * 60, SamplingParams(max_tokens=4), vocab_size=100, max_model_len=64)
    validate_request([0, 99], SamplingParams(), vocab_size=100, max_model_len=64)
