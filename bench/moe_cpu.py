"""Expert-path micro-benchmark: `kernels.moe.torch_cpu.fused_moe_cpu` against the per-expert loop of
`kernels.moe.reference.fused_moe_reference`, side by side in one run, on the bench-qwen3-moe expert
shape (32 experts, top-4, hidden 512, expert intermediate 256).

    python bench/moe_cpu.py [--tokens 64 2048] [--dtype float32] [--json]

Prints the median milliseconds per MoE layer call of each and their ratio, per token count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.moe.reference import fused_moe_reference
from kernels.moe.torch_cpu import fused_moe_cpu
from moe_engine.models.layers.moe import softmax_topk


def time_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of `fn()` over `repeats` calls after two warm-up calls."""
    fn(), fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 2048])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    e, i, h = args.experts, args.intermediate, args.hidden
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(dtype)
    gate = torch.randn(e, h, generator=g)
    results = {}
    for t in args.tokens:
        x = torch.randn(t, h, generator=g).to(dtype)
        weights, ids = softmax_topk(x.float() @ gate.T, args.top_k, renormalize=True)
        inputs = (x, w13, w2, weights, ids)
        loop = time_ms(lambda a=inputs: fused_moe_reference(*a), args.repeats)
        padded = time_ms(lambda a=inputs: fused_moe_cpu(*a), args.repeats)
        results[t] = {
            "loop_ms": round(loop, 3),
            "cpu_path_ms": round(padded, 3),
            "speedup": round(loop / padded, 2),
        }
    if args.json:
        print(
            json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "tokens": results})
        )
        return
    for t, r in results.items():
        print(
            f"{t:6d} tokens: loop {r['loop_ms']:8.2f} ms   cpu path {r['cpu_path_ms']:8.2f} ms"
            f"   speedup {r['speedup']:.2f}x"
        )


if __name__ == "__main__":
    main()
