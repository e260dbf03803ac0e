"""Routing replay on the front ends (issue 45): what HTTP /v1/completions, /v1/chat/completions,
gRPC Generate and `moe-client generate` make of the engine's `routed_experts`.

One server (tiny Qwen3-MoE with a tokenizer) on `routed_core`: the real engine, whose finished
outputs carry synthetic ids (`routed_core.synthetic_routed`) for the requests that asked, so
every check below compares against a known array: each HTTP choice (n = 2, streamed and
whole, completions and chat) carries its own base64 of the raw little-endian int32 ids and
their shape [prompt + output - 1, layers, top_k], only on a finished choice (a stream's chunk
with finish_reason); gRPC's finished response carries the same bytes and shape; a request
without the field gets neither; a non-boolean value is a 400 naming the field; moe-router
refuses the field.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from grpc_helpers import ServerThread, request
from http_helpers import API_KEY, MODEL, Grpc, tokenizer_checkpoint
from routed_core import start_routed_server, synthetic_routed

from moe_engine.cli import client as cli
from moe_engine.disagg.router_engine import RouterEngine
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 6, 7, 8, 9]
ASK = {"return_routed_experts": True, "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    handle = start_routed_server(tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("re")))
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def dims(server: ServerThread) -> tuple[int, int, int]:
    info = server.server.engine.model_info
    return info.num_layers, info.num_experts_per_tok, info.num_experts


@pytest.fixture(scope="module")
def rpc(server: ServerThread) -> Iterator[Grpc]:
    handle = Grpc(server.address)
    yield handle
    handle.close()


def decoded(entry: dict[str, Any]) -> np.ndarray:
    """A choice's routed experts as the documented recipe decodes them."""
    raw = base64.b64decode(entry["routed_experts"], validate=True)
    return np.frombuffer(raw, "<i4").reshape(entry["routed_experts_shape"])


def check_choice(entry: dict[str, Any], prompt_len: int, output_len: int,
                 dims: tuple[int, int, int]) -> None:
    tokens = prompt_len + output_len - 1
    assert entry["routed_experts_shape"] == [tokens, dims[0], dims[1]]
    np.testing.assert_array_equal(decoded(entry), synthetic_routed(tokens, entry["index"], *dims))


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, headers=AUTH,
                      timeout=60)


def stream_chunks(base_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE payloads of a streamed request ([DONE] checked and dropped)."""
    with httpx.stream("POST", f"{base_url}{path}", json={"model": MODEL, "stream": True, **body},
                      headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def finals(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's chunk entry with finish_reason; no other entry may carry routed experts."""
    out = {}
    for chunk in chunks:
        for entry in chunk["choices"]:
            if entry["finish_reason"] is not None:
                assert entry["index"] not in out
                out[entry["index"]] = entry
            else:
                assert "routed_experts" not in entry and "routed_experts_shape" not in entry
    return out


def test_completions_whole_n2_each_choice_its_own(base_url, dims) -> None:
    resp = post(base_url, "/v1/completions", {"prompt": PROMPT, "n": 2, "temperature": 1.0,
                                              "seed": 3, **ASK})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        check_choice(c, len(PROMPT), 5, dims)
    assert choices[0]["routed_experts"] != choices[1]["routed_experts"]


def test_completions_streamed_only_on_the_final_chunk(base_url, dims) -> None:
    chunks = stream_chunks(base_url, "/v1/completions",
                           {"prompt": PROMPT, "n": 2, "temperature": 0, **ASK})
    last = finals(chunks)
    assert sorted(last) == [0, 1]
    for entry in last.values():
        check_choice(entry, len(PROMPT), 5, dims)


def test_completions_two_prompts(base_url, dims) -> None:
    prompts = [PROMPT, [11, 12, 13]]
    resp = post(base_url, "/v1/completions", {"prompt": prompts, "temperature": 0, **ASK})
    assert resp.status_code == 200, resp.text
    for c in resp.json()["choices"]:
        tokens = len(prompts[c["index"]]) + 5 - 1
        assert c["routed_experts_shape"] == [tokens, dims[0], dims[1]]
        np.testing.assert_array_equal(decoded(c), synthetic_routed(tokens, 0, *dims))


def test_chat_whole_and_streamed_n2(base_url, dims) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "n": 2, "temperature": 0, **ASK}
    whole = post(base_url, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    data = whole.json()
    prompt_len = data["usage"]["prompt_tokens"]
    for c in data["choices"]:
        check_choice(c, prompt_len, 5, dims)
    streamed = finals(stream_chunks(base_url, "/v1/chat/completions", body))
    assert sorted(streamed) == [0, 1]
    for i, entry in streamed.items():
        check_choice(entry, prompt_len, 5, dims)
        assert entry["routed_experts"] == data["choices"][i]["routed_experts"]


def test_not_asked_changes_nothing(base_url, rpc) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    choice = post(base_url, "/v1/completions", body).json()["choices"][0]
    assert "routed_experts" not in choice and "routed_experts_shape" not in choice
    for chunk in stream_chunks(base_url, "/v1/completions", body):
        for entry in chunk["choices"]:
            assert "routed_experts" not in entry
    last = rpc.generate(request(PROMPT, max_tokens=3, temperature=0.0))[-1]
    assert last.finished and not last.routed_experts and not last.routed_experts_shape


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_non_boolean_is_a_400_naming_the_field(base_url, value) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = post(base_url, path, {**body, "max_tokens": 2, "return_routed_experts": value})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "return_routed_experts"
        assert "return_routed_experts" in error["message"]
    assert post(base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code \
        == 200  # still serving


@pytest.mark.parametrize("final_only", [False, True])
def test_grpc_finished_response_carries_bytes_and_shape(rpc, dims, final_only) -> None:
    responses = rpc.generate(request(PROMPT, max_tokens=5, ignore_eos=True, temperature=1.0,
                                     seed=1, n=2, return_routed_experts=True,
                                     final_only=final_only))
    finished = {r.index: r for r in responses if r.finished}
    assert sorted(finished) == [0, 1]
    for r in responses:
        if not r.finished:
            assert not r.routed_experts and not r.routed_experts_shape
    tokens = len(PROMPT) + 5 - 1
    for index, r in finished.items():
        assert list(r.routed_experts_shape) == [tokens, dims[0], dims[1]]
        assert r.routed_experts == synthetic_routed(tokens, index, *dims).astype("<i4").tobytes()


def test_moe_client_prints_shape_and_rows(server, dims, capsys) -> None:
    base = ["--server", server.address, "--api-key", API_KEY, "generate", "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-tokens", "5", "--ignore-eos", "--temperature",
            "0", "--return-routed-experts"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    tokens = len(PROMPT) + 5 - 1
    expected = synthetic_routed(tokens, 0, *dims)
    assert f"routed_experts: {tokens} tokens x {dims[0]} MoE layers x top-{dims[1]}" in out
    assert f"  token 1: {expected[1].tolist()}" in out
    assert cli.main([*base, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["routed_experts_shape"] == [tokens, dims[0], dims[1]]
    np.testing.assert_array_equal(decoded({**data, "index": 0}), expected)
    # the weight labels too (new-user trial: --json printed none of them)
    assert data["weight_versions"] == [{"weight_version": "default", "start": 0}]
    assert data["weight_version"] == "default" and data["kv_from_other_weights"] is False


def test_moe_router_refuses_it_naming_the_field() -> None:
    """Disaggregation does not carry the prompt's routing: refused, not answered without it."""
    async def first() -> None:
        stream = RouterEngine(pairing=None).generate(  # type: ignore[arg-type]
            "r", [1, 2], SamplingParams(return_routed_experts=True))
        await anext(stream)

    with pytest.raises(RequestError) as info:
        asyncio.run(first())
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.field == "return_routed_experts"
