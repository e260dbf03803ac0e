"""`moe-client health` against a small grpc.health.v1 server in this process (no engine): the
status printed, the `moe-engine-status` detail, the exit status, `--wait` and `--json`."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moe_engine.cli import client
from moe_engine.cli.health import STATUS_DETAIL_METADATA_KEY

_Status = health_pb2.HealthCheckResponse


class _DetailedHealth(health.HealthServicer):
    """The standard servicer, plus a `moe-engine-status` detail in the trailing metadata."""

    detail = ""

    def Check(self, request, context):  # noqa: N802 - grpc's method name
        if self.detail:
            context.set_trailing_metadata(((STATUS_DETAIL_METADATA_KEY, self.detail),))
        return super().Check(request, context)


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[str, _DetailedHealth]]:
    servicer = _DetailedHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0).wait(5)


def _set(servicer: _DetailedHealth, status: int, detail: str = "") -> None:
    servicer.detail = detail
    servicer.set("", status)


def test_serving_exits_0(health_server, capsys) -> None:
    address, servicer = health_server
    _set(servicer, _Status.SERVING)
    assert client.main(["--server", address, "health"]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_not_serving_prints_the_servers_detail(health_server, capsys) -> None:
    address, servicer = health_server
    _set(servicer, _Status.NOT_SERVING, "building native CPU kernels, about 40 s left")
    assert client.main(["--server", address, "health"]) == 1
    assert capsys.readouterr().out == (
        "NOT_SERVING: building native CPU kernels, about 40 s left\n"
    )
    assert client.main(["--server", address, "health", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {
        "status": "NOT_SERVING",
        "detail": "building native CPU kernels, about 40 s left",
    }


def test_unknown_service_is_unknown(health_server, capsys) -> None:
    address, servicer = health_server
    _set(servicer, _Status.SERVING)
    assert client.main(["--server", address, "health", "--service", "nope.v1.X"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("UNKNOWN: ") and "nope.v1.X" in out


def test_wait_polls_until_serving(health_server, capsys) -> None:
    address, servicer = health_server
    _set(servicer, _Status.NOT_SERVING, "loading the model")
    timer = threading.Timer(1.0, _set, (servicer, _Status.SERVING))
    timer.start()
    try:
        start = time.monotonic()
        assert client.main(["--server", address, "health", "--wait", "30"]) == 0
        assert 0.9 < time.monotonic() - start < 20
    finally:
        timer.cancel()
    assert capsys.readouterr().out == "NOT_SERVING: loading the model\nSERVING\n"


def test_wait_gives_up_on_an_address_where_nothing_listens(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    assert client.main(["--server", address, "health", "--wait", "1"]) == 1
    assert time.monotonic() - start < 15
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("UNKNOWN: UNAVAILABLE")
    assert f"the server may not be running at {address}" in out[-1]


@pytest.mark.parametrize("wait", ["-1", "nan", "inf", "soon"])
def test_bad_wait_is_refused(wait: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        client.main(["health", "--wait", wait])
    assert info.value.code == 2 and "--wait" in capsys.readouterr().err
