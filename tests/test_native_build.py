"""The native kernels' build (kernels/native/build.py), progress (kernels/native/progress.py),
binding (kernels/native/binding.py) and loading (kernels/native/library.py): cache, lock, progress
reports, error messages.

Builds here compile a one-function stand-in for kernels/native/csrc (about a second) into fresh
temporary caches; the real sources build once per test session (the other native tests).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from grpc_helpers import child_pids, process_alive

import kernels.native.build as nb
import kernels.native.library as native
import kernels.native.progress as native_progress
from kernels.native.binding import binding_source, prototypes
from kernels.native.progress import Reporter, estimate_left

REPO = Path(__file__).resolve().parents[1]

TINY_HEADER = """\
#pragma once
#include <stdint.h>
#ifdef __cplusplus
#define MOE_ENGINE_API extern "C" __attribute__((visibility("default")))
#else
#define MOE_ENGINE_API __attribute__((visibility("default")))
#endif
MOE_ENGINE_API int32_t moe_engine_abi_version(void);
MOE_ENGINE_API int32_t moe_engine_vector_bits(void);
// a pointer, two integers and a float, as the real entry points take them
MOE_ENGINE_API int32_t tiny_scale(const float* x, int64_t n, float s, float* y,
                                  int32_t threads);
"""

TINY_SOURCE = """\
#include "moe_engine_cpu.h"
int32_t moe_engine_abi_version(void) { return %d; }
#ifdef __AVX512F__
int32_t moe_engine_vector_bits(void) { return 512; }
#else
int32_t moe_engine_vector_bits(void) { return 256; }
#endif
int32_t tiny_scale(const float* x, int64_t n, float s, float* y, int32_t threads) {
  if (n < 0) return 1;
#pragma omp parallel for num_threads(threads)
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
  return 0;
}
"""


def _tiny_csrc(path: Path, source: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "moe_engine_cpu.h").write_text(TINY_HEADER)
    (path / "tiny.cpp").write_text(source or TINY_SOURCE % nb.ABI_VERSION)
    return path


class Recorder:
    """A ProgressCallback keeping (message, eta) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []

    def __call__(self, message: str, eta: float | None) -> None:
        self.calls.append((message, eta))


def _assert_progress(calls: list[tuple[str, float | None]]) -> None:
    """Start message with an estimate, then ETAs (None allowed), then a final 0."""
    assert len(calls) >= 2, calls
    assert calls[0][0].startswith("building native CPU kernels ("), calls
    etas = [eta for _, eta in calls[:-1] if eta is not None]
    assert etas and etas[0] > 0, calls
    assert calls[-1][0].startswith("native CPU kernels built in ") and calls[-1][1] == 0.0


def test_prepare_native_reports_progress_then_loads_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nb, "CSRC", _tiny_csrc(tmp_path / "csrc"))
    monkeypatch.setattr(native_progress, "PROGRESS_INTERVAL_S", 0.02)  # a tick on every poll
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failure", None)
    progress = Recorder()
    assert native.prepare_native(progress) == list(native.KERNELS)
    _assert_progress(progress.calls)
    assert any("sources compiled" in m for m, _ in progress.calls[1:-1]), progress.calls
    tiny = native.load_native("moe_cpu")
    x = torch.arange(5, dtype=torch.float32)
    y = torch.empty_like(x)
    assert tiny.tiny_scale(x.data_ptr(), 5, 0.5, y.data_ptr(), 2) == 0
    assert torch.equal(y, x * 0.5)
    with pytest.raises(TypeError, match="tiny_scale takes 5 arguments"):
        tiny.tiny_scale(x.data_ptr())
    (build,) = [d for d in (tmp_path / "cache" / "native").iterdir() if d.is_dir()]
    record = json.loads((build / "build.json").read_text())
    assert set(record["compile_s"]) == {"tiny.cpp", "binding.cpp"}
    assert not list(build.parent.glob("*.tmp*"))

    # a new process (the module cache reset) loads the build: nothing compiles, nothing reports
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(nb.subprocess, "Popen", _no_compile(nb.subprocess.Popen))
    later = Recorder()
    assert native.prepare_native(later) == list(native.KERNELS)
    assert later.calls == []


def _no_compile(popen):
    """`popen` that fails the test on a compile or link (`--version` runs on every load)."""

    def run(cmd, *args, **kwargs):
        if "--version" not in cmd:
            raise AssertionError(f"compiled although cached: {cmd}")
        return popen(cmd, *args, **kwargs)

    return run


def test_a_source_edit_rebuilds(tmp_path):
    csrc = _tiny_csrc(tmp_path / "csrc")
    first = nb.ensure_library(tmp_path / "cache", Reporter(None), csrc)
    (csrc / "tiny.cpp").write_text(TINY_SOURCE % nb.ABI_VERSION + "// edited\n")
    second = nb.ensure_library(tmp_path / "cache", Reporter(None), csrc)
    assert first != second and first.is_file() and second.is_file()


def test_compile_error_names_the_source_and_quotes_the_compiler(tmp_path, monkeypatch):
    csrc = _tiny_csrc(tmp_path / "csrc", "int32_t broken( { return 0; }\n")
    progress = Recorder()
    with pytest.raises(nb.BuildError, match=r"compiling tiny\.cpp failed") as info:
        nb.ensure_library(tmp_path / "cache", Reporter(progress), csrc)
    assert "error" in str(info.value)  # the compiler's own message
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # no partial build
    # through the loader: NativeUnavailable carrying the message, the callback told once more
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nb, "CSRC", csrc)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failure", None)
    with pytest.raises(native.NativeUnavailable, match=r"tiny\.cpp failed[\s\S]*error"):
        native.prepare_native(progress)
    assert progress.calls[-1][0].startswith("building native CPU kernels failed")
    assert progress.calls[-1][1] is None


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(nb.BuildError, match="no C\\+\\+ compiler found"):
        nb.ensure_library(tmp_path / "cache", Reporter(None), _tiny_csrc(tmp_path / "csrc"))


def test_waiting_for_another_builder_reports_then_builds(tmp_path, monkeypatch):
    """While another process holds the build lock, ensure_library waits and says so; once the
    lock is free (its holder died without a result) it builds itself."""
    monkeypatch.setattr(native_progress, "PROGRESS_INTERVAL_S", 0.05)
    csrc = _tiny_csrc(tmp_path / "csrc")
    root = tmp_path / "cache"
    root.mkdir()
    name = nb.build_name(nb.find_compiler()[1], csrc)
    lock_path = root / f"{name}.lock"
    progress = Recorder()
    result: list[Path] = []
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(json.dumps({"pid": 12345, "started": time.time(), "expected_s": 30.0}))
        held.flush()
        worker = threading.Thread(
            target=lambda: result.append(nb.ensure_library(root, Reporter(progress), csrc)))
        worker.start()
        deadline = time.monotonic() + 30
        while len(progress.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(60)
    waits = [c for c in progress.calls if c[0].startswith("waiting for process 12345")]
    assert len(waits) >= 2, progress.calls
    assert 0 < waits[0][1] <= 30 and waits[-1][1] <= waits[0][1]
    _assert_progress(progress.calls[len(waits):])
    assert result and result[0].is_file()


_RACE = """\
import sys, time
from pathlib import Path
import kernels.native.build as nb
from kernels.native.progress import Reporter
messages = []
path = nb.ensure_library(Path(sys.argv[1]), Reporter(lambda m, e: messages.append(m)),
                         Path(sys.argv[2]))
print(path)
print("\\n".join(messages))
"""


def test_concurrent_processes_build_once(tmp_path):
    """Two processes needing the same build while a third holds its lock: after the release,
    one builds and the other loads that build (fcntl lock, atomic rename)."""
    csrc = _tiny_csrc(tmp_path / "csrc")
    root = tmp_path / "cache"
    root.mkdir()
    lock_path = root / f"{nb.build_name(nb.find_compiler()[1], csrc)}.lock"
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(root), str(csrc)],
                                  cwd=REPO, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
        time.sleep(1.0)  # both start and block on the lock
        fcntl.flock(held, fcntl.LOCK_UN)
    outs = [[line for line in p.communicate(timeout=120)[0].splitlines() if line]
            for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0] and Path(outs[0][0]).is_file()
    started = [o for o in outs if any(m.startswith("building native CPU kernels (") for m in o)]
    assert len(started) == 1, outs
    (other,) = [o for o in outs if o is not started[0]]
    # the other waited for the lock and found the build, or (started late) found it cached
    assert other[1:] == [] or (other[1].startswith("waiting for")
                               and other[-1].startswith("native CPU kernels built by another")
                               ), outs


def test_estimate_left_schedules_remaining_work():
    expected = {"a": 4.0, "b": 2.0, "c": 1.0}
    # nothing finished yet, but b has run 5x its expectation: everything is scaled by 5
    assert estimate_left(expected, {}, {"b": 10.0}, 1, 0.0) == pytest.approx(25.0)
    assert estimate_left(expected, {}, {}, 2, 0.5) == pytest.approx(4.5)  # a | b + c
    assert estimate_left(expected, {}, {}, 1, 0.0) == pytest.approx(7.0)
    # b took twice its expectation: the rest is scaled by 2
    assert estimate_left(expected, {"b": 4.0}, {"a": 3.0}, 2, 0.0) == pytest.approx(5.0)


def test_reported_estimates_follow_the_pace_and_end_at_zero(tmp_path):
    """A machine slower than expected (a compiler that takes 5x): the estimate rises with the
    evidence instead of promising 2 s for the whole build; the link reports too."""
    progress = Recorder()
    report = Reporter(progress)
    report.start(2, 1, {"a": 1.0, "b": 1.0}, 0.5, tmp_path)
    report.tick({"a": 5.0}, {})  # a took 5x its expectation: b and the link 5x as well
    report.tick({"a": 5.0}, {"b": 100.0})  # b is still at it after 100x its expectation:
    # the machine is that slow, and so will be the link
    report.linking({"a": 5.0, "b": 5.0}, 1.0)  # linking for 1 s of an expected 2.5
    report.linking({"a": 5.0, "b": 5.0}, 9.0)  # past it: unknown
    report.done(tmp_path)
    assert [eta for _, eta in progress.calls] == [2.5, 7.5, 50.0, 1.5, None, 0.0]
    assert "1/2 sources compiled" in progress.calls[1][0]
    assert "2/2 sources compiled, linking" in progress.calls[3][0]


def test_binding_generator_follows_the_header():
    header = (nb.CSRC / nb.HEADER).read_text()
    protos = prototypes(header)
    assert set(protos) == {"moe_engine_abi_version", "moe_engine_vector_bits", "moe_fused_moe",
                           "moe_fused_moe_q4", "moe_linear", "moe_linear_q4",
                           "moe_paged_decode_attention",
                           "moe_qk_norm_rope_cache", "moe_rms_norm", "moe_amx_available",
                           "moe_bf16_dot_available", "moe_prefill_attention",
                           "moe_amx_linear", "moe_amx_fused_moe",
                           "moe_router_softmax_topk", "moe_decode_layer",
                           "moe_router_topk_softmax", "moe_pack_q4_tiles", "moe_pack_tiles"}
    kinds = "".join(p.kind for p in protos["moe_rms_norm"])
    assert kinds == "piiiiipfiipi"
    assert "py_moe_fused_moe_q4" in binding_source(header)
    with pytest.raises(ValueError, match="double"):
        prototypes("MOE_ENGINE_API int32_t f(double x);")


def test_native_pool_is_made_once_and_links_no_openmp():
    """The kernels run on csrc/thread_pool.h's pool: at most threads - 1 workers, started by
    the first parallel call and reused by every later one; the module itself needs no OpenMP
    runtime (an OpenMP barrier would wait for threads the OS has not scheduled)."""
    from kernels.dense.ops import rms_norm

    lib = native._build("ops_cpu")
    if not Path("/proc/self/task").exists():
        pytest.skip("no /proc (not Linux)")
    assert b"GOMP_parallel" not in Path(lib.__file__).read_bytes(), "the module calls libgomp"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x, w = torch.randn(4096, 256), torch.randn(256)
        torch.add(torch.randn(1 << 20), 1.0)  # starts torch's own OpenMP pool first
        torch.testing.assert_close(x, x)
        tasks = len(list(Path("/proc/self/task").iterdir()))
        first = rms_norm(x, w, 1e-6)  # a parallel native call: starts the pool
        grown = len(list(Path("/proc/self/task").iterdir()))
        assert tasks <= grown <= tasks + 1
        for _ in range(5):
            torch.testing.assert_close(rms_norm(x, w, 1e-6), first, rtol=0, atol=0)
        assert len(list(Path("/proc/self/task").iterdir())) == grown
    finally:
        torch.set_num_threads(before)


def test_a_builder_killed_mid_build_leaves_no_compiler_running(tmp_path):
    """The server (here a stand-in process) is SIGKILLed while its compilers run: they get
    SIGKILL too (PR_SET_PDEATHSIG) instead of running on under init."""
    fake = tmp_path / "slow-cxx"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "slow-cxx 1.0"; exit 0; fi\n'
                    "exec sleep 120\n")
    fake.chmod(0o755)
    csrc = _tiny_csrc(tmp_path / "csrc")
    root = tmp_path / "cache"
    root.mkdir()
    env = {**os.environ, "CXX": str(fake)}
    proc = subprocess.Popen([sys.executable, "-c", _RACE, str(root), str(csrc)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (compilers := child_pids(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert compilers, "the build never started a compiler"
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(process_alive(c) for c in compilers):
            assert time.monotonic() < deadline, f"compilers {compilers} outlived the builder"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)


def test_a_stop_signal_during_a_compiler_start_waits_until_it_is_recorded(tmp_path):
    """SIGTERM that lands while a compiler starts (the race that once left a compiler's child
    behind) raises only once the compiler is recorded, so the builder's cleanup sees it."""

    def stop(signum, frame):
        raise SystemExit(f"stopped by {signum}")

    before = signal.signal(signal.SIGTERM, stop)
    running = {}
    try:
        with pytest.raises(SystemExit, match="stopped by 15"):
            with nb._stop_signals_held(), open(tmp_path / "log", "wb") as sink:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler would have run by now
                running["x"] = nb._spawn(["sleep", "30"], sink)
        assert "x" in running and process_alive(running["x"].pid)
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, before)
        for proc in running.values():
            nb._kill_group(proc)
