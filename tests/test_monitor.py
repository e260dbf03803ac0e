"""FrontEndMonitor in this process (its exit replaced by a flag): silence ends it, heartbeats
keep it, its own pause does not count, and startup progress reaches the front end's socket."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import zmq

from moe_engine.engine import monitor as monitor_module
from moe_engine.engine.messages import Heartbeat, StartupProgress, decode_output, encode
from moe_engine.engine.monitor import FrontEndMonitor


class _Recorded(FrontEndMonitor):
    """Records the exit reason instead of ending the process, then stops."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exited = threading.Event()
        self.reason = ""

    def _exit(self, reason: str) -> None:
        self.reason = reason
        self.exited.set()
        self._stopping.set()


@pytest.fixture
def front_end(tmp_path: Path):
    """A PUB (heartbeats) and a PULL (outputs) bound on ipc paths, as EngineClient binds them."""
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    hb, out = f"ipc://{tmp_path}/hb.sock", f"ipc://{tmp_path}/out.sock"
    pub.bind(hb)
    pull.bind(out)
    yield ctx, pub, pull, hb, out
    for sock in (pub, pull):
        sock.close(linger=0)
    ctx.term()


def test_silence_ends_it_and_heartbeats_keep_it(front_end) -> None:
    ctx, pub, _, hb, _ = front_end
    monitor = _Recorded(ctx, "test core", os.getppid(), hb, None, timeout_s=1.0)
    monitor.start()
    try:
        until = time.monotonic() + 2.5  # over twice the bound, with heartbeats
        while time.monotonic() < until:
            pub.send(encode(Heartbeat(time.time())))
            time.sleep(0.1)
        assert not monitor.exited.is_set()
        silent_at = time.monotonic()
        assert monitor.exited.wait(5.0)
        assert 0.8 <= time.monotonic() - silent_at < 3.0
        assert "no heartbeat from the front end" in monitor.reason
    finally:
        monitor.stop()


def test_its_own_pause_is_not_silence(front_end, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, _, _, hb, _ = front_end
    real, offset = time.monotonic, [0.0]
    monkeypatch.setattr(monitor_module.time, "monotonic", lambda: real() + offset[0])
    monitor = _Recorded(ctx, "test core", os.getppid(), hb, None, timeout_s=1.5)
    monitor.start()
    try:
        time.sleep(0.5)
        offset[0] += 60.0  # the clock jumps: this process was stopped for a minute
        time.sleep(0.6)
        assert not monitor.exited.is_set()
        assert monitor.exited.wait(5.0), "silence after the pause went unnoticed"
    finally:
        monitor.stop()


def test_progress_is_forwarded_from_any_thread(front_end) -> None:
    ctx, _, pull, _, out = front_end
    monitor = _Recorded(ctx, "test core", os.getppid(), None, out)
    monitor.start()
    try:
        worker = threading.Thread(target=monitor.report, args=("building native CPU kernels",
                                                              "moe_cpu", 30.0))
        worker.start()
        worker.join()
        assert pull.poll(5000)
        assert decode_output(pull.recv()) == StartupProgress(
            "building native CPU kernels", "moe_cpu", 30.0
        )
    finally:
        monitor.stop()
    assert not monitor.is_alive()


def test_a_gone_parent_ends_it(front_end) -> None:
    ctx, *_ = front_end
    monitor = _Recorded(ctx, "test core", os.getpid() + 10**6, None)  # not our parent
    monitor.start()
    try:
        assert monitor.exited.wait(5.0)
        assert "parent" in monitor.reason
    finally:
        monitor.stop()


def test_a_failed_collective_names_the_silent_front_end(front_end) -> None:
    """A rank whose collective fails because a peer rank already left for missing heartbeats
    (the peers' monitors race) reports the silence, not the closed connection; while the
    front end is heartbeating, `exit_if_silent` returns and the failure is the rank's own."""
    ctx, pub, _, hb, _ = front_end
    monitor = _Recorded(ctx, "rank 1", os.getppid(), hb, None, timeout_s=30.0)
    monitor.start()
    try:
        for _ in range(10):
            pub.send(encode(Heartbeat(time.time())))
            time.sleep(0.1)
        monitor.exit_if_silent("a collective failed")
        assert not monitor.exited.is_set() and monitor.silence_s() is None
        time.sleep(2 * monitor_module.HEARTBEAT_INTERVAL_S + 0.6)  # the front end went quiet
        assert monitor.silence_s() is not None and not monitor.exited.is_set()
        monitor.exit_if_silent("a collective failed")
        assert monitor.exited.is_set()
        assert "no heartbeat from the front end" in monitor.reason
        assert "a collective failed" in monitor.reason
    finally:
        monitor.stop()
