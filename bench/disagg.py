"""Prefill/decode hand-off on the bench checkpoint, measured: per prompt length, the prefill
(a prefill core runs the prompt to its first token), the KV transfer into a decode core's
cache (Mooncake's TCP transfer engine on loopback, `moe_engine.disagg`), and the decode core's
first steps from the received K/V, against the same request on one core. Both cores live in
this process (one at a time computes; the transfer engine's threads are the only overlap).

Prints a markdown table, then the line-rate arithmetic (`moe-disagg plan`) for the same
prompts. Outputs are checked: the split's greedy tokens must equal the single core's.

    python bench/disagg.py                          # prompts of 128, 512, 2048 tokens
    python bench/disagg.py --prompt-lens 256,4096 --runs 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from workload import ensure_bench_checkpoint  # noqa: E402

from moe_engine.core.build import build_engine_core  # noqa: E402
from moe_engine.core.engine_core import EngineCore  # noqa: E402
from moe_engine.disagg.arithmetic import format_table, transfer_table  # noqa: E402
from moe_engine.disagg.handoff import DecodeHandoff, PrefillHandoff, kv_transfer_for  # noqa: E402
from moe_engine.sampling_params import SamplingParams  # noqa: E402
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402


def _core(ckpt: Path, max_len: int) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(ckpt), dtype="bfloat16", max_model_len=max_len),
        cache=CacheConfig(kv_cache_memory=512 << 20),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max(2048, max_len)),
    ))


def _drain(core: EngineCore) -> tuple[list[int], int]:
    tokens, steps = [], 0
    while core.has_unfinished_requests():
        steps += 1
        for out in core.step():
            tokens += out.new_token_ids
    return tokens, steps


def one_round(single: EngineCore, pre: PrefillHandoff, dec: DecodeHandoff, rid: str,
              prompt: list[int], out_len: int) -> dict:
    """One request through the split and on one core: seconds of each phase."""
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    single.add_request(rid, prompt, params)
    ref, _ = _drain(single)
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    placement = dec.park(rid, prompt, params)
    t1 = time.perf_counter()
    pre.add(rid, prompt, params)
    (first,), _ = _drain(pre.core)
    t2 = time.perf_counter()
    transfer_s = pre.send(rid, placement)
    t3 = time.perf_counter()
    tokens = [t for o in dec.arrived(rid, first) for t in o.new_token_ids]
    rest, steps = _drain(dec.core)
    t4 = time.perf_counter()
    if tokens + rest != ref:
        raise RuntimeError(f"{rid}: the split's tokens differ from one core's")
    return {"park_s": t1 - t0, "prefill_s": t2 - t1, "transfer_s": transfer_s,
            "send_s": t3 - t2, "decode_s": t4 - t3, "decode_steps": steps,
            "split_s": t4 - t0, "single_s": single_s}


def main(argv: list[str] | None = None) -> int:
    from moe_engine.startup.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lens", default="128,512,2048")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--runs", type=int, default=3, help="median of this many after a warm-up")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    ckpt = ensure_bench_checkpoint(args.cache_dir)
    max_len = max(lens) + args.output_len
    single, p_core, d_core = (_core(ckpt, max_len) for _ in range(3))
    p_transfer, p_cache = kv_transfer_for(p_core)
    d_transfer, d_cache = kv_transfer_for(d_core)  # kept alive: it receives the writes
    pre, dec = PrefillHandoff(p_core, p_transfer, p_cache), DecodeHandoff(d_core, d_cache)
    g = torch.Generator().manual_seed(0)
    rows = []
    load = os.getloadavg()[0]
    for n in lens:
        prompt = torch.randint(3, 8192, (n,), generator=g).tolist()
        runs = [one_round(single, pre, dec, f"p{n}-{i}", prompt, args.output_len)
                for i in range(args.runs + 1)][1:]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        kv_bytes = transfer_table(p_cache_specs(p_core), [n])[0].num_bytes
        rows.append({"prompt_len": n, "kv_bytes": kv_bytes, **med,
                     "loopback_gbps": kv_bytes * 8 / med["transfer_s"] / 1e9})
    result = {"checkpoint": str(ckpt), "output_len": args.output_len, "runs": args.runs,
              "load_average": [load, os.getloadavg()[0]], "rows": rows,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench-qwen3-moe, bf16, {args.output_len} output tokens, median of {args.runs} after "
          f"a warm-up; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; {result['date']}")
    print("| prompt | KV moved | prefill | transfer (loopback) | Gb/s | decode | split total "
          "| one core |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_len']} | {r['kv_bytes'] / 2**20:.2f} MiB | "
              f"{r['prefill_s'] * 1e3:.1f} ms | {r['transfer_s'] * 1e3:.2f} ms | "
              f"{r['loopback_gbps']:.1f} | {r['decode_s'] * 1e3:.1f} ms | "
              f"{r['split_s'] * 1e3:.1f} ms | {r['single_s'] * 1e3:.1f} ms |")
    prefill = {r["prompt_len"]: r["prefill_s"] for r in rows}
    print("\nLine rate for the same prompts (no protocol overhead), against the prefill above:")
    print(format_table(transfer_table(p_cache_specs(p_core), lens, prefill_s=prefill)))
    return 0


def p_cache_specs(core: EngineCore) -> list:
    """The KV-cache specs of a core's groups."""
    return [g.spec for g in core.runner.kv_groups]


if __name__ == "__main__":
    sys.exit(main())
