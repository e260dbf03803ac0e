"""AMX bf16 kernels (kernels/dense/amx.py) against the AVX2 native kernels and torch's bfloat16
path (oneDNN, itself AMX here), side by side in one run, min of N.

Per shape and batch size, each engine's microseconds per call: the engines alternate within
every round (so load from other processes hits them alike) and each figure is the minimum over
the rounds of a round's mean. Activations and weights are bfloat16 (the engine's compute dtype
on an AMX CPU); the native linear gets them as the engine's `Linear` passes them.

    flock /tmp/bench.lock python bench/amx_kernels.py --threads 1
    flock /tmp/bench.lock python bench/amx_kernels.py --threads 2 --only moe --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kernels.dense.amx import AmxLinear, amx_unavailable_reason
from kernels.dense.native_linear import PackedLinear
from kernels.moe.native import PackedExperts
from kernels.moe.torch_cpu import fused_moe_cpu

LINEAR_SHAPES = ((768, 512), (512, 512), (8192, 512), (32, 512))  # qkv, o, lm_head, router
LINEAR_ROWS = (1, 4, 8, 16, 64, 256, 1024)
MOE_TOKENS = (1, 4, 8, 16, 64, 512, 2048)


def min_of_n(fns: dict[str, Callable[[], object]], rounds: int, min_round_s: float) -> dict:
    """{name: min over `rounds` of the mean us per call}, the engines alternating per round."""
    calls = {}
    for name, fn in fns.items():
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < min_round_s:
            fn()
            n += 1
        calls[name] = max(1, n)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / calls[name] * 1e6)
    return best


def bench_linear(rows: tuple[int, ...], rounds: int, round_s: float) -> list[dict]:
    out = []
    for n, k in LINEAR_SHAPES:
        w = (torch.randn(n, k) * 0.05).bfloat16()
        native, amx = PackedLinear.pack(w), AmxLinear.pack(w)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            us = min_of_n({"torch": partial(F.linear, x, w), "native": partial(native, x),
                           "amx": partial(amx, x)}, rounds, round_s)
            out.append({"op": f"linear [{n}x{k}]", "rows": m, **us})
    return out


def bench_moe(tokens: tuple[int, ...], rounds: int, round_s: float) -> list[dict]:
    from kernels.moe.amx import AmxExperts

    e, h, i, top_k = 32, 512, 256, 4
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    native, amx = PackedExperts.pack(w13, w2), AmxExperts.pack(w13, w2)
    out = []
    for t in tokens:
        x = torch.randn(t, h, generator=g).bfloat16()
        logits = torch.randn(t, e, generator=g)
        weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
        ids = ids.int()
        fns = {"torch": partial(fused_moe_cpu, x, w13, w2, weights, ids),
               "native": partial(native, x, weights, ids), "amx": partial(amx, x, weights, ids)}
        out.append({"op": f"fused_moe E{e} H{h} I{i} top{top_k}", "rows": t,
                    **min_of_n(fns, rounds, round_s)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("linear", "moe"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.04, help="seconds per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = amx_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"AMX kernels unavailable: {reason}")
    torch.set_num_threads(args.threads)
    rows = []
    if args.only in (None, "linear"):
        rows += bench_linear(LINEAR_ROWS, args.rounds, args.round_s)
    if args.only in (None, "moe"):
        rows += bench_moe(MOE_TOKENS, args.rounds, args.round_s)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"threads {args.threads}; us per call, min of {args.rounds} rounds")
    print(f"{'op':<34}{'rows':>6}{'torch':>10}{'native':>10}{'amx':>10}{'amx/native':>12}")
    for r in rows:
        print(f"{r['op']:<34}{r['rows']:>6}{r['torch']:>10.1f}{r['native']:>10.1f}"
              f"{r['amx']:>10.1f}{r['native'] / r['amx']:>11.2f}x")


if __name__ == "__main__":
    main()
