"""Property-based fuzzing of `Generate` over loopback (hypothesis), on the tiny real checkpoint
with a small byte-level BPE tokenizer, so that text prompts and stop strings reach the real
tokenizer, detokenizer, scheduler and sampler.

Two generators: well-formed GenerateRequests with extreme field values (huge and negative
numbers, NaN and infinities, any Unicode text, up to 64 stop strings), and raw protobuf wire
bytes the Python protobuf library refuses to build (invalid UTF-8 in text, stop strings and
request_id, wrong wire types, unknown fields, truncated messages, random bytes). Every answer
must be a complete stream (exactly one final response) or a status the API documents for bad
requests (INVALID_ARGUMENT, OUT_OF_RANGE), the engine must stay up, and afterwards a normal
request still works and every KV block is free.
"""

from __future__ import annotations

import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_helpers import ServerThread, request, stats, wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

MAX_MODEL_LEN = 48
NUM_BLOCKS = 64
MAX_MESSAGE_BYTES = 8 * 1024
VOCAB = 512
#: Statuses a bad request may get (the proto's documented refusals).
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GENERATE = "/moe_engine.v1.MoeEngine/Generate"
#: How the fuzzed calls ended, per test: {"served": n, "refused": n}.
OUTCOMES: dict[str, dict[str, int]] = {}


def _write_tokenizer(path: Path) -> None:
    """A 512-token byte-level BPE (the demo's recipe, smaller) saved into `path`."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [Path(__file__).read_text()] * 4
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = tmp_path_factory.mktemp("fuzz") / "qwen3-with-tokenizer"
    shutil.copytree(qwen3_ckpt, model)
    _write_tokenizer(model)
    config = EngineConfig(
        model=ModelConfig(str(model), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    handle = ServerThread(config, ServerOptions(port=0, max_message_bytes=MAX_MESSAGE_BYTES))
    assert handle.server.engine.model_info.has_tokenizer
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _check_answer(server: ServerThread, call: grpc.Call, test: str) -> None:
    """The stream ends with exactly one final response, or with a documented refusal."""
    counts = OUTCOMES.setdefault(test, {"served": 0, "refused": 0})
    try:
        responses = list(call)
    except grpc.RpcError as err:
        assert err.code() in REFUSALS, (err.code(), err.details())
        field = dict(err.trailing_metadata()).get("moe-field")
        assert field and field in err.details(), (field, err.details())  # names the field
        counts["refused"] += 1
    else:
        assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
        assert responses[-1].finish_reason in ("stop", "length")
        assert all(0 <= t < VOCAB for r in responses for t in r.token_ids)
        counts["served"] += 1
    assert not server.server.engine.dead.is_set(), server.server.engine.death_reason


# ------------------------------------------------------------------- well-formed messages

INT32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1), st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1])
)
SMALL = st.integers(-3, MAX_MODEL_LEN + 3)
DOUBLE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-5, 1.0, 1e308, math.nan, math.inf]),
)


#: Values of the sampling fields: anything of the field's type (_ANY), or within the limits
#: the proto documents (_VALID).
_ANY = {
    "max_tokens": st.one_of(SMALL, INT32),
    "min_tokens": st.one_of(SMALL, INT32),
    "temperature": DOUBLE,
    "top_p": DOUBLE,
    "top_k": st.one_of(SMALL, INT32),
    "logprobs": st.one_of(st.integers(-2, 22), INT32),
}
_VALID = {
    "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 1),
    "temperature": st.one_of(st.just(0.0), st.floats(1e-6, 1e6)),
    "top_p": st.floats(1e-300, 1.0, exclude_min=False),
    "top_k": st.one_of(st.just(-1), st.integers(1, 2**31 - 1)),
    "logprobs": st.integers(0, 20),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Half the requests keep every field within its limits (so they run, with random sampling
    settings, Unicode text and stop strings); the others may carry any value."""
    valid = draw(st.booleans())
    values = _VALID if valid else _ANY
    req = pb.GenerateRequest(request_id=draw(st.text(max_size=20)))
    if draw(st.booleans()):
        req.text = draw(st.text(min_size=int(valid), max_size=60))
    elif valid or draw(st.booleans()):
        ids = st.integers(0, VOCAB - 1) if valid else st.one_of(INT32, st.integers(0, VOCAB - 1))
        req.prompt_ids.ids.extend(draw(st.lists(ids, min_size=int(valid), max_size=30)))
        req.prompt_ids.SetInParent()
    for name, strategy in values.items():
        if draw(st.booleans()):
            setattr(req, name, draw(strategy))
    if draw(st.booleans()):
        req.seed = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        req.ignore_eos = draw(st.booleans())
    stop = st.text(min_size=int(valid), max_size=8)
    req.stop.extend(draw(st.lists(stop, max_size=draw(st.sampled_from([3, 64])))))
    stop_ids = st.integers(0, VOCAB - 1) if valid else st.one_of(INT32, st.integers(0, VOCAB))
    req.stop_token_ids.extend(draw(st.lists(stop_ids, max_size=4)))
    return req


@FUZZ
@given(req=generate_requests())
def test_fuzz_well_formed_requests(
    server: ServerThread, channel: grpc.Channel, req: pb.GenerateRequest
) -> None:
    stub = pb_grpc.MoeEngineStub(channel)
    _check_answer(server, stub.Generate(req, timeout=60), "well-formed")


# --------------------------------------------------------------------------- wire bytes


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 are sent as 10-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes | int) -> bytes:
    tag = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return tag + _varint(int(payload))
    if wire_type == 2:
        assert isinstance(payload, bytes)
        return tag + _varint(len(payload)) + payload
    assert isinstance(payload, bytes)
    return tag + payload  # fixed64 (1) and fixed32 (5): payload already 8 or 4 bytes


BYTES = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok"]),
    st.text(max_size=20).map(str.encode),
)
VARINT = st.one_of(st.integers(-(2**63), 2**64 - 1), SMALL)


@st.composite
def wire_fields(draw: st.DrawFn) -> bytes:
    """One field: a known one with a right or wrong wire type, or an unknown one."""
    number = draw(st.one_of(st.integers(1, 13), st.integers(14, 2**29 - 1)))
    choice = draw(st.sampled_from(["varint", "bytes", "fixed64", "fixed32", "ids"]))
    if choice == "varint":
        return _field(number, 0, draw(VARINT))
    if choice == "bytes":
        return _field(number, 2, draw(BYTES))
    if choice == "fixed64":
        doubles = DOUBLE.map(lambda x: struct.pack("<d", x))
        value = draw(st.one_of(doubles, st.binary(min_size=8, max_size=8)))
        return _field(number, 1, value)
    if choice == "fixed32":
        return _field(number, 5, draw(st.binary(min_size=4, max_size=4)))
    ids = b"".join(_varint(v) for v in draw(st.lists(VARINT, max_size=20)))
    packed = _field(1, 2, ids) if draw(st.booleans()) else ids  # TokenIds, or raw varints
    return _field(number, 2, packed)


@st.composite
def wire_messages(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))  # noise
    fields = draw(st.lists(wire_fields(), max_size=8))
    if draw(st.booleans()):  # a plausible prompt, so that more messages get past validation
        fields.insert(0, _field(3, 2, _field(1, 2, bytes([5, 6, 7]))))
        fields.append(_field(4, 0, draw(st.integers(1, 8))))
    message = b"".join(fields)
    if message and draw(st.integers(0, 5)) == 0:
        message = message[: draw(st.integers(0, len(message) - 1))]  # truncated
    return message


@FUZZ
@given(payload=wire_messages())
def test_fuzz_raw_wire_bytes(server: ServerThread, channel: grpc.Channel, payload: bytes) -> None:
    raw = channel.unary_stream(
        GENERATE, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
    )
    _check_answer(server, raw(payload, timeout=60), "raw")


def test_server_still_serves_and_frees_every_block(
    server: ServerThread, channel: grpc.Channel
) -> None:
    # Both fuzzers reached the engine, not only the validation (with derandomize the counts
    # are fixed for a given hypothesis version).
    for test in ("well-formed", "raw"):
        assert OUTCOMES[test]["served"] >= 10 and OUTCOMES[test]["refused"] >= 10, OUTCOMES
    stub = pb_grpc.MoeEngineStub(channel)
    out = list(stub.Generate(request([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)))
    assert out[-1].finished and out[-1].usage.completion_tokens == 4
    wait_idle(stub, NUM_BLOCKS)
    assert stats(stub).num_running == 0
