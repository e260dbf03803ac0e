"""`moe-client health`: the standard gRPC health check (grpc.health.v1 `Check`).

Prints the serving status (SERVING, NOT_SERVING or UNKNOWN) and, when the server adds one, the
human detail of its trailing metadata key `moe-engine-status` (for example "building native
CPU kernels, about 40 s left"). Exit status 0 only when SERVING. `--wait S` polls until the
server is SERVING or S seconds have passed, through connection failures (a server still
starting).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_engine.cli.argtypes import non_negative_seconds

#: The trailing-metadata key in which moe-serve's health service says why it is not serving.
STATUS_DETAIL_METADATA_KEY = "moe-engine-status"
#: Seconds between two checks with --wait.
POLL_INTERVAL_S = 0.5
#: The deadline of one check when --timeout is not given (seconds).
DEFAULT_CHECK_TIMEOUT_S = 10.0
#: With --wait, a detail that changed (same status) is printed again after this many seconds.
_REPRINT_S = 10.0

_Status = health_pb2.HealthCheckResponse.ServingStatus


@dataclass(frozen=True)
class HealthResult:
    """One health check's outcome.

    Attributes:
        status: "SERVING", "NOT_SERVING" or "UNKNOWN" (also for SERVICE_UNKNOWN, an unknown
            service name, or a server that could not be asked).
        detail: the server's `moe-engine-status` text, or why the check failed; "" for none.
        reachable: False when the call itself failed (no server, deadline, refused).
    """

    status: str
    detail: str = ""
    reachable: bool = True

    def line(self) -> str:
        """`STATUS` or `STATUS: detail`."""
        return f"{self.status}: {self.detail}" if self.detail else self.status


def add_health_parser(sub: argparse._SubParsersAction) -> None:
    """The `health` subcommand and its flags."""
    h = sub.add_parser(
        "health",
        help="is the server serving? (grpc.health.v1 Check; exit 0 only when SERVING)",
    )
    h.add_argument(
        "--service",
        default="",
        help="service name to check (default: '', the whole server)",
    )
    h.add_argument(
        "--wait",
        type=non_negative_seconds,
        default=0.0,
        metavar="SECONDS",
        help="poll until SERVING for at most this many seconds (default: 0, check once)",
    )
    h.add_argument("--json", action="store_true", help="print {status, detail} as JSON")


def check_health(
    channel: grpc.Channel,
    service: str,
    timeout: float,
    describe_error: Callable[[grpc.RpcError], str],
) -> HealthResult:
    """One `Check` call.

    Args:
        channel: a channel to the server (with any metadata the server needs).
        service: the service name ("" for the whole server).
        timeout: the call's deadline (seconds).
        describe_error: text for a failed call (`CODE: details` and a hint).
    """
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response, call = stub.Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return HealthResult("UNKNOWN", f"the server does not know service {service!r}")
        return HealthResult("UNKNOWN", describe_error(err), reachable=False)
    detail = ""
    for key, value in call.trailing_metadata() or ():
        if key == STATUS_DETAIL_METADATA_KEY:
            detail = value.decode() if isinstance(value, bytes) else str(value)
    status = _Status.Name(response.status)
    return HealthResult("UNKNOWN" if status == "SERVICE_UNKNOWN" else status, detail)


def cmd_health(
    args: argparse.Namespace,
    channel: grpc.Channel,
    describe_error: Callable[[grpc.RpcError], str],
) -> int:
    """Check once, or poll with --wait until SERVING; print the status. Exit status 0 when
    SERVING, else 1."""
    deadline = time.monotonic() + args.wait
    per_call = args.timeout or DEFAULT_CHECK_TIMEOUT_S
    printed: tuple[str, float] | None = None  # (line, when) of the last progress line
    while True:
        left = deadline - time.monotonic()
        call_timeout = max(0.1, min(per_call, left)) if args.wait else per_call
        result = check_health(channel, args.service, call_timeout, describe_error)
        if result.status == "SERVING" or left <= POLL_INTERVAL_S:
            break
        printed = _progress(result, printed, args.json)
        time.sleep(POLL_INTERVAL_S)
    if args.json:
        print(json.dumps({"status": result.status, "detail": result.detail}))
    elif printed is None or printed[0] != result.line():
        print(result.line())
    return 0 if result.status == "SERVING" else 1


def _progress(
    result: HealthResult, printed: tuple[str, float] | None, quiet: bool
) -> tuple[str, float] | None:
    """Print a waiting status when it differs from the last one printed (a changed detail of
    the same status: at most every `_REPRINT_S` seconds)."""
    if quiet:
        return printed
    now = time.monotonic()
    if printed is not None:
        last, when = printed
        same_status = last.split(":", 1)[0] == result.status
        if last == result.line() or (same_status and now - when < _REPRINT_S):
            return printed
    print(result.line(), flush=True)
    return result.line(), now
