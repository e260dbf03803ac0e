"""Run a function on N local ranks (one process each) under a watchdog.

`run_ranks(fn, world_size)` starts the processes from a forkserver that has imported torch once
(so N ranks cost one torch import, not N), joins them through a `FileStore` in a fresh temporary
directory (no port to race for), and returns each rank's result. Whatever goes wrong ends in an
exception naming the ranks and what happened to them, never a hang: a rank that raises, dies, or
is still running at the deadline fails the call, and every process still alive is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: After the first rank fails, the others get this long to report before they are killed.
FAILURE_GRACE_S = 3.0


class RankFailure(AssertionError):
    """One or more ranks raised, died, or missed the watchdog deadline."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 60.0,
    backend: str = "gloo",
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes inside one process group.

    Args:
        fn: a module-level function (it is pickled by reference); its return value must pickle.
        world_size: processes to start.
        args: extra positional arguments, pickled to every rank.
        timeout_s: watchdog for the whole run (seconds, process start included).
        backend: torch.distributed backend ("gloo" on CPU, "nccl" on GPU).
        collective_timeout_s: the process group's timeout (default: timeout_s), so a rank
            left waiting in a collective raises on its own as well.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), exited without a result,
            or was still running after `timeout_s` (killed).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    store_dir = tempfile.mkdtemp(prefix="moe_dist_")
    results: queue.Queue = ctx.Queue()
    pg_timeout = collective_timeout_s or timeout_s
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, args, backend, store_dir, pg_timeout, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        outcome = _collect(procs, results, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        shutil.rmtree(store_dir, ignore_errors=True)
    return outcome


def case_results(
    run_all: Callable[[int, int, int], dict[str, list[str]]], cases: list[str], seed: int,
    timeout_s: float,
) -> Callable[[int], dict[str, list[str]]]:
    """`get(world)`: each case's problems over `world` ranks, "seed S rank R: problem", running
    `run_all(rank, world, seed)` (every case on one rank: {case: problems}) once per world size.

    Raises (from `get`):
        RankFailure: a rank raised, died or missed `timeout_s` (the seed and world named).
    """
    cache: dict[int, dict[str, list[str]] | RankFailure] = {}

    def get(world: int) -> dict[str, list[str]]:
        if world not in cache:
            try:
                per_rank = run_ranks(run_all, world, args=(seed,), timeout_s=timeout_s)
                cache[world] = {
                    name: [f"seed {seed} rank {r}: {p}" for r, res in enumerate(per_rank)
                           for p in res[name]]
                    for name in cases
                }  # fmt: skip
            except RankFailure as failure:
                cache[world] = failure
        result = cache[world]
        if isinstance(result, RankFailure):
            raise RankFailure(f"seed {seed}, {world} ranks: {result}")
        return result

    return get


def _collect(procs: list, results: queue.Queue, timeout_s: float) -> list[Any]:
    """Read one report per rank until all are in, a failure's grace ends, or the deadline."""
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(values) + len(errors) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                done = rank in values or rank in errors
                if not done and proc.exitcode not in (None, 0):
                    errors[rank] = f"exited with code {proc.exitcode} without a result"
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            continue
        if ok:
            values[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    missing = [r for r in range(len(procs)) if r not in values and r not in errors]
    if errors or missing:
        lines = [f"rank {rank} failed:\n{errors[rank]}" for rank in sorted(errors)]
        if missing:
            why = "after another rank failed" if errors else f"after the {timeout_s:.0f} s watchdog"
            lines.append(f"ranks {missing} were still running {why} and were killed")
        raise RankFailure("\n".join(lines))
    return [values[rank] for rank in range(len(procs))]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    backend: str,
    store_dir: str,
    pg_timeout_s: float,
    results: queue.Queue,
) -> None:
    """Body of one rank's process: join the group, run fn, report (value or traceback)."""
    torch.set_num_threads(1)  # N ranks share the machine's cores
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{os.path.join(store_dir, 'store')}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
