"""Progress of a native kernel build: what the log and a `ProgressCallback` are told.

`Reporter` logs each report (start, end and failure as warnings, the rest as info, on the
`kernels.native.library` logger) and forwards (message, estimated seconds left or None) to a
callback:
when a build starts, every `PROGRESS_INTERVAL_S` while it runs (or while this process waits for
another process's build of the same sources) and when it ends. The estimate (`estimate_left`)
list-schedules the expected compile seconds of the sources still to compile over the parallel
compilers, scaled by how the finished ones compared with their expectation (so on a machine
slower than the expectation it rises as the evidence comes in), and is None while the build has
run past it.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger("kernels.native.library")

#: Longest silence of the progress reports during a build (seconds).
PROGRESS_INTERVAL_S = 10.0

#: (message, estimated seconds left or None when unknown); see
#: kernels.native.library.ProgressCallback.
Callback = Callable[[str, "float | None"], None]


def estimate_left(expected: Mapping[str, float], done: Mapping[str, float],
                  running: Mapping[str, float], jobs: int, link_s: float) -> float:
    """Seconds until the library is linked: the remaining compile work list-scheduled over
    `jobs` parallel compilers, plus the link.

    Args:
        expected: expected compile seconds of every source, by name.
        done: actual seconds of the sources compiled so far.
        running: seconds elapsed of the sources compiling now.
        jobs: parallel compilers.
        link_s: expected link seconds.

    Expectations are scaled by actual / expected of the finished sources (1 before any), or
    more when a source still compiling has already run longer than that predicts (a slow
    machine shows itself before its first source finishes).
    """
    scale = 1.0
    if done:
        scale = sum(done.values()) / max(sum(expected[n] for n in done), 1e-9)
    scale = max([scale, *(t / max(expected[n], 1e-9) for n, t in running.items())])
    loads = [max(expected[n] * scale - t, 0.0) for n, t in running.items()]
    loads += [0.0] * max(jobs - len(loads), 0)
    heapq.heapify(loads)
    pending = [n for n in expected if n not in done and n not in running]
    for n in sorted(pending, key=lambda n: -expected[n]):
        heapq.heappush(loads, heapq.heappop(loads) + expected[n] * scale)
    return max(loads, default=0.0) + link_s * scale


class Reporter:
    """Logs a build's progress and forwards it to a callback.

    Each report is (message, estimated seconds left or None); the estimate follows the
    finished sources' pace, and is None while the build has run past it.
    """

    def __init__(self, callback: Callback | None) -> None:
        self.callback = callback
        self.started = time.monotonic()
        self.last_report = self.started
        self.total = 0
        self.jobs = 1
        self.link_s = 0.0
        self.expected: dict[str, float] = {}
        self._eta: float | None = None  # the last estimate reported
        #: Whether anything was reported (a build or a wait began).
        self.active = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def due(self) -> bool:
        """Whether `PROGRESS_INTERVAL_S` passed since the last report."""
        return time.monotonic() - self.last_report >= PROGRESS_INTERVAL_S

    def eta(self) -> float | None:
        return self._eta

    def _emit(self, message: str, eta: float | None, level: int = logging.INFO) -> None:
        self.active = True
        self.last_report = time.monotonic()
        logger.log(level, "%s", message)
        if self.callback is not None:
            try:
                self.callback(message, eta)
            except Exception:  # a failing status display must not fail the build
                logger.exception("the native build's progress callback failed")

    def _clamp(self, eta: float | None) -> float | None:
        """`eta` rounded to 0.1 s, or None when the build has run past its estimate (under half
        a second left): it is still running, for an unknown time."""
        if eta is not None:
            eta = round(eta, 1) if eta >= 0.5 else None
        self._eta = eta
        return eta

    def _update(self, done: Mapping[str, float], running: Mapping[str, float]) -> float | None:
        return self._clamp(estimate_left(self.expected, done, running, self.jobs, self.link_s))

    def start(self, total: int, jobs: int, expected: dict[str, float], link_s: float,
              final: Path) -> None:
        """A build of `total` sources, `jobs` at a time, into `final` begins; `expected`:
        compile seconds by source name, `link_s`: link seconds."""
        self.started = time.monotonic()
        self.total, self.jobs, self.expected, self.link_s = total, jobs, expected, link_s
        eta = self._update({}, {})
        self._emit(f"building native CPU kernels ({total} sources, {jobs} in parallel) into "
                   f"{final} (once per source version){_about(eta)}", eta, logging.WARNING)

    def compiled(self, done: Mapping[str, float], running: Mapping[str, float]) -> None:
        """A source finished: update the estimate (reported at the next tick)."""
        self._update(done, running)

    def tick(self, done: Mapping[str, float], running: Mapping[str, float]) -> None:
        """The periodic report while sources compile."""
        eta = self._update(done, running)
        self._emit(f"building native CPU kernels: {len(done)}/{self.total} sources compiled, "
                   f"{self.elapsed():.0f} s elapsed{_about(eta, ' left')}", eta)

    def linking(self, done: Mapping[str, float], link_elapsed: float) -> None:
        """The periodic report while the library links (for `link_elapsed` seconds)."""
        scale = 1.0
        if done:
            scale = sum(done.values()) / max(sum(self.expected[n] for n in done), 1e-9)
        eta = self._clamp(self.link_s * scale - link_elapsed)
        self._emit(f"building native CPU kernels: {len(done)}/{self.total} sources compiled, "
                   f"linking, {self.elapsed():.0f} s elapsed{_about(eta, ' left')}", eta)

    def waiting(self, lock: Path, waited: float, *, first: bool) -> None:
        """Another process holds the build lock; its lock file says since when and how long
        it expected to take."""
        info: dict = {}
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(lock.read_text() or "{}")
        left = None
        if info.get("started") and info.get("expected_s"):
            left = info["started"] + info["expected_s"] - time.time()
        eta = self._clamp(left)
        who = f"process {info['pid']}" if info.get("pid") else "another process"
        message = (f"waiting for {who} to finish building the native CPU kernels ({lock}): "
                   f"{waited:.0f} s elapsed{_about(eta, ' left')}")
        self._emit(message, eta, logging.WARNING if first else logging.INFO)

    def done(self, final: Path) -> None:
        self._eta = 0.0
        self._emit(f"native CPU kernels built in {self.elapsed():.1f} s ({final})", 0.0,
                   logging.WARNING)

    def built_elsewhere(self, final: Path) -> None:
        """The wait ended with the library built by the lock's previous holder."""
        self._eta = 0.0
        self._emit(f"native CPU kernels built by another process ({final}), waited "
                   f"{self.elapsed():.1f} s", 0.0, logging.WARNING)

    def failed(self, reason: str) -> None:
        self._emit(f"building native CPU kernels failed after {self.elapsed():.1f} s: "
                   f"{reason.splitlines()[0]}", None, logging.WARNING)


def _about(eta: float | None, suffix: str = "") -> str:
    return f", about {eta:.0f} s{suffix}" if eta is not None else ""
