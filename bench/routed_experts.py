"""What routing replay costs: `LLM.generate` of N batched greedy requests on the bench model,
with `--enable-return-routed-experts` off, and on with every request asking for its routed
experts, engines taking turns (bench/NOTES.md section 35; issue 45's budget: < 5% tok/s).

    python bench/routed_experts.py [--requests 64] [--prompt 250] [--output 64] [--rounds 4]

Prints each round's output tok/s (prefill included), the ratio of the medians, and the
returned arrays' shape and bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params[name], use_tqdm=False)
            rate = args.requests * args.output / (time.perf_counter() - start)
            rates[name].append(rate)
            print(f"{name}: {rate:.0f} tok/s (prefill included)", flush=True)
            if name == "on":
                routed = outs[0].outputs[0].routed_experts
                assert routed.shape[0] == args.prompt + args.output - 1, routed.shape
    num_preemptions = {n: e.engine.scheduler.num_preemptions for n, e in engines.items()}
    ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
    print(f"routed experts: {routed.shape} int32, {routed.nbytes} bytes per request; "
          f"preemptions {num_preemptions}")
    print(f"on/off (median): {ratio:.3f}")


if __name__ == "__main__":
    main()
