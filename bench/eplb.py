"""Runtime EPLB on a skewed workload: throughput with EPLB off and on, the stall a rebalance
causes, and rank balancedness before / after (issue 45).

Checkpoint: the bench model's config (`workload.BENCH_CONFIG`: Qwen3-MoE, hidden 512, 8 MoE
layers, 32 experts of width 256, top-4, bf16) built by `tests/skewed_checkpoint.py` with hot
experts (`--hot-experts`, default 0,1): their router rows are shifted so that they take ~47% of
the (token, expert) pairs in every layer, and the contiguous placement puts both on rank 0
(~78% of the pairs at ep 2, ~58% at ep 4: rank balancedness 0.64 / 0.43). Made once into
`$MOE_ENGINE_CACHE/bench-qwen3-moe-skewed-h<hot>` (random weights, no tokenizer). `--shape
wide` builds 4 layers of 16 experts four times as wide instead (`SHAPES`), where the experts
are most of a token's work. Pick hot experts outside the redundant slots EPLB starts with
(e.g. `--hot-experts 1,2` for wide at ep 2 and 4), or the eplb arm starts half balanced.

Workload: the first `--num-requests` requests of `mixed-64` (BENCH.md: random prompts of
32-256 ids, 16-256 output tokens), all submitted at once, greedy, ignore EOS. Every prompt is
skewed (the skew is in the checkpoint, not the prompts).

Arms, per ep size (each its own engine, the front end's `EngineClient` as `moe-serve` starts it):
- `off`: contiguous placement, EPLB off;
- `static`: the placement `moe-skew plan` would make (`plan_placement`, `--num-redundant`
  replicas, default ep_size) from the `off` arm's recorded load, served with
  `--expert-placement` (what a perfect rebalance reaches, without moving anything live);
- `eplb`: `--enable-eplb` with `--num-redundant-experts` (the same count; EPLB starts from
  the contiguous ranges plus those extra slots, `moe_engine.eplb.placement`), a short window
  and interval, `--eplb-threshold` (default 0.75: one placement serves all 8 layers, so the
  best reachable rank balancedness is ~0.85 at ep 4; with a threshold above it the controller
  moves experts again at every interval whose window predicts a gain of 0.01, 11 moves in
  three rounds at 0.9).

Each arm runs the workload `--rounds` times (default 3); round 1 is the warm-up (the eplb arm's
rebalance happens there) and its client-side step trace gives the stall; the tok/s figure is
the median of the later rounds. A step's time is taken from the client: outputs of one step
arrive together, so arrival times separated by more than `STEP_GAP_S` start a new step; the
longest step of round 1 against the median step says how long a rebalance holds the ranks.

    python bench/eplb.py                                  # ep 2 and 4, off / static / eplb
    python bench/eplb.py --ep-sizes 4 --arms off,static --num-requests 32 --json-out r.json

On a 2-core machine ep 4 puts 4 ranks on 2 cores (`--num-threads 1` each): a balanced
placement lets all cores work in the expert phase, a skewed one leaves one rank working
while the others wait, so the ratio measures the idle cores the skew causes, capped near 2x
(cores), not the ep 4 speed-up of a 4-device machine. Figures and what limits them on this
machine: bench/NOTES.md section 36.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from workload import BENCH_CONFIG, mixed_workload  # noqa: E402

from kernels.env import cache_root  # noqa: E402
from moe_engine.engine.client import EngineClient  # noqa: E402
from moe_engine.sampling_params import SamplingParams  # noqa: E402
from moe_engine.startup.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    EplbConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

#: Outputs arriving more than this many seconds apart belong to different steps (a step of
#: the bench model at ep >= 2 takes well over 5 ms on this CPU).
STEP_GAP_S = 0.002
#: Seconds between two reads of the EPLB stats while the eplb arm runs.
POLL_S = 0.05
ARMS = ("off", "static", "eplb")
#: Checkpoint shapes (fields over `BENCH_CONFIG`). `bench`: the bench model itself, where the
#: experts are a small part of a step on this CPU (AMX makes a 512x256 expert cheap; the
#: step's time is attention, the LM head, 16 all-to-alls and the ranks' scheduling). `wide`:
#: 4 layers of 16 experts 4x as wide as the bench model's (512 -> 1024 -> 512), so the
#: experts are most of a token's multiply-adds (4 x 1.6 M per layer against ~0.6 M of
#: attention) and the per-step all-to-alls half as many; 16 experts put 4 on each rank at ep 4.
SHAPES: dict[str, dict[str, object]] = {
    "bench": {},
    "wide": {"num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 1024},
}


def ensure_skewed_checkpoint(cache_dir: Path, shape: str, hot: list[int],
                             strength: float) -> Path:
    """The skewed checkpoint of `shape` (SHAPES; module docstring), built once into
    `cache_dir`."""
    import torch
    from skewed_checkpoint import make_skewed_checkpoint
    from transformers import AutoConfig

    prefix = "bench-qwen3-moe" if shape == "bench" else f"eplb-{shape}"
    name = f"{prefix}-skewed-h{'_'.join(map(str, hot))}-s{strength}"
    config = AutoConfig.for_model("qwen3_moe", **{**BENCH_CONFIG, **SHAPES[shape]})
    return make_skewed_checkpoint(Path(cache_dir), config=config, hot_experts=hot,
                                  strength=strength, name=name, dtype=torch.bfloat16)


def engine_config(ckpt: Path, ep: int, arm: str, args: argparse.Namespace,
                  placement: str | None) -> EngineConfig:
    """The engine of one arm (module docstring)."""
    eplb = EplbConfig()
    if arm == "eplb":
        eplb = EplbConfig(enabled=True, window_steps=args.eplb_window_steps,
                          step_interval=args.eplb_step_interval,
                          num_redundant_experts=args.num_redundant or ep,
                          balancedness_threshold=args.eplb_threshold,
                          move_mib_per_step=args.eplb_move_mib_per_step)
    return EngineConfig(
        model=ModelConfig(model=str(ckpt), dtype="bfloat16", max_model_len=1024),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        parallel=ParallelConfig(ep_size=ep, collective_timeout_s=300, num_threads=args.num_threads,
                                expert_placement=placement),
        eplb=eplb,
    )


async def run_round(client: EngineClient, tag: str, num_requests: int,
                    poll_eplb: bool) -> dict[str, Any]:
    """All requests at once; returns output tokens, wall seconds, and the step trace.

    With `poll_eplb`, the EPLB stats are read every POLL_S meanwhile, so that the steps
    during which a rebalance was under way (moving, or its commit) can be picked out of the
    trace (`step_trace`'s `rebalance_*`).
    """
    requests = mixed_workload(num_requests)
    arrivals: list[float] = []
    polls: list[tuple[float, int, bool]] = []  # (time, rebalances committed, moving)

    async def one(i: int) -> int:
        r = requests[i]
        params = SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len,
                                temperature=0.0, ignore_eos=True)
        n = 0
        async for out in client.generate(f"{tag}-{i}", r.prompt_token_ids, params):
            arrivals.append(time.perf_counter())
            n += len(out.new_token_ids)
        return n

    async def poll(task: asyncio.Future) -> None:
        while not task.done():
            eplb = (await client.get_stats()).total.eplb
            polls.append((time.perf_counter(), eplb.num_rebalances, eplb.moving))
            await asyncio.sleep(POLL_S)

    start = time.perf_counter()
    work = asyncio.gather(*(one(i) for i in range(len(requests))))
    if poll_eplb:
        await asyncio.gather(work, poll(work))
    produced = await work
    wall = time.perf_counter() - start
    return {"output_tokens": sum(produced), "wall_s": wall,
            "output_tokens_per_s": sum(produced) / wall,
            **step_trace(start, arrivals, rebalance_window(polls))}


def rebalance_window(polls: list[tuple[float, int, bool]]) -> tuple[float, float] | None:
    """(from, to) perf_counter seconds bracketing the first rebalance seen by the polls: from
    the last poll before it was seen (moving, or committed) to the first poll after it was
    committed and no longer moving; None when none happened."""
    seen = [i for i, (_, n, moving) in enumerate(polls) if moving or n > polls[0][1]]
    if not seen or polls[0][1] > 0:
        return None
    first = seen[0]
    done = next((i for i in range(first, len(polls))
                 if polls[i][1] > polls[0][1] and not polls[i][2]), len(polls) - 1)
    return polls[max(first - 1, 0)][0], polls[done][0]


def step_trace(start: float, arrivals: list[float],
               window: tuple[float, float] | None = None) -> dict[str, Any]:
    """Step times (seconds) from output arrival times: a gap above STEP_GAP_S ends a step.

    Args:
        window: perf_counter seconds bracketing a rebalance (`rebalance_window`), or None.

    Returns:
        median_step_s, max_step_s (the longest step, prefill steps included), max_step_at_s
        (its end, seconds after the round started), num_steps; with a window also
        rebalance_max_step_s (the longest step ending inside it or just after it) and
        rebalance_at_s (the window's start, seconds after the round started).
    """
    times = sorted(arrivals)
    ends = [t for t, nxt in zip(times, times[1:], strict=False) if nxt - t > STEP_GAP_S]
    ends.append(times[-1])
    steps = [b - a for a, b in zip([start, *ends], ends, strict=False)]
    longest = max(range(len(steps)), key=steps.__getitem__)
    trace = {"median_step_s": statistics.median(steps), "max_step_s": steps[longest],
             "max_step_at_s": ends[longest] - start, "num_steps": len(steps)}
    if window is not None:
        lo, hi = window
        # the step that ends first after the window closes may hold the commit too
        after = next((i for i, e in enumerate(ends) if e > hi), len(ends) - 1)
        inside = [steps[i] for i, e in enumerate(ends) if lo <= e <= hi] + [steps[after]]
        trace.update(rebalance_max_step_s=max(inside), rebalance_at_s=lo - start,
                     rebalance_steps_seen=len(inside))
    return trace


def rank_balancedness(counts: list[list[int]], slots: list[list[int]]) -> float:
    """Rank balancedness of `slots` under `counts` ([moe_layers][num_experts] pairs): per
    layer mean / max of the pairs per rank (an expert's pairs shared evenly by its replicas,
    `moe_engine.skew.placement.share_matrix`), averaged over the layers that ran tokens (vLLM's
    EPLB balancedness, vllm-project/vllm#36304)."""
    import numpy as np

    from moe_engine.skew.placement import share_matrix

    load = np.asarray(counts, dtype=np.float64)
    rank_load = load @ share_matrix(slots, load.shape[1])
    peak = rank_load.max(axis=1)
    ran = peak > 0
    return float((rank_load[ran].mean(axis=1) / peak[ran]).mean()) if ran.any() else 1.0


def eplb_stats(stats: Any) -> dict[str, Any] | None:
    """The EPLB controller's counters (`EplbStats`, GetServerStats), None when EPLB is off."""
    import msgspec

    eplb = stats.total.eplb
    return None if eplb is None else msgspec.to_builtins(eplb)


async def run_arm(ckpt: Path, ep: int, arm: str, args: argparse.Namespace,
                  placement: str | None = None) -> dict[str, Any]:
    """Start one engine, run the rounds, read its stats and expert load; shut it down.

    Rank balancedness is reported from the pairs each rank's experts actually processed
    (`ExpertLoad.rank_tokens`, since startup, differenced): round 1 (warm-up, where the eplb
    arm rebalances) and the later rounds, plus the prediction for the startup placement.
    """
    client = EngineClient()
    t0 = time.perf_counter()
    await client.start(engine_config(ckpt, ep, arm, args, placement))
    startup_s = time.perf_counter() - t0
    try:
        slots = client.model_info.experts_per_rank
        poll = arm == "eplb"
        rounds = [await run_round(client, f"{arm}0", args.num_requests, poll)]
        first = await client.get_expert_load()
        for k in range(1, args.rounds):
            rounds.append(await run_round(client, f"{arm}{k}", args.num_requests, False))
        stats = await client.get_stats()
        end = await client.get_expert_load()
    finally:
        await client.shutdown()
    later = [[b - a for a, b in zip(la, lb, strict=True)]
             for la, lb in zip(first.rank_tokens, end.rank_tokens, strict=True)]
    measured = rounds[1:] or rounds
    return {
        "ep_size": ep, "arm": arm, "placement": placement, "startup_s": startup_s,
        "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in measured),
        "rounds": rounds, "load_counts": end.counts, "startup_slots": slots,
        "rank_balancedness_round1": _balancedness(first.rank_tokens),
        "rank_balancedness_later": _balancedness(later) if args.rounds > 1 else None,
        "rank_balancedness_predicted_startup": rank_balancedness(end.counts, slots),
        "experts_s_per_rank": [r.phase_seconds.get("experts", 0.0) for r in stats.ranks],
        "eplb": eplb_stats(stats),
    }


def _balancedness(rank_tokens: list[list[int]]) -> float:
    """Mean over layers that ran tokens of mean / max pairs per rank ([layers][ranks])."""
    per_layer = [statistics.fmean(r) / max(r) for r in rank_tokens if max(r) > 0]
    return statistics.fmean(per_layer) if per_layer else 1.0


def static_placement(off: dict[str, Any], ep: int, num_redundant: int, out_dir: Path) -> str:
    """Plan from the off arm's recorded load (`moe-skew plan`'s planner); returns the file."""
    import numpy as np

    from moe_engine.skew.planner import plan_placement

    placement = plan_placement(np.asarray(off["load_counts"]), ep, num_redundant)
    path = out_dir / f"placement-ep{ep}.json"
    placement.save(path)
    return str(path)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    hot = [int(x) for x in args.hot_experts.split(",")]
    ckpt = ensure_skewed_checkpoint(args.cache_dir or cache_root(), args.shape, hot,
                                    args.strength)
    out_dir = Path(tempfile.mkdtemp(prefix="eplb-bench-"))
    results = []
    for ep in args.ep_sizes:
        by_arm: dict[str, dict[str, Any]] = {}
        for arm in args.arms:
            placement = None
            if arm == "static":
                if "off" not in by_arm:
                    raise SystemExit("--arms static needs the off arm before it (its load)")
                placement = static_placement(by_arm["off"], ep, args.num_redundant or ep, out_dir)
            before = loadavg()
            result = await run_arm(ckpt, ep, arm, args, placement)
            result.update(loadavg_before=before, loadavg_after=loadavg())
            if "off" in by_arm:
                result["ratio_vs_off"] = (result["output_tokens_per_s"]
                                          / by_arm["off"]["output_tokens_per_s"])
            by_arm[arm] = result
            print_row(result, flush=True)
        results.extend(by_arm.values())
    return results


def print_row(r: dict[str, Any], flush: bool = False) -> None:
    first = r["rounds"][0]
    b1, b2 = r["rank_balancedness_round1"], r["rank_balancedness_later"]
    print(f"ep {r['ep_size']} {r['arm']:>6}: {r['output_tokens_per_s']:8.1f} tok/s"
          f" ratio {r.get('ratio_vs_off', 1.0):.3f}"
          f" | round 1 step median {1000 * first['median_step_s']:.1f} ms,"
          f" max {1000 * first['max_step_s']:.1f} ms at {first['max_step_at_s']:.1f} s"
          f" | rank balancedness round 1 {b1:.3f}, later {b2 if b2 is None else round(b2, 3)}"
          f" | experts s/rank {[round(s, 1) for s in r['experts_s_per_rank']]}"
          f" | load {r['loadavg_before']}", flush=flush)
    e = r["eplb"]
    if e is not None:
        recs = e["rebalances"]
        rec = recs[0] if recs else {}
        stall = first.get("rebalance_max_step_s")
        print(f"    eplb: {e['num_rebalances']} rebalances, {e['experts_moved']} experts,"
              f" {e['bytes_received'] / 2**20:.1f} MiB, transfer {e['transfer_s']:.3f} s,"
              f" commit {e['commit_s']:.3f} s; first: step {rec.get('step')}, over"
              f" {rec.get('move_steps')} steps, balancedness {rec.get('balancedness_before')}"
              f" -> {rec.get('balancedness_after_predicted')} predicted,"
              f" {rec.get('balancedness_after_measured')} measured; longest step around it"
              f" {stall if stall is None else round(1000 * stall, 1)} ms", flush=flush)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ep-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS),
                   help="comma-separated, from off,static,eplb (static needs off first)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="round 1 is the warm-up")
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--hot-experts", default="0,1")
    p.add_argument("--strength", type=float, default=3.0, help="skew strength (router sigmas)")
    p.add_argument("--num-redundant", type=int, default=0, help="default: ep size")
    p.add_argument("--eplb-window-steps", type=int, default=32)
    p.add_argument("--eplb-step-interval", type=int, default=48)
    p.add_argument("--eplb-threshold", type=float, default=0.75,
                   help="--eplb-balancedness-threshold of the eplb arm")
    p.add_argument("--eplb-move-mib-per-step", type=float, default=16.0,
                   help="--eplb-move-mib-per-step of the eplb arm (MiB a rank moves per step)")
    p.add_argument("--num-threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per rank")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"--arms: unknown {sorted(unknown)}, choose from {list(ARMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"load average before: {loadavg()} ({os.cpu_count()} CPUs)", flush=True)
    results = asyncio.run(bench(args))
    if args.json_out:
        for r in results:
            r.pop("load_counts", None)
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
