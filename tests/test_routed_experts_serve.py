"""Routing replay end to end (issue 45) on the tiny Qwen3-MoE: a server started with
--enable-return-routed-experts gives one greedy request's routed experts identically over
HTTP (completions whole and streamed, chat), gRPC and the offline `LLM`, decoded from base64
to [prompt + output - 1, moe_layers, top_k] logical expert ids; a server started without the
flag refuses the field with a 400 (OpenAI's error shape) / INVALID_ARGUMENT naming the flag,
and serves on. (That the ids equal transformers' router top-k is the engine's test,
tests/test_routed_experts.py.)
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_helpers import ServerThread, request
from http_helpers import (
    API_KEY,
    MAX_MESSAGE_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    NUM_BLOCKS,
    Grpc,
    start_server,
    tokenizer_checkpoint,
)

from moe_engine import LLM, SamplingParams
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 6
FLAG = "--enable-return-routed-experts"


@pytest.fixture(scope="module")
def ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("replay"))


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        enable_return_routed_experts=True,
    )
    opts = ServerOptions(port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
                         max_message_bytes=MAX_MESSAGE_BYTES, log_stats_interval_s=None)
    handle = ServerThread(config, opts)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> Iterator[ServerThread]:
    """The same model, started without the flag."""
    handle = start_server(ckpt)
    yield handle
    handle.close()


def url(handle: ServerThread, path: str) -> str:
    return f"http://127.0.0.1:{handle.server.http_port}{path}"


def decoded(entry: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(entry["routed_experts"], validate=True)
    return np.frombuffer(raw, "<i4").reshape(entry["routed_experts_shape"])


def final_entry(handle: ServerThread, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The streamed choice's chunk entry with finish_reason (the only one with the ids)."""
    with httpx.stream("POST", url(handle, path), json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    entries = [e for line in lines for e in json.loads(line[6:])["choices"]]
    assert all("routed_experts" not in e for e in entries if e["finish_reason"] is None)
    (last,) = [e for e in entries if e["finish_reason"] is not None]
    return last


def test_http_grpc_and_llm_agree(server: ServerThread, ckpt: Path) -> None:
    greedy = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "return_routed_experts": True}
    resp = httpx.post(url(server, "/v1/completions"), json={**greedy, "prompt": PROMPT,
                      "return_token_ids": True}, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = decoded(choice)
    rpc = Grpc(server.address)
    try:
        moe_layers = len(rpc.stub.GetExpertLoad(pb.GetExpertLoadRequest(),
                                                metadata=rpc.metadata).layers)
        responses = rpc.generate(request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                         ignore_eos=True, return_routed_experts=True))
    finally:
        rpc.close()
    info = server.server.engine.model_info
    assert moe_layers >= 1
    assert ids.shape == (len(PROMPT) + MAX_TOKENS - 1, moe_layers, info.num_experts_per_tok)
    assert ids.min() >= 0 and ids.max() < info.num_experts
    assert all(len(set(row)) == len(row) for row in ids.reshape(-1, ids.shape[-1]).tolist())
    last = responses[-1]
    assert last.finished and [r for r in responses if r.routed_experts] == [last]
    assert last.routed_experts == ids.astype("<i4").tobytes()
    assert list(last.routed_experts_shape) == list(ids.shape)
    streamed = final_entry(server, "/v1/completions", {**greedy, "prompt": PROMPT})
    np.testing.assert_array_equal(decoded(streamed), ids)

    llm = LLM(str(ckpt), max_model_len=MAX_MODEL_LEN, enable_return_routed_experts=True)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True, return_routed_experts=True),
                       use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == choice["token_ids"]
    np.testing.assert_array_equal(out.routed_experts, ids)


def test_chat_whole_equals_streamed(server: ServerThread) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_routed_experts": True}
    resp = httpx.post(url(server, "/v1/chat/completions"), json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    tokens = data["usage"]["prompt_tokens"] + 4 - 1
    whole = [decoded(c) for c in data["choices"]]
    assert [w.shape[0] for w in whole] == [tokens, tokens]
    np.testing.assert_array_equal(whole[0], whole[1])  # greedy: the same tokens, routing
    with httpx.stream("POST", url(server, "/v1/chat/completions"), json={**body, "n": 1,
                      "stream": True}, headers=AUTH, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    (last,) = [e for line in lines for e in json.loads(line[6:])["choices"]
               if e["finish_reason"] is not None]
    np.testing.assert_array_equal(decoded(last), whole[0])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_without_the_flag_http_400_names_it(plain: ServerThread, path, body, stream) -> None:
    full = {"model": MODEL, "max_tokens": 2, "return_routed_experts": True, "stream": stream,
            **body}
    resp = httpx.post(url(plain, path), json=full, headers=AUTH, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "return_routed_experts" and FLAG in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = httpx.post(url(plain, path), json={**full, "return_routed_experts": False},
                    headers=AUTH, timeout=60)
    assert ok.status_code == 200  # still serving


def test_without_the_flag_grpc_invalid_argument_names_it(plain: ServerThread) -> None:
    rpc = Grpc(plain.address)
    try:
        with pytest.raises(grpc.RpcError) as info:
            rpc.generate(request(PROMPT, max_tokens=2, return_routed_experts=True))
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and FLAG in err.details()
        assert ("moe-field", "return_routed_experts") in tuple(err.trailing_metadata())
        assert rpc.generate(request(PROMPT, max_tokens=2))[-1].finished
    finally:
        rpc.close()
