"""End-to-end tests of the gRPC front end over loopback, with the real engine core.

One server per module (a tiny float32 Qwen3-MoE checkpoint, max_model_len 256, 512 KV blocks of
16 tokens, a 64 KiB message limit) runs in a background thread's event loop; the tests talk to
it with grpc clients as any user would.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import ServerThread, free_port, request, stats, wait_idle
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from moe_engine.server.app import SERVICE_NAME, ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
VOCAB = 512
NUM_BLOCKS = 512
MAX_MESSAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=ModelConfig(str(qwen3_ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256),
    )
    options = ServerOptions(
        port=0,
        max_message_bytes=MAX_MESSAGE_BYTES,
        metrics_port=free_port(),
        stats_poll_s=0.2,
    )
    handle = ServerThread(config, options)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def collect(stub: pb_grpc.MoeEngineStub, req: pb.GenerateRequest, **kw) -> list:
    return list(stub.Generate(req, **kw))


def test_health_serving_and_reflection(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "moe_engine.v1.MoeEngine" in services
        assert "grpc.health.v1.Health" in services


def test_model_info(stub: pb_grpc.MoeEngineStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architecture == "Qwen3MoeForCausalLM"
    assert (info.vocab_size, info.max_model_len, info.num_kv_blocks) == (
        VOCAB,
        MAX_MODEL_LEN,
        NUM_BLOCKS,
    )
    assert info.num_experts == 8 and info.num_experts_per_tok == 2
    # the kernel backends chosen at startup (kernels/registry.py): every op, auto on a CPU,
    # and the native library's variant (kernels/native/library.py choose_isa)
    from kernels.native.library import choose_isa
    from kernels.plan import OPS

    assert info.device == "cpu" and set(info.kernel_backends) == {*OPS, "native_cpu_isa"}
    assert info.kernel_backends["native_cpu_isa"] == choose_isa()[0]
    assert info.kernel_backends["linear"] == "native-cpu"
    assert info.kernel_backends["attention_prefill"] == "torch"


def test_generate_streams_deltas_and_usage(stub: pb_grpc.MoeEngineStub) -> None:
    req = request([5, 6, 7, 8], max_tokens=12, temperature=0.0, ignore_eos=True, request_id="s1")
    responses = collect(stub, req)
    assert len(responses) >= 2, "tokens must be streamed, not sent in one message"
    assert all(r.request_id == "s1" for r in responses)
    assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 12)
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == 12 and all(0 <= t < VOCAB for t in tokens)
    # Greedy is deterministic.
    again = [t for r in collect(stub, req) for t in r.token_ids]
    assert again == tokens


def test_final_only_is_one_response_with_every_token(stub: pb_grpc.MoeEngineStub) -> None:
    fields = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    streamed = collect(stub, request([5, 6, 7, 8, 9], **fields))
    assert len(streamed) >= 2 and all(r.ttft_s == 0 for r in streamed[:-1])
    start = time.perf_counter()
    (whole,) = collect(stub, request([5, 6, 7, 8, 9], final_only=True, **fields))
    e2e = time.perf_counter() - start
    assert whole.finished and whole.finish_reason == "length"
    assert list(whole.token_ids) == [t for r in streamed for t in r.token_ids]
    assert whole.text == "".join(r.text for r in streamed)
    assert [(lp.token_id, lp.logprob) for lp in whole.logprobs] == [
        (lp.token_id, lp.logprob) for r in streamed for lp in r.logprobs
    ]
    assert whole.usage.completion_tokens == 12
    assert 0 < whole.ttft_s < e2e and 0 < streamed[-1].ttft_s
    # n = 2: one finished response per completion.
    pair = collect(stub, request([5, 6], max_tokens=5, n=2, seed=3, final_only=True,
                                 ignore_eos=True))
    assert sorted(r.index for r in pair) == [0, 1]
    assert all(r.finished and len(r.token_ids) == 5 for r in pair)


def test_defaults_and_logprobs(stub: pb_grpc.MoeEngineStub) -> None:
    responses = collect(stub, request([9, 10], ignore_eos=True))
    assert responses[-1].usage.completion_tokens == 16  # max_tokens unset -> 16
    assert responses[-1].request_id.startswith("req-")  # made by the server
    responses = collect(stub, request([9, 10], max_tokens=3, logprobs=2, ignore_eos=True))
    entries = [lp for r in responses for lp in r.logprobs]
    assert len(entries) == 3
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2


BAD_INPUTS = [
    # (case id, request fields, status code, field named)
    ("empty-prompt", {"ids": []}, "INVALID_ARGUMENT", "prompt"),
    ("no-prompt", {}, "INVALID_ARGUMENT", "prompt"),
    ("text-without-tokenizer", {"text": "hello"}, "INVALID_ARGUMENT", "text"),
    ("negative-token-id", {"ids": [3, -1]}, "INVALID_ARGUMENT", "prompt_ids"),
    ("token-id-at-vocab", {"ids": [3, VOCAB]}, "INVALID_ARGUMENT", "prompt_ids"),
    ("prompt-over-max-model-len", {"ids": [3] * 300}, "OUT_OF_RANGE", "prompt"),
    ("prompt-exactly-max-model-len", {"ids": [3] * MAX_MODEL_LEN}, "OUT_OF_RANGE", "prompt"),
    (
        "prompt-plus-max-tokens",
        {"ids": [3] * 200, "max_tokens": 100},
        "OUT_OF_RANGE",
        "max_tokens",
    ),
    ("max-tokens-zero", {"ids": [3], "max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens"),
    ("max-tokens-negative", {"ids": [3], "max_tokens": -4}, "INVALID_ARGUMENT", "max_tokens"),
    (
        "min-over-max",
        {"ids": [3], "max_tokens": 2, "min_tokens": 5},
        "INVALID_ARGUMENT",
        "min_tokens",
    ),
    ("temperature-negative", {"ids": [3], "temperature": -0.5}, "INVALID_ARGUMENT", "temperature"),
    ("temperature-nan", {"ids": [3], "temperature": math.nan}, "INVALID_ARGUMENT", "temperature"),
    ("top-p-zero", {"ids": [3], "top_p": 0.0}, "INVALID_ARGUMENT", "top_p"),
    ("top-p-over-one", {"ids": [3], "top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
    ("top-k-zero", {"ids": [3], "top_k": 0}, "INVALID_ARGUMENT", "top_k"),
    ("top-k-below-minus-one", {"ids": [3], "top_k": -2}, "INVALID_ARGUMENT", "top_k"),
    ("logprobs-over-cap", {"ids": [3], "logprobs": 21}, "INVALID_ARGUMENT", "logprobs"),
    ("logprobs-negative", {"ids": [3], "logprobs": -1}, "INVALID_ARGUMENT", "logprobs"),
    ("priority-under-fcfs", {"ids": [3], "priority": 2}, "INVALID_ARGUMENT", "priority"),
    ("stop-empty", {"ids": [3], "stop": [""]}, "INVALID_ARGUMENT", "stop"),
    ("stop-too-many", {"ids": [3], "stop": ["ab"] * 65}, "INVALID_ARGUMENT", "stop"),
    ("request-id-too-long", {"ids": [3], "request_id": "r" * 257}, "INVALID_ARGUMENT",
     "request_id"),
    (
        "stop-token-id",
        {"ids": [3], "stop_token_ids": [VOCAB]},
        "INVALID_ARGUMENT",
        "stop_token_ids",
    ),
    ("oversize-text", {"text": "x" * (MAX_MESSAGE_BYTES + 10)}, "INVALID_ARGUMENT", "text"),
    ("oversize-ids", {"ids": [300] * 40_000}, "INVALID_ARGUMENT", "prompt_ids"),
    # Far over the limit (over the old 2x + 1 MiB transport cap): still the servicer's message.
    ("oversize-text-far", {"text": "x" * (3 * 1024 * 1024)}, "INVALID_ARGUMENT", "text"),
]


@pytest.mark.parametrize(
    ("fields", "code", "field"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_matrix(stub: pb_grpc.MoeEngineStub, fields: dict, code: str, field: str) -> None:
    fields = dict(fields)
    req = request(fields.pop("ids", None), **fields)
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, req)
    err = info.value
    assert err.code().name == code, err.details()
    assert field in err.details()
    assert dict(err.trailing_metadata())["moe-field"] == field
    # The server keeps serving.
    ok = collect(stub, request([4, 5], max_tokens=1))
    assert ok[-1].finished and ok[-1].usage.completion_tokens == 1


def test_out_of_range_message_states_limit_and_counts(stub: pb_grpc.MoeEngineStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, request([3] * 200, max_tokens=100))
    details = info.value.details()
    assert "256" in details and "200" in details and "100" in details


def test_duplicate_live_request_id(stub: pb_grpc.MoeEngineStub) -> None:
    first = stub.Generate(request([7] * 5, max_tokens=200, ignore_eos=True, request_id="dup"))
    next(first)  # running now
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, request([7], max_tokens=2, request_id="dup"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in info.value.details()
    first.cancel()


def test_abort_is_idempotent(stub: pb_grpc.MoeEngineStub) -> None:
    start = stats(stub)
    stream = stub.Generate(request([11] * 8, max_tokens=240, ignore_eos=True, request_id="ab"))
    next(stream)
    assert stub.Abort(pb.AbortRequest(request_id="ab")).aborted
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 240
    assert not stub.Abort(pb.AbortRequest(request_id="ab")).aborted
    assert not stub.Abort(pb.AbortRequest(request_id="never-existed")).aborted
    # Empty id: unknown, so OK with aborted = false (as the proto says).
    assert not stub.Abort(pb.AbortRequest(request_id="")).aborted
    wait_idle(stub, start.kv_blocks_free)
    assert stats(stub).num_aborted >= start.num_aborted + 1


def test_short_requests_finish_while_long_ones_run(server: ServerThread) -> None:
    long_tokens = 64

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            long_counts = [0, 0]
            done_at: dict[str, list[int]] = {}

            async def run(name: str, req: pb.GenerateRequest, counter: int | None) -> None:
                async for r in stub.Generate(req):
                    if counter is not None:
                        long_counts[counter] += len(r.token_ids)
                    if r.finished:
                        done_at[name] = list(long_counts)

            longs = [
                run(f"long{i}", request([20 + i] * 10, max_tokens=long_tokens, ignore_eos=True), i)
                for i in range(2)
            ]
            shorts = [
                run(f"short{i}", request([30 + i] * 6, max_tokens=3, ignore_eos=True), None)
                for i in range(3)
            ]
            await asyncio.gather(*longs, *shorts)
            for i in range(3):
                # Delivered while both long streams were still far from done.
                assert max(done_at[f"short{i}"]) < long_tokens // 2, done_at
            assert done_at["long0"][0] == long_tokens and done_at["long1"][1] == long_tokens

    asyncio.run(main())


def test_cancel_50_streams_frees_kv_blocks(server: ServerThread, stub) -> None:
    start = stats(stub)
    assert start.kv_blocks_free == start.kv_blocks_total
    rng = random.Random(0)

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            aio_stub = pb_grpc.MoeEngineStub(channel)

            async def one(i: int) -> None:
                prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))]
                call = aio_stub.Generate(request(prompt, max_tokens=150, ignore_eos=True))
                cancel_after = rng.randint(0, 25)
                if cancel_after == 0:
                    await asyncio.sleep(rng.random() * 0.05)
                else:
                    seen = 0
                    async for _ in call:
                        seen += 1
                        if seen >= cancel_after:
                            break
                call.cancel()

            await asyncio.gather(*(one(i) for i in range(50)))

    asyncio.run(main())
    wait_idle(stub, start.kv_blocks_free)
    end = stats(stub)
    assert 0 < end.num_aborted - start.num_aborted <= 50


def test_deadline_aborts_request(stub: pb_grpc.MoeEngineStub) -> None:
    """A deadline a third of the time the same request takes to finish here (however fast
    the machine) ends it with DEADLINE_EXCEEDED and aborts it in the engine."""
    long = request([12] * 4, max_tokens=250, ignore_eos=True)
    took = []
    for _ in range(2):  # the faster of two: a load spike in one would make the deadline loose
        t0 = time.monotonic()
        collect(stub, long)
        took.append(time.monotonic() - t0)
    deadline_s = max(min(took) / 3, 0.05)
    start = stats(stub)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, long, timeout=deadline_s)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    wait_idle(stub, start.kv_blocks_free, timeout_s=10)
    assert stats(stub).num_aborted == start.num_aborted + 1


def test_metrics_endpoint(server: ServerThread, stub) -> None:
    collect(stub, request([13] * 3, max_tokens=4, ignore_eos=True))
    time.sleep(0.5)  # one stats poll
    port = server.server.options.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "moe_engine_num_requests_running",
        "moe_engine_num_requests_waiting",
        "moe_engine_kv_cache_usage_ratio",
        "moe_engine_time_to_first_token_seconds_bucket",
        "moe_engine_time_per_output_token_seconds_bucket",
        "moe_engine_e2e_request_latency_seconds_bucket",
        "moe_engine_prompt_tokens_total",
        "moe_engine_generation_tokens_total",
        "moe_engine_num_preemptions_total",
    ):
        assert name in text, name
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["moe_engine_time_to_first_token_seconds_count"] >= 1
    assert values["moe_engine_generation_tokens_total"] >= 4


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_engine.cli.client", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_cli_env(),
    )


def test_cli_generate_json(server: ServerThread, stub) -> None:
    args = ["--server", server.address, "generate", "--prompt-ids", "5,6,7"]
    proc = run_cli(*args, "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 6}
    direct = collect(stub, request([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True))
    assert result["token_ids"] == [t for r in direct for t in r.token_ids]
    bad = run_cli(*args, "--max-tokens", "0")  # refused by the client, naming the flag
    assert bad.returncode == 2 and "--max-tokens: max_tokens must be >= 1" in bad.stderr
    long = run_cli(*args, "--max-tokens", str(MAX_MODEL_LEN))  # refused by the server
    assert long.returncode == 1
    assert "OUT_OF_RANGE" in long.stderr and "max_model_len" in long.stderr


def test_cli_batch_stats_info(server: ServerThread, tmp_path: Path) -> None:
    lines = [
        {"prompt_ids": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0},
        {"prompt_ids": [8] * 20, "max_tokens": 9, "ignore_eos": True, "temperature": 0.7},
        {"prompt_ids": [9, 10], "max_tokens": 2, "min_tokens": 1, "ignore_eos": True,
         "temperature": 0},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = run_cli("--server", server.address, "batch", str(path), "--concurrency", "2")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    results, summary = out[:-1], out[-1]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    for r in results:
        assert len(r["token_ids"]) == lines[r["index"]]["max_tokens"]
        assert r["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == len(r["token_ids"])
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    assert summary["output_tokens"] == 15 and summary["output_tokens_per_s"] > 0
    assert summary["wall_s"] > 0
    # --stream: every step's tokens as they come; greedy lines give the same tokens.
    proc = run_cli("--server", server.address, "batch", str(path), "--stream")
    assert proc.returncode == 0, proc.stderr
    streamed = {r["index"]: r for r in map(json.loads, proc.stdout.splitlines()[:-1])}
    final = {r["index"]: r for r in results}
    for i in (0, 2):
        assert streamed[i]["token_ids"] == final[i]["token_ids"]
        assert 0 < streamed[i]["ttft_s"] <= streamed[i]["e2e_s"]
    for command in ("stats", "info"):
        proc = run_cli("--server", server.address, command, "--json")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        key = "kv_blocks_total" if command == "stats" else "max_model_len"
        assert data[key] == (NUM_BLOCKS if command == "stats" else MAX_MODEL_LEN)


def test_moe_serve_cli_starts_serves_and_drains(qwen3_ckpt: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_engine.cli.serve",
            "--model",
            str(qwen3_ckpt),
            "--grpc-port",
            str(port),
            "--port",
            "0",
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            "1MiB",
            "--max-num-seqs",
            "8",
            "--log-level",
            "WARNING",
        ],
        env=_cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 120
            while True:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "moe-serve did not become SERVING"
                time.sleep(0.2)
        info = run_cli("--server", f"127.0.0.1:{port}", "info", "--json")
        assert json.loads(info.stdout)["max_model_len"] == 128
        gen = run_cli(
            "--server", f"127.0.0.1:{port}", "generate", "--prompt-ids", "1,2", "--max-tokens", "3"
        )
        assert gen.returncode == 0, gen.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_moe_serve_cli_bad_model_exits_nonzero(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_cli_env(),
    )
    assert proc.returncode == 1
    assert "config.json" in proc.stderr


def test_oversize_message_names_flag_size_and_limit(stub: pb_grpc.MoeEngineStub) -> None:
    size = 3 * 1024 * 1024  # far over the 64 KiB limit
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, request(text="x" * size))
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "text" in details and "--max-message-bytes" in details
    size_bytes = request(text="x" * size).ByteSize()
    assert str(MAX_MESSAGE_BYTES) in details and str(size_bytes) in details


def test_cli_stats_json_integers(server: ServerThread) -> None:
    proc = run_cli("--server", server.address, "stats", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("num_preemptions", "prompt_tokens_total", "generation_tokens_total"):
        assert isinstance(data[key], int), (key, data[key])
    assert data["prompt_tokens_total"] > 0
    assert isinstance(data["kv_cache_usage"], float)


def test_cli_batch_stop_string_and_bad_lines(server: ServerThread, tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt_ids": [5, 6], "max_tokens": 3, "stop": "rz"}) + "\n")
    proc = run_cli("--server", server.address, "batch", str(good))
    # a single string is read as one stop string; this model has no tokenizer, so the server
    # refuses stop strings, naming the field (they could never match)
    assert proc.returncode == 1, proc.stderr
    first = json.loads(proc.stdout.splitlines()[0])
    assert first["index"] == 0 and "stop" in json.dumps(first) and "tokenizer" in json.dumps(first)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [5], "max_tokens": "5"}\n[1, 2]\n')
    proc = run_cli("--server", server.address, "batch", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert "line 1" in lines[0] and "max_tokens" in lines[0] and "integer" in lines[0]
    assert "line 2" in lines[1] and "JSON object" in lines[1]


def test_cli_error_has_no_blank_line(server: ServerThread) -> None:
    args = ["--server", server.address, "generate", "--prompt-ids", "5", "--max-tokens",
            str(MAX_MODEL_LEN)]
    proc = run_cli(*args)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: OUT_OF_RANGE") and "max_tokens" in proc.stderr


def test_moe_serve_cli_bad_ports(qwen3_ckpt: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=_cli_env(),
        )

    for flag in ("--port", "--grpc-port", "--metrics-port"):
        proc = serve(flag, "99999")
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"moe-serve: error: {flag} must be in 0..65535, got 99999"
        ]
    port = free_port()
    proc = serve("--grpc-port", str(port), "--metrics-port", str(port), "--port", "0",
                 "--log-level", "ERROR")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--metrics-port" in errors[0] and str(port) in errors[0]


def test_metrics_port_in_use_leaves_no_core_process(qwen3_ckpt: Path, server: ServerThread) -> None:
    from moe_engine.errors import StartupError
    from moe_engine.server.app import MoeServer

    config = EngineConfig(model=ModelConfig(str(qwen3_ckpt), max_model_len=64))
    busy = server.server.options.metrics_port  # the shared server's metrics port
    moe = MoeServer(config, ServerOptions(port=0, metrics_port=busy))

    async def start() -> None:
        with pytest.raises(StartupError, match="--metrics-port"):
            await moe.start()

    asyncio.run(start())
    assert moe.engine.core_pid is None or not _pid_alive(moe.engine.core_pid)
    assert moe._server is None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_get_expert_load_grows_with_routed_tokens(stub: pb_grpc.MoeEngineStub) -> None:
    before = stub.GetExpertLoad(pb.GetExpertLoadRequest(), timeout=30)
    assert [layer.layer for layer in before.layers] == [0, 2]  # the fixture's layer 1 is dense
    prompt = [11, 12, 13, 14, 15]
    list(stub.Generate(request(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)))
    after = stub.GetExpertLoad(pb.GetExpertLoadRequest(), timeout=30)
    top_k = 2
    fed = len(prompt) + 4 - 1  # tokens that went through the model for this request
    for old, new in zip(before.layers, after.layers, strict=True):
        added = sum(new.tokens_per_expert) - sum(old.tokens_per_expert)
        assert added >= fed * top_k  # other tests' requests may also have run in between
        assert new.imbalance_ratio >= 1.0 and 0.0 < new.balancedness <= 1.0
