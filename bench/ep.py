"""Expert-parallel step anatomy: where one step's time goes at ep 1 and ep 2, and dispatch bytes.

On `bench-qwen3-moe` with the `mixed-64` workload (../shared/BENCH.md; `throughput.py` makes the
checkpoint), for each ep size: the engine is started as `moe-serve` would start it (the front
end's `EngineClient`; ranks through torch's elastic launcher when ep > 1), every request is
submitted at once, and afterwards the ranks' counters are read (GetServerStats' dict):

- output tokens/s (wall clock, model load excluded);
- per step, in ms, averaged over steps and ranks: attention, router, dispatch, experts,
  combine, and the rest of the step (embedding, norms, LM head, sampling, scheduling);
- dispatch bytes per routed token against the minimum (hidden x element bytes x distinct
  remote destination ranks, counted by the communicator on the routing that happened).

    python bench/ep.py                       # ep 1 and 2, the full workload
    python bench/ep.py --ep-sizes 1 2 4 --num-requests 16 --json

Ranks share this machine's cores (each gets cores / ranks threads), so on a 2-core machine
ep 2 measures the protocol's cost, not a speed-up: the split is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import ensure_bench_checkpoint, mixed_workload  # noqa: E402

from kernels.env import cache_root
from moe_engine.core.outputs import EngineStats  # noqa: E402
from moe_engine.engine.client import EngineClient  # noqa: E402
from moe_engine.sampling_params import SamplingParams  # noqa: E402
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

PHASES = ("attention", "router", "dispatch", "experts", "combine")


async def run_one(ckpt: Path, ep_size: int, args: argparse.Namespace) -> dict:
    """Serve the workload once at `ep_size`; returns throughput and the per-step split."""
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), dtype=args.dtype, max_model_len=1024),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=300),
    )
    client = EngineClient()
    await client.start(config)
    try:
        requests = mixed_workload(args.num_requests)
        before = await client.get_stats()

        async def one(i: int) -> int:
            r = requests[i]
            params = SamplingParams(
                max_tokens=r.output_len, min_tokens=r.output_len, temperature=0.0, ignore_eos=True
            )
            n = 0
            async for out in client.generate(f"r{i}", r.prompt_token_ids, params):
                n += len(out.new_token_ids)
            return n

        start = time.perf_counter()
        produced = await asyncio.gather(*(one(i) for i in range(len(requests))))
        wall = time.perf_counter() - start
        after = await client.get_stats()
    finally:
        await client.shutdown()
    return summarise(ep_size, sum(produced), wall, before, after)


def summarise(
    ep_size: int, tokens: int, wall: float, before: EngineStats, after: EngineStats
) -> dict:
    """Differences of the counters over the run, per step and per token."""
    split: dict[str, list[float]] = {p: [] for p in (*PHASES, "other", "step")}
    dispatch_bytes = min_bytes = routed_tokens = 0
    for b, a in zip(before.ranks, after.ranks, strict=True):
        pb, pa = b.phase_seconds, a.phase_seconds
        steps = a.num_steps - b.num_steps
        if steps <= 0:
            continue
        seconds = {p: pa.get(p, 0.0) - pb.get(p, 0.0) for p in (*PHASES, "step")}
        seconds["other"] = seconds["step"] - sum(seconds[p] for p in PHASES)
        for p, s in seconds.items():
            split[p].append(1000 * s / steps)
        dispatch_bytes += a.dispatch_bytes_sent - b.dispatch_bytes_sent
        min_bytes += a.min_dispatch_bytes - b.min_dispatch_bytes
        routed_tokens += a.tokens_in - b.tokens_in
    return {
        "ep_size": ep_size,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ms_per_step": {p: statistics.fmean(v) if v else 0.0 for p, v in split.items()},
        "dispatch_bytes_per_token": dispatch_bytes / routed_tokens if routed_tokens else 0.0,
        "min_dispatch_bytes_per_token": min_bytes / routed_tokens if routed_tokens else 0.0,
    }


def print_table(results: list[dict]) -> None:
    cols = (*PHASES, "other", "step")
    head = f"{'ep':>3} {'tok/s':>8} " + " ".join(f"{c:>9}" for c in cols)
    print(head + f" {'disp B/tok':>11} {'min B/tok':>10}")
    for r in results:
        ms = r["ms_per_step"]
        print(
            f"{r['ep_size']:>3} {r['output_tokens_per_s']:>8.1f} "
            + " ".join(f"{ms[c]:>9.2f}" for c in cols)
            + f" {r['dispatch_bytes_per_token']:>11.1f} {r['min_dispatch_bytes_per_token']:>10.1f}"
        )
    print("(ms per step, averaged over the ranks' steps; B/tok: bytes per token dispatched)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ep-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"])
    p.add_argument("--kv-cache-memory", type=int, default=2 * 2**30, help="bytes per rank")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ckpt = ensure_bench_checkpoint(args.cache_dir or cache_root())
    results = [asyncio.run(run_one(ckpt, ep, args)) for ep in args.ep_sizes]
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "results": results}, indent=2))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
