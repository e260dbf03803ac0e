"""The OpenAI HTTP API on `moe-router --http-port`: a prefill and a decode instance (tiny
Qwen3-MoE with the demo's tokenizer and chat template, Mooncake TCP on loopback) behind the
router answer every endpoint as one moe-serve does: greedy completions equal transformers and
the single server (text, usage, logprobs, stop strings and stop_reason), chat streams equal,
refusals are the same status naming the same field, the RL admin endpoints are not there, and
a client that goes away mid-stream leaves no block behind on either instance. Also the two
conversions the router's engine relies on, checked as exact inverses of the servicer's."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fixtures import hf_greedy
from grpc_helpers import ServerThread, free_port
from http_helpers import tokenizer_checkpoint
from test_disagg_server import RouterThread, _free, _server

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.disagg.router_engine import output_from_response, request_from_params
from moe_engine.disagg.transfer import mooncake_unavailable_reason
from moe_engine.request import FinishReason
from moe_engine.sampling_params import SamplingParams, StructuredOutputsParams
from moe_engine.server.app import ServerOptions
from moe_engine.server.convert import response_from_output, sampling_params_from_proto
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

PROMPTS = [[5, 6, 7, 8], [11, 3, 200, 9, 41, 17], list(range(3, 160))]
GREEDY = {"temperature": 0, "max_tokens": 6}
MODEL = "tiny-qwen3"

# The served tests skip without Mooncake; CI installs it (tests/ci_skips.py).
pytestmark = pytest.mark.ci_must_run


# ------------------------------------------------------------------ conversions (no servers)

def _random_params(rng: random.Random) -> SamplingParams:
    kwargs = {
        "max_tokens": rng.randint(1, 500), "temperature": rng.choice([0.0, 0.7, 1.0, 1.3]),
        "top_p": rng.choice([1.0, 0.9, 0.5]), "top_k": rng.choice([-1, 1, 40]),
        "seed": rng.choice([None, 0, 12345, 2**40]), "ignore_eos": rng.random() < 0.5,
        "logprobs": rng.choice([None, 0, 3, 20]), "n": rng.choice([1, 2, 5]),
        "stop": rng.sample(["\n", "END", "###", "ab"], rng.randint(0, 3)),
        "stop_token_ids": rng.sample(range(3, 500), rng.randint(0, 3)),
        "output_kind": rng.choice(["delta", "final_only"]),
        "include_stop_str_in_output": rng.random() < 0.5,
        "skip_special_tokens": rng.random() < 0.5,
        "structured_outputs": rng.choice([
            None, StructuredOutputsParams(json_object=True),
            StructuredOutputsParams(json='{"type": "object"}')]),
        "repetition_penalty": rng.choice([1.0, 1.3]), "min_p": rng.choice([0.0, 0.05]),
        "frequency_penalty": rng.choice([0.0, -0.5, 2.0]),
        "presence_penalty": rng.choice([0.0, 1.25]),
        "logit_bias": rng.choice([None, {5: -100.0, 77: 2.5}]),
        "truncate_prompt_tokens": rng.choice([None, -1, 7]), "priority": rng.choice([0, -2, 9]),
    }
    kwargs["min_tokens"] = rng.randint(0, kwargs["max_tokens"])
    return SamplingParams(**kwargs)


def test_sampling_params_survive_the_wire() -> None:
    rng = random.Random(3)
    for _ in range(300):
        params = _random_params(rng)
        prompt = [rng.randint(0, 9999) for _ in range(rng.randint(1, 20))]
        req = request_from_params("r", prompt, params)
        assert list(req.prompt_ids.ids) == prompt and req.request_id == "r"
        assert sampling_params_from_proto(req) == params
    assert sampling_params_from_proto(request_from_params("r", [1], SamplingParams())) == (
        SamplingParams())


def test_outputs_survive_the_wire() -> None:
    rng = random.Random(4)
    for _ in range(300):
        n = rng.randint(0, 4)
        ids = [rng.randint(0, 9999) for _ in range(n)]
        finished = rng.random() < 0.5
        reason = rng.choice(list(FinishReason)) if finished else None
        stop = rng.choice([None, "END", 17]) if reason == FinishReason.STOP else None
        # logprobs as float32 values, which the wire keeps exactly
        lp = [(float(rng.randint(-4096, 0)) / 64, {t: float(-i) / 8 for i, t in
                                                   enumerate(rng.sample(range(9999), 3))})
              for _ in ids] if rng.random() < 0.5 and ids else None
        out = EngineCoreOutput(f"req-{rng.randint(0, 99)}", ids, "txt" * rng.randint(0, 2),
                               finished, reason, rng.randint(1, 300), rng.randint(0, 300), lp,
                               None, rng.randint(0, 4), stop, rng.choice(["", "v2"]))
        if finished:  # the engine's finished outputs carry the weight labels (issue 45)
            out.weight_versions = [("v1", 0), ("v2", rng.randint(1, 9))][:rng.randint(0, 2)]
            out.kv_from_other_weights = rng.random() < 0.5
        assert output_from_response(response_from_output(out)) == out


# ------------------------------------------------------------------ served

@pytest.fixture(scope="module")
def ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("disagg-http"))


@pytest.fixture(scope="module")
def servers(ckpt: Path) -> Iterator[tuple[ServerThread, ServerThread, ServerThread, str]]:
    """(prefill, decode, single, router base URL); the single server is moe-serve with the
    same limits and its own HTTP port, the reference."""
    if mooncake_unavailable_reason() is not None:
        pytest.skip(str(mooncake_unavailable_reason()))
    single = ServerThread(
        EngineConfig(model=ModelConfig(str(ckpt), max_model_len=512),
                     cache=CacheConfig(block_size=16, num_blocks_override=128),
                     scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)),
        ServerOptions(port=0, http_port=0, served_model_name=MODEL, stats_poll_s=0.2))
    p, d = _server(ckpt, "prefill"), _server(ckpt, "decode")
    http_port = free_port()
    router = RouterThread([p.address], [d.address], http_port=http_port,
                          served_model_name=MODEL)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health").status_code != 200:  # until the decode side answered
        assert time.monotonic() < deadline, "the router's HTTP API never became ready"
        time.sleep(0.1)
    yield p, d, single, base
    router.close()
    for s in (p, d, single):
        s.close()


def _clients(servers) -> tuple[openai.OpenAI, openai.OpenAI]:
    single_url = f"http://127.0.0.1:{servers[2].server.http_port}/v1"
    return (openai.OpenAI(base_url=f"{servers[3]}/v1", api_key="x", max_retries=0),
            openai.OpenAI(base_url=single_url, api_key="x", max_retries=0))


def test_models_health_and_tokenize(servers) -> None:
    base = servers[3]
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
    single_base = f"http://127.0.0.1:{servers[2].server.http_port}"
    for body in ({"prompt": "def f(x):"}, {"messages": [{"role": "user", "content": "hi"}]}):
        got = httpx.post(f"{base}/tokenize", json=body).json()
        assert got == httpx.post(f"{single_base}/tokenize", json=body).json()
    # the RL admin endpoints act on one engine: not served by the router
    assert httpx.post(f"{base}/pause_generation", json={}).status_code == 404


def test_greedy_completions_equal_transformers_and_single(servers, ckpt) -> None:
    router, single = _clients(servers)
    expected = hf_greedy(ckpt, PROMPTS, 6)
    extra = {"ignore_eos": True, "return_token_ids": True}
    got = router.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY, extra_body=extra)
    ref = single.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY, extra_body=extra)
    by_index = sorted(got.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in by_index] == expected
    assert [c.text for c in by_index] == [c.text for c in sorted(ref.choices,
                                                                  key=lambda c: c.index)]
    assert got.usage == ref.usage


def test_text_stop_strings_and_logprobs_equal_single(servers) -> None:
    router, single = _clients(servers)
    base = {"model": MODEL, "prompt": "import os\n", **GREEDY, "extra_body": {"ignore_eos": True}}
    whole = single.completions.create(**base).choices[0].text
    assert router.completions.create(**base).choices[0].text == whole
    stop = whole[2:4]
    if stop.strip():
        cut = {**base, "stop": stop}
        got, ref = (c.completions.create(**cut).choices[0] for c in (router, single))
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason) == (
            whole[: whole.index(stop)], "stop")
        assert got.model_extra["stop_reason"] == ref.model_extra["stop_reason"] == stop
    lp = {**base, "prompt": PROMPTS[1], "logprobs": 3}
    got, ref = (c.completions.create(**lp).choices[0].logprobs for c in (router, single))
    assert got.tokens == ref.tokens
    assert got.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_sampling_and_logprobs_equal_single(servers, stream: bool) -> None:
    """The decode instance continues a seeded request's generator past the prefill's token,
    and the first token's logprobs come along (whole responses are final-only outputs)."""
    router, single = _clients(servers)
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0.9,
            "seed": 11, "logprobs": 2, "stream": stream,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}

    def run(client: openai.OpenAI) -> list[tuple[str, list[str], list[float]]]:
        text, tokens, lps = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
        chunks = client.completions.create(**body)
        for chunk in chunks if stream else [chunks]:
            for c in chunk.choices:
                text[c.index] += c.text
                tokens[c.index] += c.logprobs.tokens if c.logprobs else []
                lps[c.index] += c.logprobs.token_logprobs if c.logprobs else []
        return [(text[i], tokens[i], lps[i]) for i in (0, 1)]

    got, ref = run(router), run(single)
    assert [r[:2] for r in got] == [r[:2] for r in ref]
    assert all(len(toks) == len(lp) == 8 for _, toks, lp in got)
    for (_, _, a), (_, _, b) in zip(got, ref, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_chat_stream_equals_single(servers) -> None:
    router, single = _clients(servers)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    def run(client: openai.OpenAI) -> tuple[str, object]:
        text, usage = "", None
        for chunk in client.chat.completions.create(**body):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    assert run(router) == run(single)


def test_refusals_name_the_field_as_single(servers) -> None:
    base, single_base = servers[3], f"http://127.0.0.1:{servers[2].server.http_port}"
    for body in ({"model": MODEL, "prompt": [5, 6], "max_tokens": 10_000},
                 {"model": MODEL, "prompt": [5, 99_999], "max_tokens": 2},
                 {"model": MODEL, "prompt": [5, 6], "temperature": -1},
                 {"model": "other", "prompt": [5, 6]}):
        got = httpx.post(f"{base}/v1/completions", json=body)
        ref = httpx.post(f"{single_base}/v1/completions", json=body)
        assert got.status_code == ref.status_code and got.status_code in (400, 404)
        assert got.json()["error"]["param"] == ref.json()["error"]["param"]


def test_client_gone_mid_stream_leaves_no_block(servers) -> None:
    p, d, _, base = servers
    start = [_free(p), _free(d)]
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass  # one chunk arrived: the request decodes; then the client leaves
    deadline = time.monotonic() + 15
    while [_free(p), _free(d)] != start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [_free(p), _free(d)] == start
