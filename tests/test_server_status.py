"""What a starting server tells clients (UNAVAILABLE text, health metadata, GET /health) and
the periodic stats log line once it serves. One fake-core server that takes ~5 s to "build
its kernels" (`fake_core:SlowStartEngineCore`)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import free_port, request

from moe_engine.server.app import STATUS_METADATA_KEY, MoeServer, ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import EngineConfig, ModelConfig

FAKE_CONFIG = EngineConfig(ModelConfig(model="/fake", max_model_len=256))
BUILDING = "building native CPU kernels"


def _http_health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _health(channel: grpc.Channel) -> tuple[int, str]:
    stub = health_pb2_grpc.HealthStub(channel)
    response, call = stub.Check.with_call(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return response.status, dict(call.trailing_metadata())[STATUS_METADATA_KEY]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_starting_server_says_what_it_does_then_serves_and_logs_stats(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_CORE_START_S", "5")
    metrics_port = free_port()
    options = ServerOptions(port=0, metrics_port=metrics_port, log_stats_interval_s=0.3)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = MoeServer(FAKE_CONFIG, options, core_factory="fake_core:SlowStartEngineCore")
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    caplog.set_level(logging.INFO, logger="moe_engine")
    try:
        _wait(lambda: server.engine.startup_status.phase == BUILDING, 60, "the kernel build")
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request([5, 6], max_tokens=2), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            text = info.value.details()
            assert text.startswith(f"server unavailable: {BUILDING}: fake_kernels ("), text
            assert "s elapsed, about" in text and text.endswith("; retry when health is SERVING")
            status, detail = _health(channel)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING and BUILDING in detail
            code, body = _http_health(metrics_port)
            assert (code, body["status"]) == (503, "NOT_SERVING") and BUILDING in body["detail"]
            started.result(60)
            assert _health(channel) == (health_pb2.HealthCheckResponse.SERVING, "serving")
            assert _http_health(metrics_port) == (200, {"status": "SERVING", "detail": "serving"})
            responses = list(stub.Generate(request([5, 6], max_tokens=80), timeout=30))
            assert responses[-1].finished
        assert any(BUILDING in r.getMessage() and "left" in r.getMessage()
                   for r in caplog.records if r.name == "moe_engine.engine.client")

        def stats_lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "moe_engine.server.metrics"]

        _wait(lambda: any("generation throughput" in x for x in stats_lines()), 10, "stats log")
        line = next(x for x in stats_lines() if "generation throughput" in x)
        assert line.startswith("running: ") and "KV cache usage: " in line, line
    finally:
        if not started.done():
            started.cancel()
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert not server.engine._proc.is_alive()


@pytest.mark.parametrize(
    ("report", "detail"),
    [
        ("building native CPU kernels (5 sources, 2 in parallel) into /c/x (once per source "
         "version), about 4 s", "5 sources, 2 in parallel"),
        ("building native CPU kernels: 2/5 sources compiled, 30 s elapsed, about 9 s left",
         "2/5 sources compiled"),
        ("building native CPU kernels: 5/5 sources compiled, linking, 80 s elapsed",
         "5/5 sources compiled, linking"),
    ],
)
def test_kernel_build_reports_do_not_repeat_the_phase_or_its_clock(report, detail) -> None:
    """The status line is "phase: detail (N s elapsed, about M s left)": the build's own
    report must not say the phase and the seconds a second time."""
    from moe_engine.engine.status import StartupStatus
    from moe_engine.models.kernel_binding import build_detail

    assert build_detail(report) == detail
    now = time.monotonic()
    line = StartupStatus().advance("building native CPU kernels", detail, 9.0, now).describe(now)
    assert line.count("building native CPU kernels") == 1 and line.count("elapsed") == 1, line
