"""Penalties at the bench model's size: `LLM.generate` of N greedy requests with and without
repetition 1.1 / frequency 0.5 / presence 0.3, taking turns (bench/NOTES.md section 34).

    python bench/penalties_llm.py [--requests 64] [--prompt 250] [--output 64] [--rounds 4]

Prints each round's output tok/s (prefill included) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=250)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    from workload import ensure_bench_checkpoint

    from moe_engine import LLM, SamplingParams
    from moe_engine.startup.demo import default_cache_dir

    ckpt = ensure_bench_checkpoint(Path(default_cache_dir()))
    llm = LLM(model=str(ckpt), max_model_len=1024, max_num_seqs=args.requests)
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 8000 for j in range(args.prompt)]}
               for i in range(args.requests)]
    base = {"max_tokens": args.output, "min_tokens": args.output, "ignore_eos": True,
            "temperature": 0}
    llm.generate(prompts, SamplingParams(**base))  # warm-up
    rates: dict[str, list[float]] = {"plain": [], "penalties": []}
    for _ in range(args.rounds):
        for name, extra in (("plain", {}), ("penalties", PENALTIES)):
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(**base, **extra))
            rate = args.requests * args.output / (time.perf_counter() - start)
            rates[name].append(rate)
            print(f"{name}: {rate:.0f} tok/s (prefill included)", flush=True)
    ratio = statistics.median(rates["penalties"]) / statistics.median(rates["plain"])
    print(f"penalties/plain (median): {ratio:.3f}")


if __name__ == "__main__":
    main()
