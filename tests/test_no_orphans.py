"""No engine process outlives the test helper, the server or the process that started it.

A core that outlived its front end once hung a clean-cache CI run at exit for 22 minutes: the
server helper's start timed out, nobody stopped the core, and interpreter shutdown waited for it.
These tests use the fake core (no model), so they cost seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from grpc_helpers import ServerThread, child_pids, free_port, process_alive

from moe_engine.errors import StartupError
from moe_engine.server.app import ServerOptions
from moe_engine.startup.config import EngineConfig, ModelConfig

TESTS = Path(__file__).parent
FAKE_CONFIG = EngineConfig(model=ModelConfig(model="fake", max_model_len=256))


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_server_thread_start_timeout_leaves_no_engine_process() -> None:
    before = child_pids(os.getpid())
    with pytest.raises(StartupError, match="not ready within 3 s"):
        ServerThread(FAKE_CONFIG, ServerOptions(port=0), startup_timeout_s=3,
                     core_factory="fake_core:SlowEngineCore")
    leftover = child_pids(os.getpid()) - before
    assert not leftover, f"engine processes left behind: {leftover}"


def test_server_thread_failed_start_leaves_no_engine_process() -> None:
    before = child_pids(os.getpid())
    with pytest.raises(StartupError, match="FailingEngineCore|failed"):
        ServerThread(FAKE_CONFIG, ServerOptions(port=0), startup_timeout_s=30,
                     core_factory="fake_core:FailingEngineCore")
    assert not child_pids(os.getpid()) - before


_SERVE_AND_WAIT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from grpc_helpers import ServerThread
    from moe_engine.startup.config import EngineConfig, ModelConfig
    from moe_engine.server.app import ServerOptions
    handle = ServerThread(EngineConfig(model=ModelConfig(model="fake", max_model_len=256)),
                          ServerOptions(port=0), core_factory="fake_core:FakeEngineCore")
    print(handle.core_pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_test_process_leaves_no_engine_process(sig: int) -> None:
    """The process that runs a server in a thread (pytest, here a stand-in) is killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_AND_WAIT.format(tests=str(TESTS))],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        core_pid = int(proc.stdout.readline())
        assert process_alive(core_pid)
        proc.send_signal(sig)
        proc.wait(30)
        assert wait_gone(core_pid, 10), f"engine core {core_pid} outlived its parent"
    finally:
        proc.kill()
        proc.wait(10)


_MARK = "123.4567"  # the fake compiler's sleep, to find its processes wherever they are


def _marked_processes() -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if _MARK.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return [pid for pid in found if process_alive(pid)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopping_moe_serve_during_the_kernel_build_stops_the_compilers(
    qwen3_ckpt: Path, tmp_path: Path, sig: int
) -> None:
    """Ctrl-C (or SIGTERM) while the first start compiles the kernels: moe-serve exits, and so
    do the compilers and their own children (a compiler driver's cc1plus)."""
    fake = tmp_path / "slow-cxx"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "slow-cxx 1.0"; exit 0; fi\n'
                    f"sleep {_MARK} &\nwait\n")
    fake.chmod(0o755)
    env = {**os.environ, "CXX": str(fake), "MOE_ENGINE_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt), "--port", "0",
         "--grpc-port", str(free_port()),
         "--max-model-len", "64", "--kv-cache-memory", "1MiB", "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _marked_processes():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the kernel build never started"
            time.sleep(0.2)
        proc.send_signal(sig)
        assert proc.wait(30) == 0, proc.communicate()[1]
        deadline = time.monotonic() + 10
        while _marked_processes():
            assert time.monotonic() < deadline, f"compilers left: {_marked_processes()}"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
        for pid in _marked_processes():
            os.kill(pid, signal.SIGKILL)
