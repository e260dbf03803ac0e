"""Structured output (xgrammar): JSON-schema and json_object outputs of the demo checkpoint
parse and validate, batched with unconstrained requests that stay unchanged; the bitmask
touches only grammar rows and never allows the vocabulary's padding; invalid schemas are
refused naming response_format (offline API and gRPC); a cut JSON ends with "length";
preempted and parallel-sampled requests keep their own grammar state. One demo engine for
the module."""

from __future__ import annotations

import json

import grpc
import jsonschema
import msgspec
import pytest
import torch
from grpc_helpers import ServerThread

from moe_engine import LLM, SamplingParams, StructuredOutputsParams
from moe_engine.engine import messages
from moe_engine.errors import ParamError, RequestError
from moe_engine.request import Request
from moe_engine.runner.sampler import Sampler
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import EngineConfig, ModelConfig
from moe_engine.startup.demo import ensure_demo_checkpoint
from moe_engine.structured_output import StructuredOutputManager

PROMPT = "Answer in JSON:"

#: Twenty schemas of different kinds; strings are short so that a random-weight model
#: finishes them well within max_tokens.
SCHEMAS: list[dict] = [
    # 1 flat object, required integer with bounds and a short string
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
        },
        "required": ["id", "name"],
    },
    # 2 nested objects
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "admin": {"type": "boolean"},
                },
                "required": ["age", "admin"],
            }
        },
        "required": ["user"],
    },
    # 3 array with min/max items of enums
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
    },
    # 4 enum of mixed types
    {"type": "object", "properties": {"v": {"enum": ["red", 7, True, None]}}, "required": ["v"]},
    # 5 number with bounds
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
        "required": ["x"],
    },
    # 6 string pattern
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["code"],
    },
    # 7 booleans and nulls
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["ok", "none"],
    },
    # 8 anyOf
    {
        "type": "object",
        "properties": {
            "val": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}
        },
        "required": ["val"],
    },
    # 9 optional fields only
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "additionalProperties": False,
    },
    # 10 array of objects
    {
        "type": "object",
        "properties": {
            "pts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 5},
                        "y": {"type": "integer", "minimum": 0, "maximum": 5},
                    },
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["pts"],
    },
    # 11 const
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "n": {"type": "integer", "minimum": 10, "maximum": 12},
        },
        "required": ["kind", "n"],
    },
    # 12 integer exclusive bounds
    {
        "type": "object",
        "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}},
        "required": ["k"],
    },
    # 13 fixed-length array of integers
    {
        "type": "object",
        "properties": {
            "v": {
                "type": "array",
                "items": {"type": "integer", "minimum": -3, "maximum": 3},
                "minItems": 3,
                "maxItems": 3,
            }
        },
        "required": ["v"],
    },
    # 14 $defs and $ref
    {
        "type": "object",
        "$defs": {"color": {"enum": ["r", "g", "b"]}},
        "properties": {"fg": {"$ref": "#/$defs/color"}, "bg": {"$ref": "#/$defs/color"}},
        "required": ["fg", "bg"],
    },
    # 15 oneOf of objects
    {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["r"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"w": {"type": "boolean"}},
                        "required": ["w"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    # 16 nullable via type list
    {
        "type": "object",
        "properties": {"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}},
        "required": ["maybe"],
    },
    # 17 three levels deep
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"enum": [1, 2]}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    # 18 string enum list with uniqueness not enforced, empty array allowed
    {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["xs"],
    },
    # 19 short strings with length limits in an array
    {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {"type": "string", "minLength": 1, "maxLength": 3},
            }
        },
        "required": ["words"],
    },
    # 20 date-like pattern and an enum
    {
        "type": "object",
        "properties": {
            "day": {"type": "string", "pattern": "^20[0-9]{2}-0[1-9]$"},
            "unit": {"enum": ["s", "ms"]},
        },
        "required": ["day", "unit"],
        "additionalProperties": False,
    },
]


def json_params(schema: dict | None = None, **kw) -> SamplingParams:
    so = (
        StructuredOutputsParams(json=json.dumps(schema))
        if schema is not None
        else (StructuredOutputsParams(json_object=True))
    )
    return SamplingParams(structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def demo() -> str:
    return ensure_demo_checkpoint()


@pytest.fixture(scope="module")
def llm(demo: str) -> LLM:
    return LLM(model=demo, max_model_len=256, max_num_seqs=128)


def test_params_are_checked_at_construction() -> None:
    for kwargs, match in [
        (dict(), "exactly one"),
        (dict(json='{"type": "object"}', json_object=True), "exactly one"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json="[1, 2]"), "must be a JSON object, got list"),
        (dict(json=3), "as text, got int"),
        (dict(json_object="yes"), "must be a bool"),
    ]:
        with pytest.raises(ParamError, match=match) as info:
            StructuredOutputsParams(**kwargs)
        assert info.value.field == "response_format"
    with pytest.raises(ParamError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": "{}"})
    assert SamplingParams().structured_outputs is None


def test_params_round_trip_through_the_core_messages() -> None:
    params = json_params(SCHEMAS[0], max_tokens=7, n=2)
    msg = messages.EngineCoreRequest("r", [1, 2], params, 0.0)
    back = messages.decode_input(messages.encode(msg))
    assert back.sampling_params == params
    assert isinstance(back.sampling_params.structured_outputs, StructuredOutputsParams)
    bad = msgspec.msgpack.encode(["add", "r", [1], {"structured_outputs": {"json": "[1]"}}, 0.0])
    with pytest.raises(msgspec.ValidationError) as info:
        messages.decode_input(bad)
    assert isinstance(info.value.__cause__, ParamError)


def test_twenty_schemas_under_load_validate_and_leave_free_requests_unchanged(llm) -> None:
    """60 constrained requests (each schema greedy and at temperature 1 with two seeds) and
    4 unconstrained greedy ones in one generate call; the unconstrained ones equal a run
    without grammars."""
    free = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=12, temperature=1, seed=s, ignore_eos=True) for s in (7, 8)
    ]
    free_prompts = ["def main():", "import os", "class A:", "return x"]
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    constrained = [
        json_params(schema, max_tokens=48, temperature=t, seed=seed)
        for schema in SCHEMAS
        for t, seed in ((0, None), (1, 1), (1, 2))
    ]
    prompts = [PROMPT] * len(constrained) + free_prompts
    outs = llm.generate(prompts, constrained + free, use_tqdm=False)
    for i, out in enumerate(outs[: len(constrained)]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[i // 3])
    for mixed, solo in zip(outs[len(constrained) :], alone, strict=True):
        assert mixed.outputs[0].token_ids == solo.outputs[0].token_ids
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.plan.num_blocks


def test_json_object_outputs_are_objects(llm) -> None:
    """Any-object outputs that finish parse to a dict; free keys of a random model may run to
    max_tokens (then "length", and the text need not parse, as in vLLM)."""
    params = [json_params(None, max_tokens=64, temperature=1, seed=s) for s in range(8)]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 8, params, use_tqdm=False)]
    done = [c for c in outs if c.finish_reason == "stop"]
    assert done, [c.text for c in outs]
    for c in done:
        assert isinstance(json.loads(c.text), dict)
    for c in outs:
        assert c.finish_reason in ("stop", "length") and c.text.startswith("{")


def test_max_tokens_cuts_the_json_with_finish_reason_length(llm) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "boolean"},
              "minItems": 6, "maxItems": 6}}, "required": ["v"]}  # fmt: skip
    (out,) = llm.generate(PROMPT, json_params(schema, max_tokens=5, temperature=0), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)  # documented: a cut JSON need not parse


@pytest.mark.parametrize(
    "schema, reason",
    [
        ('{"type": "foo"}', 'Unsupported type "foo"'),
        ('{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}', "nope"),
    ],
)
def test_a_schema_xgrammar_refuses_names_response_format(llm, schema, reason) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(RequestError, match="response_format") as info:
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert info.value.field == "response_format" and reason in info.value.message
    assert "json_schema_converter.cc" not in info.value.message
    assert not llm.engine.has_unfinished_requests()


def test_parallel_sampling_gives_each_completion_its_own_grammar(llm) -> None:
    schema = SCHEMAS[2]
    (out,) = llm.generate(
        PROMPT, json_params(schema, max_tokens=48, temperature=1, seed=3, n=4), use_tqdm=False
    )
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_preempted_requests_keep_their_grammar_state(demo) -> None:
    """A pool of 6 blocks of 16 for 8 requests of up to 8 + 40 tokens: requests are preempted
    and recomputed from prompt + output (whose grammar state, that of the output so far, is
    kept), and still validate."""
    schemas = [SCHEMAS[i] for i in (0, 1, 9, 12, 14, 16, 19, 2)]
    params = [json_params(s, max_tokens=40, temperature=1, seed=i) for i, s in enumerate(schemas)]
    small = LLM(model=demo, max_model_len=64, num_blocks_override=6)
    outs = small.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for out, schema in zip(outs, schemas, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_bitmask_touches_only_grammar_rows_and_never_padding(demo) -> None:
    """The model's vocabulary padded 40 ids past the tokenizer's: a grammar row allows only
    what its matcher allows (none of the padding), the other rows keep their logits."""
    from moe_engine.core.tokenizer import load_tokenizer

    tok = load_tokenizer(demo)
    vocab = len(tok) + 40
    manager = StructuredOutputManager(tok, vocab, frozenset({tok.eos_token_id}))
    compiled = manager.compile(StructuredOutputsParams(json_object=True))
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0)) for i in range(3)]
    reqs[1].grammar = manager.new_grammar(compiled)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    sampler = Sampler(max_num_seqs=4)
    assert sampler.grammar_bitmask.apply(logits, reqs) == [1]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert allowed.sum() >= 1 and not allowed[len(tok) :].any()
    assert torch.equal(logits[1][allowed], before[1][allowed])
    first = [t for t in range(len(tok)) if tok.decode([t]).lstrip().startswith("{")]
    assert set(allowed.nonzero().flatten().tolist()) <= set(first)
    token = sampler(before.clone(), reqs).token_ids[1]
    assert allowed[token]  # the sampler applies the mask itself


def test_grpc_json_schema_round_trip(demo) -> None:
    config = EngineConfig(model=ModelConfig(model=demo, max_model_len=128))
    handle = ServerThread(config, ServerOptions(port=0))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            schema = SCHEMAS[3]
            req = pb.GenerateRequest(
                text=PROMPT, max_tokens=32, temperature=0, json_schema=json.dumps(schema)
            )
            responses = list(stub.Generate(req, timeout=60))
            assert responses[-1].finished and responses[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)
            for bad in ("[1]", '{"type": "foo"}'):
                with pytest.raises(grpc.RpcError) as info:
                    list(
                        stub.Generate(pb.GenerateRequest(text=PROMPT, json_schema=bad), timeout=60)
                    )
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "response_format" in info.value.details()
    finally:
        handle.close()


def test_no_control_bytes_bitmask_packs_like_xgrammar() -> None:
    """Bit t % 32 of word t // 32 is set exactly for tokens free of bytes below 0x20 (bit 31
    included: the words are int32)."""
    from moe_engine.structured_output import no_control_bytes_bitmask

    vocab = [b"a", b"\x08", b"<|eos|>", b"\n"] + [b"x"] * 28 + [b"\x1f", b"ok", b""]
    words = no_control_bytes_bitmask(vocab)
    assert words.dtype == torch.int32 and words.shape == (2,)
    bits = [(int(words[t // 32]) >> (t % 32)) & 1 for t in range(len(vocab))]
    assert bits == [min(t, default=0x20) >= 0x20 for t in vocab]
    assert int(words[0]) < 0  # token 31 ("x") sets the sign bit
