"""What a vLLM user finds on `moe-serve`'s HTTP port, with one `moe-serve` process as the user
starts it (only the ports moved to free ones; their defaults, 8000 for HTTP and 50051 for gRPC,
are checked from the parser): the official `openai` client answered, `/metrics` with vLLM's
`vllm:*` series that move after a request (and the same text on --metrics-port),
`/v1/models/{id}`, `/ping`, `/openapi.json`, `/docs`, `X-Request-Id`; the flags --tokenizer,
--dtype half, --enable-log-requests and --allow-unknown-fields; bad flag values refused naming
the flag; and, on in-process apps without an engine, the unknown-field policy both ways, the
open paths under an API key and the no-tokenizer error."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_helpers import free_port
from http_helpers import tokenizer_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from moe_engine.cli import serve as serve_cli
from moe_engine.core.outputs import ModelInfo
from moe_engine.server.http import HttpState, build_app
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.vllm_metrics import INTER_TOKEN_BUCKETS_S, TTFT_BUCKETS_S

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-served"
PROMPT = [5, 6, 7, 8, 9]


class Served:
    """The `moe-serve` subprocess: its ports and its log file."""

    def __init__(self, proc: subprocess.Popen, http: int, grpc_port: int, metrics: int,
                 log: Path) -> None:
        self.proc, self.http, self.grpc, self.metrics, self.log = proc, http, grpc_port, \
            metrics, log
        self.url = f"http://127.0.0.1:{http}"


@pytest.fixture(scope="module")
def served(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`moe-serve --model CKPT --tokenizer TOK --dtype half ...` (the checkpoint has no
    tokenizer files: text prompts work only through --tokenizer)."""
    tmp = tmp_path_factory.mktemp("surface")
    tok = tokenizer_checkpoint(qwen3_ckpt, tmp)
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    log = tmp / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt),
             "--tokenizer", str(tok), "--dtype", "half", "--served-model-name", MODEL,
             "--port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
             "--max-model-len", "128", "--kv-cache-memory", "2MiB", "--max-num-seqs", "8",
             "--enable-log-requests", "--allow-unknown-fields"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    handle = Served(proc, http, grpc_port, metrics, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield handle
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def test_defaults_are_http_8000_and_grpc_50051() -> None:
    """What `moe-serve --model X` listens on: HTTP on 8000 (vLLM's) and gRPC on 50051."""
    args = serve_cli.build_parser().parse_args([])
    options = serve_cli.server_options_from_args(args)
    assert (options.http_port, options.port) == (8000, 50051)
    alias = serve_cli.build_parser().parse_args(["--http-port", "8123"])
    assert serve_cli.server_options_from_args(alias).http_port == 8123
    off = serve_cli.build_parser().parse_args(["--port", "0"])
    assert serve_cli.server_options_from_args(off).http_port is None


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `url`'s /metrics: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items())))
    return samples.get(key, 0.0)


def test_openai_client_and_vllm_metrics_move(served: Served, client: openai.OpenAI) -> None:
    before = _metrics(f"{served.url}/metrics")
    assert _value(before, "vllm:num_requests_running") == 0
    assert ("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", MODEL))) in before
    text = client.completions.create(model=MODEL, prompt="hello there", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 6 and text.choices[0].finish_reason == "length"
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    assert len("".join(chunk.choices[0].text for chunk in done if chunk.choices)) > 0
    prompt_tokens = text.usage.prompt_tokens + len(PROMPT)
    deadline = time.monotonic() + 15  # counters come from the stats poll (1 s)
    while True:
        after = _metrics(f"{served.url}/metrics")
        moved = _value(after, "vllm:generation_tokens_total") - \
            _value(before, "vllm:generation_tokens_total")
        if moved >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.3)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"vllm:{name}_count") == 2, name
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 10
    assert delta("vllm:inter_token_latency_seconds_count") == 5 + 3  # tokens after the first
    assert delta("vllm:request_queue_time_seconds_sum") >= 0
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert 0 < delta("vllm:request_prefill_time_seconds_sum") < \
        delta("vllm:time_to_first_token_seconds_sum")
    ttft_bounds = sorted(float(dict(k[1])["le"]) for k in after
                         if k[0] == "vllm:time_to_first_token_seconds_bucket")
    assert ttft_bounds == [*TTFT_BUCKETS_S, math.inf]
    itl_bounds = sorted(float(dict(k[1])["le"]) for k in after
                        if k[0] == "vllm:inter_token_latency_seconds_bucket")
    assert itl_bounds == [*INTER_TOKEN_BUCKETS_S, math.inf]
    # The same registry on --metrics-port, beside the moe_engine_* series.
    port = _metrics(f"http://127.0.0.1:{served.metrics}/metrics")
    assert _value(port, "vllm:request_success_total", finished_reason="length") == \
        _value(after, "vllm:request_success_total", finished_reason="length")
    assert any(name.startswith("moe_engine_") for name, _ in port)


def test_metric_types_are_vllms(served: Served) -> None:
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:num_requests_waiting"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits"):
        assert types[f"vllm:{name}"] == "counter", name
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"


def test_models_retrieve_and_404(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other/model")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'other/model'" in error["message"]


def test_ping_openapi_docs(served: Served) -> None:
    assert httpx.get(f"{served.url}/ping").status_code == 200
    assert httpx.post(f"{served.url}/ping").status_code == 200
    spec = httpx.get(f"{served.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}", "/ping"):
        assert path in spec["paths"], path
    docs = httpx.get(f"{served.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_x_request_id_is_echoed_and_used(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    given = httpx.post(f"{served.url}/v1/completions", json=body,
                       headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert given.status_code == 200, given.text
    assert given.headers["x-request-id"] == "trace-42"
    assert given.json()["id"] == "cmpl-trace-42"
    made = httpx.get(f"{served.url}/v1/models", timeout=10)
    assert len(made.headers["x-request-id"]) == 32  # one made up: uuid4 hex
    missing = httpx.get(f"{served.url}/nope", headers={"X-Request-Id": "e-1"}, timeout=10)
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "e-1"
    bad = httpx.get(f"{served.url}/v1/models", headers={"X-Request-Id": "x" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_flags_took_effect(served: Served, client: openai.OpenAI) -> None:
    """--grpc-port serves gRPC, --dtype half is float16, --allow-unknown-fields answers a
    body with another engine's field, and --enable-log-requests logged each request."""
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc}") as channel:
        info = pb_grpc.MoeEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.dtype == "float16" and info.has_tokenizer
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"some_other_engines_field": 1})
    assert reply.choices[0].message.content is not None
    log = served.log.read_text()
    assert "Received request chatcmpl-" in log and "Finished request chatcmpl-" in log
    assert log.count("'some_other_engines_field'") == 1  # warned once


@pytest.mark.parametrize(("argv", "status", "named"), [
    (["--dtype", "float8"], 2, "--dtype"),
    (["--port", "70000"], 2, "--port must be in 0..65535, got 70000"),
    (["--grpc-port", "-1"], 2, "--grpc-port must be in 0..65535, got -1"),
    (["--port", "50051"], 1, "--port (HTTP) 50051 and --grpc-port 50051 name the same port"),
    (["--port", "0", "--grpc-port", "0"], 1, "nothing to serve"),
    (["--enable-log-requests", "--disable-log-requests"], 2, "--disable-log-requests"),
    (["--tokenizer", "/nonexistent/tok"], 1, "--tokenizer /nonexistent/tok"),
])
def test_bad_flag_values_are_refused_naming_the_flag(
    qwen3_ckpt: Path, capsys: pytest.CaptureFixture, argv: list[str], status: int, named: str
) -> None:
    """Each fails before a port opens (gRPC's default 50051 is never bound)."""
    try:
        code = serve_cli.main(["--model", str(qwen3_ckpt), *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == status and named in err, err


def test_tokenizer_folder_without_tokenizer_files_is_refused(qwen3_ckpt: Path, capsys) -> None:
    code = serve_cli.main(["--model", str(qwen3_ckpt), "--tokenizer", str(qwen3_ckpt)])
    err = capsys.readouterr().err
    assert code == 1 and "--tokenizer" in err and "no tokenizer files" in err, err


# --- in-process apps (no engine) -----------------------------------------------------------------


class _NoEngine:
    """The engine attributes the routes read before submitting anything."""

    tokenizer = None
    model_info = ModelInfo(model="m", architecture="A", dtype="float32", vocab_size=512,
                           max_model_len=128, num_layers=1, num_experts=2,
                           num_experts_per_tok=1, hidden_size=8, block_size=16,
                           num_kv_blocks=8, max_num_seqs=1, max_num_batched_tokens=64)


def _app(ready: bool, **kwargs) -> TestClient:
    state = HttpState(_NoEngine(), MODEL, lambda: (ready, "serving" if ready else "loading"))
    return TestClient(build_app(state, max_body_bytes=1 << 20, **kwargs))


def test_unknown_fields_refused_by_default_ignored_with_the_flag(caplog) -> None:
    body = {"model": MODEL, "prompt": [1, 2], "vendor_extra": True,
            "stream_options": None}
    refused = _app(False).post("/v1/completions", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "vendor_extra"
    allowed = _app(False, allow_unknown_fields=True)
    with caplog.at_level(logging.WARNING, logger="moe_engine.server.http.request_context"):
        for _ in range(3):
            passed = allowed.post("/v1/completions", json={**body, "other_extra": 1})
            assert passed.status_code == 503  # validated; the engine is not ready
    warned = [r.getMessage() for r in caplog.records]
    assert sum("'vendor_extra'" in m for m in warned) == 1, warned
    assert sum("'other_extra'" in m for m in warned) == 1, warned
    # Nested parts too, named in the 400 without the flag.
    chat = {"messages": [{"role": "user", "content": "x", "extra": 1}]}
    assert _app(False).post("/v1/chat/completions", json=chat).json()["error"]["param"] == \
        "messages[0].extra"
    assert allowed.post("/v1/chat/completions", json=chat).status_code == 503


def test_open_paths_under_an_api_key() -> None:
    app = _app(True, api_key="k")
    for path in ("/ping", "/metrics", "/openapi.json", "/docs", "/health"):
        assert app.get(path).status_code != 401, path
    assert app.get("/v1/models").status_code == 401
    assert app.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert _app(True, api_key="k", health_requires_api_key=True).get("/ping").status_code == 401


def test_text_prompt_without_tokenizer_names_the_http_field() -> None:
    reply = _app(True).post("/v1/completions", json={"model": MODEL, "prompt": "hello"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "prompt", error
    assert "--tokenizer" in error["message"] and "text" not in error["param"]


def test_router_ports_follow_moe_serve(capsys) -> None:
    """moe-router: --port is HTTP (8000), gRPC on --grpc-port (50050); one port for both is
    refused naming both flags."""
    from moe_engine.cli import router as router_cli

    args = router_cli.build_parser().parse_args(["--prefill", "h:1", "--decode", "h:2"])
    assert (args.http_port, args.grpc_port) == (8000, 50050)
    code = router_cli.main(["--prefill", "h:1", "--decode", "h:2", "--port", "50050"])
    err = capsys.readouterr().err
    assert code == 2 and "--port (HTTP) 50050 and --grpc-port 50050" in err, err


def test_llm_takes_a_tokenizer_folder_and_half(qwen3_ckpt: Path, tmp_path: Path) -> None:
    """The offline API's `tokenizer` and `dtype="half"` (vLLM's names): text prompts work on a
    checkpoint without tokenizer files."""
    from moe_engine import LLM, SamplingParams

    tok = tokenizer_checkpoint(qwen3_ckpt, tmp_path)
    llm = LLM(str(qwen3_ckpt), tokenizer=str(tok), dtype="half", max_model_len=64,
              num_blocks_override=8)
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text
    assert llm.engine.model_info().dtype == "float16"


def test_http_port_in_use_names_the_flag() -> None:
    import socket

    from moe_engine.errors import StartupError
    from moe_engine.server.http.app import bind_socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StartupError, match=f"127.0.0.1:{port}.*pick another --port"):
            bind_socket("127.0.0.1", port)
