"""SIGTERM drains `moe-serve` (one rank, and two expert-parallel ranks started by torch's elastic
launcher), as a user runs it: a subprocess on the tiny checkpoint.

With one batch slot (--max-num-seqs 1), a short request runs while eight long ones queue behind
it. On SIGTERM: health turns NOT_SERVING and new requests get UNAVAILABLE at once; the short
request finishes; when --drain-timeout runs out, whatever is left is aborted (each stream ends
with one finish_reason "abort" response); the process exits 0 and leaves no child behind.
Eight long requests of 1016 tokens cannot all finish in the 3-second drain (6 s at ep 2) unless
the engine steps faster than 0.37 ms (0.74 ms at ep 2; a batch-1 step of the tiny checkpoint
takes about 1 ms on a quiet AVX-512 core and 5 ms on a loaded 2-core machine), while the
60-token short one has 50 ms (100 ms) per step. (Three long requests were not enough once the
native kernels got faster: all three finished inside the drain.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import free_port, request

from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
#: seconds of drain per ep size: two ranks step in lockstep over gloo, slower per token, so
#: the short request gets more time (the long ones still need far more than that).
DRAIN_TIMEOUT_S = {1: 3.0, 2: 6.0}
SHORT_TOKENS = 60
LONG_TOKENS = 1016
NUM_LONG = 8


def _children(pid: int) -> set[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def _descendants(pid: int) -> set[int]:
    """Children, grandchildren, ... of `pid` (the ranks are the launcher's children)."""
    found, frontier = set(), {pid}
    while frontier:
        nxt = set().union(*(_children(p) for p in frontier)) - found
        found |= nxt
        frontier = nxt
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class _Stream(threading.Thread):
    """Runs one Generate call, noting its responses or its error."""

    def __init__(self, stub: pb_grpc.MoeEngineStub, req) -> None:
        super().__init__(daemon=True)
        self.stub, self.req = stub, req
        self.responses: list = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for r in self.stub.Generate(self.req, timeout=120):
                self.responses.append(r)
                self.started.set()
        except grpc.RpcError as err:
            self.error = err
        self.started.set()


def _wait_serving(channel: grpc.Channel, proc: subprocess.Popen) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 120
    while True:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "moe-serve did not become SERVING"
        time.sleep(0.2)


@pytest.mark.parametrize("ep_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_drains_then_aborts_and_exits_0(qwen3_ckpt: Path, ep_size: int) -> None:
    drain_s = DRAIN_TIMEOUT_S[ep_size]
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt),
            "--grpc-port", str(port), "--port", "0", "--max-model-len", "1024",
            "--kv-cache-memory", "4MiB",
            "--max-num-seqs", "1", "--drain-timeout", str(drain_s),
            "--log-level", "WARNING", "--ep-size", str(ep_size),
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as channel:
            _wait_serving(channel, proc)
            children = _descendants(proc.pid)
            assert len(children) >= ep_size, "the engine runs in child processes"
            stub = pb_grpc.MoeEngineStub(channel)
            short = _Stream(stub, request([5, 6, 7], max_tokens=SHORT_TOKENS, ignore_eos=True))
            short.start()
            assert short.started.wait(60) and short.error is None
            longs = [
                _Stream(stub, request([8 + i] * 4, max_tokens=LONG_TOKENS, ignore_eos=True))
                for i in range(NUM_LONG)
            ]
            for stream in longs:
                stream.start()
            time.sleep(0.2)  # the long requests are queued behind the short one
            proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != (
                health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                assert time.monotonic() - t_term < 5, "health still SERVING after SIGTERM"
                time.sleep(0.02)
            try:
                list(stub.Generate(request([4, 5], max_tokens=2), timeout=5))
                raise AssertionError("a new request was accepted while draining")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert "shutting down" in err.details()
            assert time.monotonic() - t_term < drain_s, "too slow to test the drain"
            for stream in [short, *longs]:
                stream.join(30)
                assert not stream.is_alive()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        elapsed = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The short request finished; the long ones ended, each with exactly one final response.
    assert short.error is None and short.responses[-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in short.responses) == SHORT_TOKENS
    reasons = []
    for stream in longs:
        assert stream.error is None, stream.error
        finished = [r.finished for r in stream.responses]
        assert finished == [False] * (len(finished) - 1) + [True]
        reason = stream.responses[-1].finish_reason
        tokens = sum(len(r.token_ids) for r in stream.responses)
        assert (reason, tokens == LONG_TOKENS) in (("abort", False), ("length", True))
        reasons.append(reason)
    assert "abort" in reasons, reasons
    assert drain_s <= elapsed < drain_s + 15, elapsed
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], "a child process outlived moe-serve"
