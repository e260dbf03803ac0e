"""What routing replay costs: `LLM.generate` of N batched greedy requests on the bench model,
with `--enable-return-routed-experts` off, and on with every request asking for its routed
experts, engines taking turns (bench/NOTES.md section 35; issue 45's budget: < 5% tok/s).

    python bench/routed_experts.py [--requests 64] [--prompt 250] [--output 64] [--rounds 4]

Prints each round's output tok/s (prefill included) and the process's CPU ms per output token
(all threads; steadier than wall time on a shared machine), the ratios of the medians, and the
returned arrays' shape and bytes. Set OMP_WAIT_POLICY=PASSIVE (bench/workload imports torch
before moe_engine, so the engine cannot set it itself).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _Timed:
    """Wraps a method, adding its wall seconds to `seconds[key]`."""

    def __init__(self, obj, name: str, seconds: dict[str, float]) -> None:
        self.fn, self.name, self.seconds = getattr(obj, name), name, seconds
        seconds.setdefault(name, 0.0)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds[self.name] += time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=250)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="512MiB",
                   help="each engine's KV cache (two engines are loaded; default %(default)s)")
    args = p.parse_args()
    from workload import ensure_bench_checkpoint

    from moe_engine import LLM, SamplingParams
    from moe_engine.startup.demo import default_cache_dir

    ckpt = ensure_bench_checkpoint(Path(default_cache_dir()))
    engines = {
        name: LLM(model=str(ckpt), max_model_len=1024, max_num_seqs=args.requests,
                  kv_cache_memory=args.kv_cache_memory, enable_return_routed_experts=on)
        for name, on in (("off", False), ("on", True))
    }
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 8000 for j in range(args.prompt)]}
               for i in range(args.requests)]
    base = {"max_tokens": args.output, "min_tokens": args.output, "ignore_eos": True,
            "temperature": 0}
    params = {"off": SamplingParams(**base),
              "on": SamplingParams(**base, return_routed_experts=True)}
    for name, llm in engines.items():  # warm-up
        llm.generate(prompts, params[name], use_tqdm=False)
    replay = engines["on"].engine.runner.routing_replay
    own: dict[str, float] = {}  # routing replay's own host work, timed in place
    _Timed(replay.capture, "record", own)  # each MoE layer's write into the device buffer
    _Timed(replay, "store_step", own)  # the step's read-back and per-slot store
    _Timed(replay, "gather", own)  # a finished request's rows through its block table
    wall_on = 0.0
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu_ms: dict[str, list[float]] = {"off": [], "on": []}
    tokens = args.requests * args.output
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params[name], use_tqdm=False)
            took = time.perf_counter() - start
            wall_on += took if name == "on" else 0.0
            rate = tokens / took
            rates[name].append(rate)
            cpu_ms[name].append(1e3 * (time.process_time() - cpu) / tokens)
            print(f"{name}: {rate:.0f} tok/s (prefill included), {cpu_ms[name][-1]:.2f} CPU ms "
                  "per output token", flush=True)
            if name == "on":
                routed = outs[0].outputs[0].routed_experts
                assert routed.shape[0] == args.prompt + args.output - 1, routed.shape
    num_preemptions = {n: e.engine.scheduler.num_preemptions for n, e in engines.items()}
    ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
    cpu_ratio = statistics.median(cpu_ms["on"]) / statistics.median(cpu_ms["off"])
    print(f"routed experts: {routed.shape} int32, {routed.nbytes} bytes per request; "
          f"preemptions {num_preemptions}")
    print("routing replay's own host work, share of the 'on' runs' wall time: "
          + ", ".join(f"{k} {100 * v / wall_on:.2f}%" for k, v in own.items()))
    print(f"tok/s on/off (median): {ratio:.3f}; CPU per token on/off (median): {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
