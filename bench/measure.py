"""Alternating timed runs of several engines on one shared machine, and what they produced.

Every engine is loaded before the first run; then round after round each (engine, mode) pair
runs once in a fixed order, so that load from elsewhere on the machine hits all of them alike.
Before each run the driver waits (up to `settle_s`) until every other engine's process is
quiet, and it measures how much CPU those processes take while the run goes on: an idle
engine that spins (OpenMP busy-waiting, a polling loop) would otherwise slow the one timed.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from workload import BenchEngine, RunResult

logger = logging.getLogger("bench.measure")

#: A process counts as quiet when it used under this share of one core over a poll interval.
QUIET_SHARE = 0.05
POLL_S = 0.2


@dataclass
class IdleLoad:
    """CPU an engine's process used while other engines were being timed (seconds)."""

    cpu_s: float = 0.0
    wall_s: float = 0.0

    def share(self) -> float | None:
        """Cores' worth of CPU taken on average (0.01 = 1% of one core); None before any run."""
        return round(self.cpu_s / self.wall_s, 4) if self.wall_s else None


def _cpu(engines: list[BenchEngine]) -> list[float | None]:
    return [e.cpu_seconds() for e in engines]


def settle(others: list[BenchEngine], max_s: float) -> float:
    """Wait until every engine in `others` used under QUIET_SHARE of a core over one POLL_S
    interval, at most `max_s` seconds; returns the seconds waited."""
    t0 = time.perf_counter()
    if not others or max_s <= 0:
        return 0.0
    before = _cpu(others)
    while time.perf_counter() - t0 < max_s:
        time.sleep(POLL_S)
        now = _cpu(others)
        if all(a is None or b is None or b - a < QUIET_SHARE * POLL_S
               for a, b in zip(before, now, strict=True)):
            break
        before = now
    return time.perf_counter() - t0


def _one_per_process(engines: dict[str, BenchEngine], running: BenchEngine) -> list[BenchEngine]:
    """One engine per process other than `running`'s (in-process engines share the driver's)."""
    seen, out = {running.pid}, []
    for e in engines.values():
        if e.pid not in seen:
            seen.add(e.pid)
            out.append(e)
    return out


def measure_alternating(engines: dict[str, BenchEngine], modes: list[str], warmup: int,
                        runs: int, settle_s: float = 5.0) -> dict:
    """`warmup` untimed rounds, then `runs` timed rounds of every (engine, mode) in order.

    Returns `{"results": {name: {mode: {"output_tokens_per_s": median, "runs_s": [...],
    "output_tokens"}}}, "token_ids": {name: [[int]] of the last batched run}, "idle": {names of
    a process: {"cpu_s", "wall_s", "share"}}}`. A pair that raises gets `{"output_tokens_per_s":
    None, "error": "Type: message"}` and drops out while the others go on.
    """
    tasks = [(name, mode) for name in engines for mode in modes]
    results: dict[str, dict[str, dict]] = {name: {} for name in engines}
    rates: dict[tuple[str, str], list[float]] = {t: [] for t in tasks}
    seconds: dict[tuple[str, str], list[float]] = {t: [] for t in tasks}
    tokens: dict[tuple[str, str], int] = {}
    token_ids: dict[str, list[list[int]]] = {}
    idle = {e.pid: IdleLoad() for e in engines.values()}
    for rnd in range(warmup + runs):
        timed, last = rnd >= warmup, rnd == warmup + runs - 1
        for name, mode in [t for t in tasks if mode_ok(results, t)]:
            engine = engines[name]
            others = _one_per_process(engines, engine)
            settle(others, settle_s)
            # the idle window brackets both CPU readings, nothing else
            t0 = time.perf_counter()
            before = _cpu(others)
            try:
                res: RunResult = engine.run(mode, return_token_ids=last and mode == "batched")
            except Exception as exc:  # report the other engines' figures anyway
                logger.exception("%s (%s) failed", name, mode)
                results[name][mode] = {"output_tokens_per_s": None,
                                       "error": f"{type(exc).__name__}: {exc}"}
                continue
            after = _cpu(others)
            wall = time.perf_counter() - t0
            for other, a, b in zip(others, before, after, strict=True):
                if a is not None and b is not None:
                    idle[other.pid].cpu_s += b - a
                    idle[other.pid].wall_s += wall
            if res.token_ids is not None:
                token_ids[name] = res.token_ids
            rate = res.output_tokens / res.seconds
            if not timed:
                logger.info("%s %s: warm-up %d took %.1f s", name, mode, rnd + 1, res.seconds)
                continue
            rates[(name, mode)].append(rate)
            seconds[(name, mode)].append(round(res.seconds, 3))
            tokens[(name, mode)] = res.output_tokens
            logger.info("%s %s: run %d: %d tokens in %.2f s = %.1f tok/s", name, mode,
                        rnd - warmup + 1, res.output_tokens, res.seconds, rate)
    for name, mode in tasks:
        if mode_ok(results, (name, mode)):
            results[name][mode] = {
                "output_tokens_per_s": round(statistics.median(rates[(name, mode)]), 2),
                "runs_s": seconds[(name, mode)], "output_tokens": tokens[(name, mode)]}
    idle_out = {}
    for pid, load in idle.items():
        names = ", ".join(n for n, e in engines.items() if e.pid == pid)
        idle_out[names] = {"cpu_s": round(load.cpu_s, 2), "wall_s": round(load.wall_s, 2),
                           "share": load.share()}
    return {"results": results, "token_ids": token_ids, "idle": idle_out}


def mode_ok(results: dict[str, dict[str, dict]], task: tuple[str, str]) -> bool:
    """Whether a (name, mode) pair has not failed yet."""
    return "error" not in results[task[0]].get(task[1], {})


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree, request by request.

    Returns `{"requests", "identical", "first_divergence": [index of the first differing
    token, or None where identical], "matching_prefix_fraction": mean over requests of the
    common prefix length / output length}`.

    Raises:
        ValueError: the two lists have different lengths.
    """
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} vs {len(theirs)} requests")
    first: list[int | None] = []
    fractions = []
    for a, b in zip(ours, theirs, strict=True):
        shorter = min(len(a), len(b))
        n = next((i for i in range(shorter) if a[i] != b[i]), shorter)
        first.append(None if n == len(a) == len(b) else n)
        fractions.append(n / max(len(a), len(b), 1))
    return {"requests": len(ours), "identical": sum(f is None for f in first),
            "first_divergence": first,
            "matching_prefix_fraction": round(sum(fractions) / max(len(fractions), 1), 4)}
