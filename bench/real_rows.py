"""The rows of bench/real_scale.py in their own processes: starting one (load time), its peak
RSS, a fixed batch-1 length, folding runs together, and the first-token logprob gaps between
the engine's rows (moe-serve over gRPC, bench/served_engine.py) and llama.cpp's
(bench/llamacpp_runner.py through bench/peer_runner.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from peer_runner import PeerRunner
from served_engine import ServedRow

logger = logging.getLogger("bench.real_scale")

LOGPROB_PROMPTS = 4
LOGPROB_TOP = 20


class FixedBatch1:
    """A row whose batch-1 requests each generate `output_len` tokens (workload.BenchEngine)."""

    def __init__(self, row, output_len: int):
        self.row, self.output_len = row, output_len
        self.name, self.compute_dtype, self.info = row.name, row.compute_dtype, row.info

    @property
    def pid(self) -> int:
        return self.row.pid

    def cpu_seconds(self) -> float | None:
        return self.row.cpu_seconds()

    def run(self, mode: str, return_token_ids: bool = False):
        return self.row.run(mode, return_token_ids,
                            output_len=self.output_len if mode == "batch1" else None)

    def close(self) -> None:
        self.row.close()


def tree_peak_rss(pid: int) -> dict:
    """VmHWM of `pid` and its descendants: {"max_gib": the largest, "sum_gib": all together}."""
    peaks, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            peaks.append(int(next(ln.split()[1] for ln in status.splitlines()
                                  if ln.startswith("VmHWM:"))) * 1024)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return {"max_gib": round(max(peaks, default=0) / 2**30, 2),
            "sum_gib": round(sum(peaks) / 2**30, 2)}


def start(name: str, make: Callable[[], FixedBatch1], info: dict) -> FixedBatch1 | None:
    """Start one row, appending its seconds from process start to ready to
    `info["load_runs_s"]` (or setting `info["error"]`); None when it failed."""
    t0 = time.perf_counter()
    try:
        row = make()
    except (Exception, SystemExit) as exc:
        logger.exception("%s failed to load", name)
        info["error"] = f"{type(exc).__name__}: {exc}"
        return None
    info.setdefault("load_runs_s", []).append(round(time.perf_counter() - t0, 1))
    logger.info("%s ready in %.1f s", name, info["load_runs_s"][-1])
    return row


def observe(rows: dict[str, FixedBatch1], info: dict, prompts: list[list[int]],
            tops: dict, gaps: dict) -> None:
    """While `rows` are up: each one's peak RSS so far (the largest over its starts) and
    compute_dtype / info, and the logprob gaps (`logprob_gaps`) of what is new."""
    for name, row in rows.items():
        rss = tree_peak_rss(row.pid)
        old = info[name].get("peak_rss", {"max_gib": 0, "sum_gib": 0})
        info[name]["peak_rss"] = {k: max(old[k], rss[k]) for k in rss}
        info[name]["compute_dtype"], info[name]["info"] = row.compute_dtype, row.info
    logprob_gaps(rows, prompts, tops, gaps)


def add_runs(info: dict, results: dict) -> None:
    """Fold one `measure_alternating` result of a row into its info: every run's seconds and
    rate kept, the figure the median rate so far."""
    for mode, res in results.items():
        if "error" in res:
            info[mode] = res
            continue
        cur = info.setdefault(mode, {"runs_s": [], "rates": []})
        cur["runs_s"] += res["runs_s"]
        cur["rates"] += [round(res["output_tokens"] / s, 3) for s in res["runs_s"]]
        cur["output_tokens"] = res["output_tokens"]
        cur["output_tokens_per_s"] = round(statistics.median(cur["rates"]), 2)


def logprob_gaps(rows: dict, prompts: list[list[int]], tops: dict, gaps: dict) -> None:
    """Every engine row's top-LOGPROB_TOP first-token logprobs (kept in `tops` by row name,
    asked once) against each llama.cpp row's log-softmax at the same ids, for the pairs not in
    `gaps` yet: `gaps["<engine> vs <llama>"] = {"max_abs", "mean_abs", "argmax_agree"}`.
    Engine rows must be up before (or with) the llama.cpp rows."""
    for name, row in rows.items():
        if isinstance(row.row, ServedRow) and name not in tops:
            try:
                tops[name] = row.row.first_logprobs(prompts, LOGPROB_TOP)
            except Exception as exc:  # a killed server: the other figures still count
                logger.exception("%s: first-token logprobs failed", name)
                gaps[f"{name} vs llama.cpp"] = {"error": f"{type(exc).__name__}: {exc}"}
                tops[name] = None
    peers = {n: r.row for n, r in rows.items() if isinstance(r.row, PeerRunner)}
    for en, ours in tops.items():
        if ours is None:
            continue
        ids = [list(d) for d in ours]
        for pn, prow in peers.items():
            if f"{en} vs {pn}" in gaps:
                continue
            try:
                got = prow.request({"cmd": "logprobs", "prompts": prompts, "token_ids": ids},
                                   "logprobs")
            except Exception as exc:
                logger.exception("%s: logprobs failed", pn)
                gaps[f"{en} vs {pn}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            diff = [abs(d[t] - lp) for d, t_ids, lps in zip(ours, ids, got["logprobs"],
                                                              strict=True)
                    for t, lp in zip(t_ids, lps, strict=True)]
            agree = sum(max(d, key=d.__getitem__) == a
                        for d, a in zip(ours, got["argmax"], strict=True))
            gaps[f"{en} vs {pn}"] = {"max_abs": round(max(diff), 4),
                                     "mean_abs": round(sum(diff) / len(diff), 4),
                                     "argmax_agree": f"{agree}/{len(prompts)}"}
