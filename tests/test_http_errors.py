"""Bad input over HTTP: every refusal is OpenAI-shaped ({"error": {message, type, param,
code}}) with the right status, names the field, and the server keeps serving after it; a full
queue is 429; a draining server answers 503 while a running stream finishes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from grpc_helpers import ServerThread
from http_helpers import API_KEY, MAX_MESSAGE_BYTES, MODEL, start_server, tokenizer_checkpoint

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, path, body or raw bytes, headers, status, param or None)
MATRIX = [
    ("malformed json", "/v1/completions", b'{"prompt": [1, 2', AUTH, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, AUTH, 400, "prompt"),
    ("wrong type max_tokens", "/v1/completions", {**OK, "max_tokens": "ten"}, AUTH, 400,
     "max_tokens"),
    ("bool as int", "/v1/completions", {**OK, "n": True}, AUTH, 400, "n"),
    ("unknown field", "/v1/completions", {**OK, "max_token": 3}, AUTH, 400, "max_token"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -1}, AUTH, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {**OK, "temperature": -0.5}, AUTH, 400,
     "temperature"),
    ("top_p over 1", "/v1/completions", {**OK, "top_p": 1.5}, AUTH, 400, "top_p"),
    ("huge n", "/v1/completions", {**OK, "n": 100000}, AUTH, 400, "n"),
    ("max_tokens over the context", "/v1/completions", {**OK, "max_tokens": 10**6}, AUTH, 400,
     "max_tokens"),
    ("token id out of vocab", "/v1/completions", {**OK, "prompt": [10**6]}, AUTH, 400,
     "prompt"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, AUTH, 400, "prompt"),
    ("too many logprobs", "/v1/completions", {**OK, "logprobs": 50}, AUTH, 400, "logprobs"),
    ("stream_options without stream", "/v1/completions",
     {**OK, "stream_options": {"include_usage": True}}, AUTH, 400, "stream_options"),
    ("bad stream_options field", "/v1/completions",
     {**OK, "stream": True, "stream_options": {"usage": True}}, AUTH, 400,
     "stream_options.usage"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, AUTH, 400, "stop"),
    ("presence penalty over 2", "/v1/completions", {**OK, "presence_penalty": 2.5}, AUTH, 400,
     "presence_penalty"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-4"}, AUTH, 404, "model"),
    ("no key", "/v1/completions", OK, {}, 401, None),
    ("wrong key", "/v1/completions", OK, {"Authorization": "Bearer nope"}, 401, None),
    ("huge body", "/v1/completions", {**OK, "user": "x" * (MAX_MESSAGE_BYTES + 1)}, AUTH, 413,
     None),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400, "messages"),
    ("bad role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, AUTH, 400, "messages[0].role"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2},
     AUTH, 400, "top_logprobs"),
    ("bad response_format type", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "xml"}}, AUTH, 400, "response_format.type"),
    ("top_logprobs over 20", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, AUTH, 400, "top_logprobs"),
    ("user message without content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user"}]}, AUTH, 400, "messages[0]"),
    ("logit_bias over 100", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, AUTH,
     400, "logit_bias"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, AUTH, 400,
     "tools[0].function"),
    ("best_of", "/v1/completions", {**OK, "best_of": 3}, AUTH, 400, "best_of"),
    ("repetition_penalty 0", "/v1/completions", {**OK, "repetition_penalty": 0}, AUTH, 400,
     "repetition_penalty"),
    ("priority under fcfs", "/v1/chat/completions", {**CHAT, "priority": 1}, AUTH, 400,
     "priority"),
    ("n that can never be queued", "/v1/completions", {**OK, "n": 8}, AUTH, 400, "n"),
    # integers past 64 bits: refused by name, never a 500 from the engine's message encoder
    *[(f"huge {name}", "/v1/completions", {**OK, name: value}, AUTH, 400, name)
      for name, value in (("priority", 10**30), ("max_tokens", 10**30), ("top_k", 10**30),
                          ("min_tokens", 10**30), ("seed", 10**30),
                          ("truncate_prompt_tokens", 10**30), ("stop_token_ids", [10**30]),
                          ("logit_bias", {str(10**30): 1}), ("logprobs", 10**30))],
    ("empty body", "/v1/completions", b"", AUTH, 400, None),
    ("unknown path", "/v1/embeddings", OK, AUTH, 404, None),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, AUTH, 400, "tokens"),
]


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    ckpt = tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("http-errors"))
    handle = start_server(ckpt, max_waiting=2)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.mark.parametrize(("name", "path", "body", "headers", "status", "param"), MATRIX,
                         ids=[m[0] for m in MATRIX])
def test_bad_input_gets_an_openai_error_and_the_server_serves_on(
    base_url, name, path, body, headers, status, param
) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        if isinstance(body, bytes):
            resp = http.post(path, content=body,
                             headers={**headers, "Content-Type": "application/json"})
        else:
            resp = http.post(path, json=body, headers=headers)
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and isinstance(error["type"], str)
        assert error["param"] == param, error
        if param is not None:
            assert param.split("[")[0].split(".")[0] in error["message"], error
        after = http.post("/v1/completions", json=OK, headers=AUTH)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


def test_fields_clients_send_at_no_effect_are_accepted(base_url) -> None:
    """OpenAI bookkeeping fields and features at their neutral value: 200, same output."""
    extra = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u",
             "logit_bias": {}, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
             "repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0,
             "skip_special_tokens": True, "include_stop_str_in_output": False}
    with httpx.Client(base_url=base_url, timeout=30, headers=AUTH) as http:
        plain = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
        more = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, **extra})
        best = http.post("/v1/completions", json={**OK, "best_of": 1, "temperature": 0})
    assert plain.status_code == more.status_code == best.status_code == 200, more.text
    assert more.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_streamed_body_over_the_limit_is_413(base_url) -> None:
    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"prompt": "'
        for _ in range(MAX_MESSAGE_BYTES // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    resp = httpx.post(f"{base_url}/v1/completions", content=chunks(), headers=AUTH)
    assert resp.status_code == 413 and "--max-message-bytes" in resp.json()["error"]["message"]


def test_openai_client_raises_typed_errors(base_url) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=[5], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_full_queue_is_429(base_url) -> None:
    """max_num_seqs 2 and max_waiting 2: of 12 long requests at once, some are refused."""
    body = {**OK, "max_tokens": 60, "ignore_eos": True}

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            resps = await asyncio.gather(
                *(http.post("/v1/completions", json=body, headers=AUTH) for _ in range(12))
            )
        return resps

    resps = asyncio.run(main())
    codes = sorted(r.status_code for r in resps)
    assert 200 in codes and 429 in codes, codes
    refused = next(r for r in resps if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error"
    assert httpx.post(f"{base_url}/v1/completions", json=OK, headers=AUTH).status_code == 200


def test_drain_refuses_new_requests_with_503_and_finishes_a_running_stream(
    server, base_url
) -> None:
    """The last test of the module: it stops the server."""
    body = {**OK, "max_tokens": 40, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=AUTH,
                          timeout=60) as resp:
            for line in resp.iter_lines():
                started.set()
                if line:
                    lines.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    # Drain with time enough for the running stream to finish.
    stopping = asyncio.run_coroutine_threadsafe(server.server.stop(grace_s=30), server.loop)
    refused = None
    for _ in range(100):
        try:
            resp = httpx.post(f"{base_url}/v1/completions", json=OK, headers=AUTH, timeout=5)
        except httpx.TransportError:
            break
        if resp.status_code == 503:
            refused = resp.json()["error"]
            break
    assert refused is not None and "shutting down" in refused["message"]
    reader.join(60)
    stopping.result(60)
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(lines)
