"""bench/serve.py: the request sampler against mixed-64, and one run of its main against a real
gRPC server on the tiny Qwen3-MoE checkpoint (max_model_len 384, so the first mixed-64 request,
248 + 171 tokens, is refused with OUT_OF_RANGE and counted as a failure)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import load_bench
from grpc_helpers import ServerThread
from http_helpers import tokenizer_checkpoint

from moe_engine.server.app import ServerOptions
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

MAX_MODEL_LEN = 384
NUM_REQUESTS = 8


_load = load_bench


@pytest.fixture(scope="module")
def serve() -> ModuleType:
    return _load("serve")


def test_sampler_is_mixed64_and_shared_prefix(serve: ModuleType) -> None:
    reference = _load("throughput").mixed_workload(64)
    sampled = serve.sample_requests(64, vocab_size=8192, seed=0)
    assert [(r.prompt_token_ids, r.output_len) for r in sampled] == [
        (r.prompt_token_ids, r.output_len) for r in reference
    ]
    # A small vocabulary keeps every length; ids stay in [3, vocab).
    small = serve.sample_requests(64, vocab_size=512, seed=0)
    assert [(len(r.prompt_token_ids), r.output_len) for r in small] == [
        (len(r.prompt_token_ids), r.output_len) for r in reference
    ]
    assert all(3 <= t < 512 for r in small for t in r.prompt_token_ids)
    # Shared prefix: the first int(F * len) ids are common, the rest stay as drawn.
    fraction = random.uniform(0.3, 0.9)
    shared = serve.sample_requests(20, vocab_size=8192, seed=0, shared_prefix=fraction)
    longest = max(shared, key=lambda r: len(r.prompt_token_ids)).prompt_token_ids
    for plain, pre in zip(sampled[:20], shared, strict=True):
        k = int(fraction * len(pre.prompt_token_ids))
        assert len(pre.prompt_token_ids) == len(plain.prompt_token_ids)
        assert pre.output_len == plain.output_len
        assert pre.prompt_token_ids[:k] == longest[:k]
        assert pre.prompt_token_ids[k:] == plain.prompt_token_ids[k:]
    # Long prompts: about F of the requests grow to LEN ids, starting with their drawn prompt;
    # the rest and every output length stay mixed-64's.
    mixed = serve.sample_requests(400, vocab_size=8192, seed=0)
    longs = serve.sample_requests(400, vocab_size=8192, seed=0, long_prompts=(0.25, 700))
    grown = 0
    for plain, req in zip(mixed, longs, strict=True):
        assert req.output_len == plain.output_len
        assert req.prompt_token_ids[:len(plain.prompt_token_ids)] == plain.prompt_token_ids
        if len(req.prompt_token_ids) != len(plain.prompt_token_ids):
            assert len(req.prompt_token_ids) == 700
            grown += 1
    assert 60 < grown < 140  # 100 expected
    with pytest.raises(ValueError, match="long_prompts"):
        serve.sample_requests(4, vocab_size=8192, long_prompts=(0.0, 700))
    gaps = serve.poisson_arrivals(2000, 4.0, seed=0)
    assert gaps[0] == 0.0 and all(b >= a for a, b in zip(gaps, gaps[1:], strict=False))
    assert 0.2 < gaps[-1] / 2000 < 0.3  # mean gap 1 / rate = 0.25 s
    assert serve.poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """Both front ends (gRPC and --http-port) over one engine; a tokenizer for the HTTP side."""
    ckpt = tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("bench-serve"))
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=256),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
    )
    handle = ServerThread(config, ServerOptions(port=0, http_port=0))
    yield handle
    handle.close()


def test_main_against_real_server(
    serve: ModuleType, server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "serve.json"
    png = tmp_path / "serve.png"
    status = serve.main([
        "--server", server.address, "--request-rate", "20", "--num-requests", str(NUM_REQUESTS),
        "--json", "--output", str(out), "--plot", str(png),
    ])
    captured = capsys.readouterr()
    assert status == 1  # one request refused
    report = json.loads(captured.out)
    assert report == json.loads(out.read_text())
    assert "TTFT p99" in captured.err and "OUT_OF_RANGE 1" in captured.err
    assert png.stat().st_size > 1000

    requested = serve.sample_requests(NUM_REQUESTS, vocab_size=512, seed=0)
    fits = [len(r.prompt_token_ids) + r.output_len <= MAX_MODEL_LEN for r in requested]
    assert fits.count(False) == 1 and report["model"]["vocab_size"] == 512
    assert report["workload"]["output_tokens"] == sum(r.output_len for r in requested)
    (run,) = report["runs"]
    assert run["mode"] == "rate" and run["request_rate"] == 20.0
    assert run["num_requests"] == NUM_REQUESTS
    assert run["completed"] == fits.count(True)
    assert run["failed"] == 1 and run["failures"] == {"OUT_OF_RANGE": 1}
    assert run["completed"] + run["failed"] == len(run["requests"]) == NUM_REQUESTS

    # Every completed request got exactly the tokens it asked for; the totals add up.
    for req, result, ok in zip(requested, run["requests"], fits, strict=True):
        assert result["prompt_len"] == len(req.prompt_token_ids)
        assert result["output_len"] == req.output_len
        if ok:
            assert result["error"] is None
            assert result["output_tokens"] == req.output_len
            assert 0 <= result["ttft_s"] <= result["e2e_s"]
            expected_tpot = (result["e2e_s"] - result["ttft_s"]) / (req.output_len - 1)
            assert result["tpot_s"] == pytest.approx(expected_tpot)
            assert result["chunks"] >= 1
        else:
            assert result["error"] == "OUT_OF_RANGE" and result["output_tokens"] == 0
            assert "max_model_len" in result["message"] or "384" in result["message"]
    completed_tokens = sum(r.output_len for r, ok in zip(requested, fits, strict=True) if ok)
    assert run["output_tokens"] == completed_tokens
    assert run["duration_s"] > 0
    assert run["output_throughput"] == pytest.approx(completed_tokens / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration_s"])

    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = run[metric]
        assert set(s) == {"mean", "p50", "p90", "p99"}
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        assert s["mean"] >= 0
    assert run["ttft_s"]["p99"] <= run["e2e_s"]["p99"]
    assert 0 <= run["slo_met"] <= run["completed"]
    assert run["goodput"] == pytest.approx(run["slo_met"] / run["duration_s"])
    client = run["client"]
    assert client["cpu_s"] >= 0 and client["max_send_lag_s"] >= 0
    assert client["responses"] == sum(r["chunks"] for r in run["requests"])


def test_main_drives_the_http_front_end_too(
    serve: ModuleType, server: ServerThread, capsys: pytest.CaptureFixture
) -> None:
    """--http-server: the same requests as streamed /v1/completions; the same counts as over
    gRPC (the refused request is an HTTP 400 naming the context limit)."""
    http = f"127.0.0.1:{server.server.http_port}"
    status = serve.main([
        "--server", server.address, "--http-server", http, "--request-rate", "20",
        "--num-requests", str(NUM_REQUESTS), "--json",
    ])
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and report["frontend"] == "http" and report["http_server"] == http
    requested = serve.sample_requests(NUM_REQUESTS, vocab_size=512, seed=0)
    fits = [len(r.prompt_token_ids) + r.output_len <= MAX_MODEL_LEN for r in requested]
    (run,) = report["runs"]
    assert run["completed"] == fits.count(True) and run["failures"] == {"HTTP 400": 1}
    for req, result, ok in zip(requested, run["requests"], fits, strict=True):
        if ok:
            assert result["error"] is None and result["output_tokens"] == req.output_len
            assert 0 <= result["ttft_s"] <= result["e2e_s"]
        else:
            assert str(MAX_MODEL_LEN) in result["message"] or "max_model_len" in result["message"]
    assert run["ttft_s"]["p99"] is not None and run["output_throughput"] > 0
