"""SamplingParams checks its fields when it is made (vLLM's SamplingParams does too): each
refusal is a ParamError naming the field, the value and the limit; stop fields normalise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_engine.errors import ParamError
from moe_engine.sampling_params import MAX_N, SamplingParams

REFUSED = [
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"temperature": math.inf}, "temperature", "inf"),
    ({"temperature": "hot"}, "temperature", "'hot'"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_p": math.nan}, "top_p", "nan"),
    ({"top_k": 2.5}, "top_k", "2.5"),
    ({"top_k": 0}, "top_k", "got 0"),
    ({"max_tokens": True}, "max_tokens", "True (bool)"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 4.0}, "max_tokens", "4.0 (float)"),
    ({"min_tokens": -1}, "min_tokens", ">= 0"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens (4)"),
    ({"n": 0}, "n", f"[1, {MAX_N}]"),
    ({"n": MAX_N + 1}, "n", str(MAX_N + 1)),
    ({"n": 2.0}, "n", "2.0 (float)"),
    ({"n": "2"}, "n", "'2' (str)"),
    ({"seed": 2**64}, "seed", str(2**64 - 1)),
    ({"seed": -(2**63) - 1}, "seed", str(-(2**63))),
    ({"seed": 2**64 - 2, "n": 4}, "seed", "seed + i"),
    ({"seed": 1.5}, "seed", "1.5"),
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"logprobs": True}, "logprobs", "bool"),
    ({"ignore_eos": 1}, "ignore_eos", "bool"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "bool"),
    ({"skip_special_tokens": None}, "skip_special_tokens", "bool"),
    ({"return_routed_experts": "yes"}, "return_routed_experts", "bool"),
    ({"return_routed_experts": 1}, "return_routed_experts", "bool"),
    ({"stop": [""]}, "stop", "empty"),
    ({"stop": ["a", 3]}, "stop", "3"),
    ({"stop": 3}, "stop", "int"),
    ({"stop": ["a"] * 65}, "stop", "at most 64"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids", "1.5"),
    ({"stop_token_ids": [-2]}, "stop_token_ids", "-2"),
    ({"stop_token_ids": "7"}, "stop_token_ids", "str"),
]


@pytest.mark.parametrize(("fields", "field", "needle"), REFUSED)
def test_refused_at_construction_naming_field_value_and_limit(fields, field, needle):
    with pytest.raises(ParamError) as info:
        SamplingParams(**fields)
    err = info.value
    assert isinstance(err, ValueError) and err.field == field
    assert str(err).startswith(field) and needle in str(err), str(err)


def test_stop_fields_normalise_like_vllm():
    assert SamplingParams(stop="abc").stop == ["abc"]  # one stop string, not three
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams().stop == []
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(np.int64(3), 4)).stop_token_ids == [3, 4]


def test_accepted_values_and_their_types():
    p = SamplingParams(max_tokens=np.int32(8), temperature=1, top_p=np.float32(0.5), n=3,
                       seed=2**64 - 3, top_k=-1, logprobs=0)
    assert (p.max_tokens, p.temperature, p.top_p, p.n) == (8, 1.0, 0.5, 3)
    assert type(p.max_tokens) is int and type(p.temperature) is float
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=0).greedy


def test_verify_checks_model_limits_and_later_changes_with_the_field():
    p = SamplingParams(stop_token_ids=[99], logprobs=5)
    p.verify(vocab_size=100, max_logprobs=5)
    with pytest.raises(ParamError) as info:
        p.verify(vocab_size=99)
    assert info.value.field == "stop_token_ids" and "[0, 99)" in str(info.value)
    with pytest.raises(ParamError) as info:
        p.verify(vocab_size=100, max_logprobs=4)
    assert info.value.field == "logprobs" and "[0, 4]" in str(info.value)
    p.seed = 2**64  # changed after construction: verify (add_request) still refuses it
    with pytest.raises(ParamError) as info:
        p.verify(vocab_size=100)
    assert info.value.field == "seed"
