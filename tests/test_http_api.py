"""The OpenAI-compatible HTTP API, driven with the official `openai` package (sync and async,
whole and streamed) against one server that also serves gRPC over the same engine: greedy
outputs equal gRPC's and transformers', usage is exact, streams end with [DONE], and 200
concurrent streams with random disconnects leave no request and no KV block behind."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fixtures import hf_greedy
from grpc_helpers import ServerThread, request
from http_helpers import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL,
    Grpc,
    start_server,
    tokenizer_checkpoint,
    wait_idle,
)

from moe_engine import __version__

PROMPTS = [[5, 6, 7, 8], [11, 3, 200, 9, 41, 17], [300]]
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("http"))


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    handle = start_server(ckpt)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def rpc(server: ServerThread) -> Iterator[Grpc]:
    handle = Grpc(server.address)
    yield handle
    handle.close()


def test_models_version_health_tokenize(client, base_url, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert httpx.get(f"{base_url}/version").json() == {"version": __version__}
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and health.content == b""
    tok = server.server.engine.tokenizer
    auth = {"Authorization": f"Bearer {API_KEY}"}
    got = httpx.post(f"{base_url}/tokenize", json={"prompt": "def f(x):"}, headers=auth).json()
    assert got["tokens"] == tok.encode("def f(x):") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": got["tokens"]}, headers=auth)
    assert back.json() == {"prompt": "def f(x):"}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": messages}, headers=auth).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)


def test_greedy_completions_equal_grpc_and_transformers(client, rpc, ckpt) -> None:
    expected = hf_greedy(ckpt, PROMPTS, 6)
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS, **GREEDY, extra_body={"ignore_eos": True,
                                                           "return_token_ids": True},
    )
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.id.startswith("cmpl-") and resp.created > 0
    got = [c.model_extra["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)]
    assert got == expected
    for i, prompt in enumerate(PROMPTS):
        out = rpc.generate(request(prompt, max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [t for r in out for t in r.token_ids] == expected[i]
        assert "".join(r.text for r in out) == resp.choices[i].text
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert resp.usage.completion_tokens == 18 and resp.usage.total_tokens == 18 + 11


def test_text_prompt_echo_stop_and_logprobs(client, server) -> None:
    tok = server.server.engine.tokenizer
    whole = client.completions.create(model=MODEL, prompt="import os\n", **GREEDY,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="import os\n", echo=True, **GREEDY,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "import os\n" + text
    assert whole.usage.prompt_tokens == len(tok.encode("import os\n"))
    stop = text[2:4]
    if stop.strip():
        cut = client.completions.create(model=MODEL, prompt="import os\n", stop=stop, **GREEDY)
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]
    lp = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **GREEDY,
                                   extra_body={"ignore_eos": True})
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 6 and len(logprobs.token_logprobs) == 6
    # Keyed by token text (OpenAI's legacy shape): byte fragments that decode alike merge.
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    for token_lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)


def test_stream_completions_sync(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, seed=7,
                                      max_tokens=5, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[1], n=2, seed=7, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and chunk.id == chunks[0].id
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}  # the same seed, the same text
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(PROMPTS[1])


def test_chat_greedy_equals_grpc(client, rpc, server) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    tok = server.server.engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=8,
        extra_body={"ignore_eos": True},
    )
    out = rpc.generate(request(ids, max_tokens=8, temperature=0.0, ignore_eos=True))
    assert resp.choices[0].message.content == "".join(r.text for r in out)
    assert resp.choices[0].message.role == "assistant"
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 8
    assert resp.choices[0].finish_reason == "length"


def test_chat_logprobs_stream_and_stop(client) -> None:
    messages = [{"role": "user", "content": "count"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Without ignore_eos the demo template's <|eos|> ends the turn: "stop" or "length".
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=40)
    assert free.choices[0].finish_reason in ("stop", "length")


def test_async_client_and_one_engine_for_both(base_url, rpc) -> None:
    before = rpc.stats().num_finished

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY,
                                      max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], temperature=0,
                max_tokens=4, extra_body={"ignore_eos": True})
            pieces = []
            async for chunk in await aclient.completions.create(
                model=MODEL, prompt="x = ", max_tokens=4, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):
                pieces += [c.text for c in chunk.choices]
            models = await aclient.models.list()
            return [whole.choices[0].message.content, "".join(pieces), models.data[0].id]

    chat_text, stream_text, model = asyncio.run(main())
    assert model == MODEL and chat_text and stream_text
    assert rpc.stats().num_finished == before + 2  # gRPC's stats count the HTTP requests


def test_sse_wire_format(base_url) -> None:
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert sum(len(p["choices"]) for p in payloads) == 3  # one chunk per engine step


def test_200_streams_with_random_disconnects_leak_nothing(base_url, rpc) -> None:
    rng = random.Random(0)
    plans = [rng.random() < 0.4 for _ in range(200)]  # True: disconnect after the first chunk

    async def one(aclient: openai.AsyncOpenAI, i: int, disconnect: bool) -> int:
        stream = await aclient.completions.create(
            model=MODEL, prompt=[5 + i % 50, 7, 9], max_tokens=8, temperature=0.5, seed=i,
            stream=True, extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            tokens += len(chunk.choices)
            if disconnect:
                await stream.close()
                return -1
        return tokens

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=256)
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0,
            http_client=httpx.AsyncClient(limits=limits, timeout=120),
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i, d) for i, d in enumerate(plans)))

    before = rpc.stats()
    results = asyncio.run(main())
    assert all(r == 8 for r, d in zip(results, plans, strict=True) if not d)  # lost nothing
    after = wait_idle(rpc)
    ended = (after.num_finished + after.num_aborted) - (before.num_finished + before.num_aborted)
    assert ended == 200


def test_json_schema_outputs_parse_and_validate_under_load(base_url) -> None:
    """response_format json_schema / json_object through the openai client: 20 schemas (the
    structured-output module's), sampled concurrently with unconstrained chats; every output
    finishes "stop" and parses and validates."""
    import jsonschema
    from test_structured_output import SCHEMAS

    async def main() -> list[tuple[dict | None, str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY,
                                      max_retries=0) as aclient:

            async def one(i: int, schema: dict | None) -> tuple[dict | None, str, str]:
                fmt = ({"type": "text"} if schema is None else
                       {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
                resp = await aclient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"item {i}"}],
                    max_tokens=100, temperature=1.0, seed=i, response_format=fmt,
                )
                choice = resp.choices[0]
                return schema, choice.message.content, choice.finish_reason

            jobs = [one(i, s) for i, s in enumerate(SCHEMAS)] + [one(100 + i, None)
                                                                 for i in range(4)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    constrained = [(schema, text, reason) for schema, text, reason in results if schema]
    assert len(constrained) == len(SCHEMAS) == 20
    for schema, text, reason in constrained:
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_bad_schemas_over_http(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "{"}], max_tokens=100, seed=3,
        response_format={"type": "json_object"},
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    for schema in ({"type": "no-such-type"}, {"$ref": "#/$defs/missing"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "bad", "schema": schema}},
            )
        assert info.value.status_code == 400
        assert info.value.body["param"] == "response_format", info.value.body
