"""Client disconnects on the HTTP API (and gRPC), on one server: a NON-streamed generation
request whose client goes away is aborted in the engine on every endpoint (/v1/completions,
/v1/chat/completions, /v1/responses, /v1/messages), its KV blocks freed at once; every request
that ends without finishing, streamed or not, is counted exactly once under vLLM's
`vllm:request_success_total{finished_reason="abort"}`; streamed choices carry `stop_reason`
(on the chunk with the finish_reason, null before it) as vLLM's do."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_helpers import ServerThread, request
from http_helpers import API_KEY, MODEL, Grpc, tokenizer_checkpoint, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from moe_engine.server.app import ServerOptions
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

#: The tiny model's max_position_embeddings: a request of ~1000 tokens runs for seconds.
MAX_MODEL_LEN = 1024
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
AUTH = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY}
#: The client's timeout on a non-streamed request (s): it leaves long before the end.
CLIENT_TIMEOUT_S = 0.5
#: How soon after the client left nothing may run and every KV block must be free (s).
IDLE_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    ckpt = tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("disconnect"))
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=4 * MAX_MODEL_LEN // 16),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    )
    opts = ServerOptions(port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
                         log_stats_interval_s=None)
    handle = ServerThread(config, opts)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def rpc(server: ServerThread) -> Iterator[Grpc]:
    handle = Grpc(server.address)
    yield handle
    handle.close()


def _successes(base_url: str) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=10).text
    return {s.labels["finished_reason"]: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "vllm:request_success_total"}


def _moved(base_url: str, before: dict[str, float]) -> dict[str, float]:
    after = _successes(base_url)
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


#: (path, body) of one long request per generation endpoint.
LONG_REQUESTS = [
    ("/v1/completions", {"model": MODEL, "prompt": "once upon a time", **LONG}),
    ("/v1/chat/completions", {"model": MODEL, **LONG,
                              "messages": [{"role": "user", "content": "tell a story"}]}),
    # (Responses and Messages have no ignore_eos: the tiny model's greedy answer runs long.)
    ("/v1/responses", {"model": MODEL, "input": "tell a story", "max_output_tokens": 1000,
                       "temperature": 0}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1000, "temperature": 0,
                      "messages": [{"role": "user", "content": "tell a story"}]}),
]


@pytest.mark.parametrize(("path", "body"), LONG_REQUESTS, ids=lambda v: str(v)[:22])
def test_non_streamed_client_timeout_aborts(base_url, rpc, path, body) -> None:
    """The client gives up after 0.5 s of a ~1000-token answer: the request is aborted (one
    more num_aborted, one more finished_reason="abort", no "length"), nothing runs and every
    KV block is free within seconds, and the server keeps serving."""
    before, metrics = rpc.stats(), _successes(base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}{path}", json=body, headers=AUTH, timeout=CLIENT_TIMEOUT_S)
    after = wait_idle(rpc, timeout_s=IDLE_WITHIN_S)
    assert after.num_aborted == before.num_aborted + 1
    assert after.num_finished == before.num_finished
    assert _moved(base_url, metrics) == {"abort": 1}
    ok = httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=30,
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_streamed_disconnects_count_once_as_abort(base_url, rpc) -> None:
    """Streams left after a few events on every endpoint, and a cancelled gRPC stream: the
    abort counter moves by exactly their number, as the engine's num_aborted does."""
    before, metrics = rpc.stats(), _successes(base_url)
    rounds = 2
    for _ in range(rounds):
        for path, body in LONG_REQUESTS:
            with httpx.stream("POST", f"{base_url}{path}", headers=AUTH, timeout=30,
                              json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = list(itertools.islice(r.iter_lines(), 8))
            assert len(lines) == 8
    call = rpc.stub.Generate(request([5, 6, 7], max_tokens=1000, ignore_eos=True),
                             metadata=rpc.metadata, timeout=30)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    cancelled = rounds * len(LONG_REQUESTS) + 1
    after = wait_idle(rpc, timeout_s=IDLE_WITHIN_S)
    assert after.num_aborted - before.num_aborted == cancelled
    deadline = time.monotonic() + 5
    while _moved(base_url, metrics) != {"abort": cancelled} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _moved(base_url, metrics) == {"abort": cancelled}


def _sse(path: str, base_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base_url}{path}", headers=AUTH, timeout=30,
                      json={**body, "stream": True}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_carry_stop_reason(base_url, chat) -> None:
    """The stop string that ended a streamed choice is its last chunk's `stop_reason`, as in
    the whole answer; earlier chunks carry `stop_reason: null`."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "temperature": 0, "max_tokens": 24}
    body |= {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    free = httpx.post(f"{base_url}{path}", json=body, headers=AUTH, timeout=30).json()
    text = free["choices"][0]["message"]["content"] if chat else free["choices"][0]["text"]
    stop = next(ch for ch in text[2:] if ch.strip())  # a character the answer reaches later
    whole = httpx.post(f"{base_url}{path}", json={**body, "stop": [stop]}, headers=AUTH,
                       timeout=30).json()["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", stop)
    choices = [c for chunk in _sse(path, base_url, {**body, "stop": [stop]})
               for c in chunk["choices"]]
    assert all("stop_reason" in c for c in choices)
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("stop", stop)
    assert all(c["stop_reason"] is None and c["finish_reason"] is None for c in choices[:-1])
