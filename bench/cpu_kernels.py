"""Native CPU kernels against the torch paths they replace, side by side in one run.

At the reference checkpoint's sizes (BENCH.md bench-qwen3-moe: hidden 512, 8 query / 2 KV heads
of 64, 32 experts top-4 of intermediate 256, vocabulary 8192), for each kernel and batch size:
the torch path's time, the native kernel's, their ratio, and the native kernel's GFLOP/s.
Weights are bfloat16 values held in float32 (what a bfloat16 checkpoint computes in on a CPU
without native bfloat16), so the native kernels read them packed as bfloat16. The native
kernels' own bandwidth at decode sizes (GB/s of weights, 4-bit experts too, each library
variant) is `bench/cpu_weights.py`.

    python bench/cpu_kernels.py                  # all kernels
    python bench/cpu_kernels.py --only linear --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kernels.attention.native_decode import paged_decode_attention
from kernels.dense.native_linear import PackedLinear
from kernels.moe.native import PackedExperts
from kernels.moe.torch_cpu import fused_moe_cpu


def _time_ms(fn: Callable[[], object], min_seconds: float = 0.3) -> float:
    """Median of 5 batches' mean milliseconds per call (a batch lasts >= min_seconds / 5)."""
    fn()
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds / 5:
        fn()
        n += 1
    means = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t) / n * 1e3)
    return sorted(means)[2]


def _bf16_values(*shape: int, scale: float = 0.05) -> torch.Tensor:
    return (torch.randn(*shape) * scale).bfloat16().float()


def bench_linear(rows: list[int]) -> list[dict]:
    """QKV (512 -> 768), output (512 -> 512), router (512 -> 32) and LM head (512 -> 8192)."""
    out = []
    for name, n, k in (("qkv", 768, 512), ("o_proj", 512, 512), ("router", 32, 512),
                       ("lm_head", 8192, 512)):
        w = _bf16_values(n, k)
        packed = PackedLinear.pack(w)
        for m in rows:
            x = torch.randn(m, k)
            torch_ms = _time_ms(partial(F.linear, x, w))
            native_ms = _time_ms(partial(packed, x))
            out.append(_row(f"linear {name}", m, torch_ms, native_ms, 2 * m * n * k))
    return out


def bench_moe(rows: list[int]) -> list[dict]:
    """One MoE layer: 32 experts, top 4, hidden 512, intermediate 256."""
    e, h, i, k = 32, 512, 256, 4
    w13, w2 = _bf16_values(e, 2 * i, h), _bf16_values(e, h, i)
    packed = PackedExperts.pack(w13, w2)
    out = []
    for m in rows:
        x = torch.randn(m, h)
        weights, ids = torch.softmax(torch.randn(m, e), -1).topk(k, dim=-1)
        ids = ids.to(torch.int32)
        torch_ms = _time_ms(partial(fused_moe_cpu, x, w13, w2, weights, ids))
        native_ms = _time_ms(partial(packed, x, weights, ids))
        out.append(_row("moe layer", m, torch_ms, native_ms, 2 * m * k * 3 * h * i))
    return out


def bench_attention(rows: list[int], context: int = 300, block_size: int = 16) -> list[dict]:
    """Decode attention, `context` keys per sequence: torch's gathered blocks + SDPA against
    the native kernel reading the paged cache in place."""
    hq, hkv, d = 8, 2, 64
    out = []
    for b in rows:
        nb = -(-context // block_size)
        k_cache = torch.randn(b * nb + 1, block_size, hkv, d)
        v_cache = torch.randn_like(k_cache)
        tables = (torch.randperm(b * nb) + 1).view(b, nb)
        lens = torch.full((b,), context, dtype=torch.int64)
        q = torch.randn(b, hq, d)

        torch_ms = _time_ms(partial(_gathered_sdpa, q, k_cache, v_cache, tables, context))
        native_ms = _time_ms(partial(paged_decode_attention, q, k_cache, v_cache, tables, lens,
                                     d**-0.5))
        out.append(_row(f"decode attention ({context} keys)", b, torch_ms, native_ms,
                        4 * b * hq * context * d))
    return out


def _gathered_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: torch.Tensor, context: int) -> torch.Tensor:
    """The torch decode path: whole blocks gathered per sequence, then one SDPA call (KV
    heads' query groups as rows)."""
    b, (hq, d), hkv = q.shape[0], q.shape[1:], k_cache.shape[2]
    keys, values = (
        c.view(c.shape[0], -1).index_select(0, tables.reshape(-1))
        .view(b, -1, hkv, d).transpose(1, 2)[:, :, :context]
        for c in (k_cache, v_cache)
    )
    return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), keys, values)


def _row(kernel: str, rows: int, torch_ms: float, native_ms: float, flops: int) -> dict:
    return {"kernel": kernel, "rows": rows, "torch_ms": round(torch_ms, 4),
            "native_ms": round(native_ms, 4), "speedup": round(torch_ms / native_ms, 2),
            "native_gflops": round(flops / native_ms / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["linear", "moe", "attention"], default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512],
                   help="batch sizes (tokens; sequences for attention)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results: list[dict] = []
    for name, fn in (("linear", bench_linear), ("moe", bench_moe),
                     ("attention", bench_attention)):
        if args.only in (None, name):
            results += fn(args.rows)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))
        return
    print(f"{torch.get_num_threads()} threads; times in ms (median of 5)")
    print(f"{'kernel':32s} {'rows':>5s} {'torch':>9s} {'native':>9s} {'speedup':>8s} {'GF/s':>7s}")
    for r in results:
        print(f"{r['kernel']:32s} {r['rows']:5d} {r['torch_ms']:9.3f} {r['native_ms']:9.3f} "
              f"{r['speedup']:7.2f}x {r['native_gflops']:7.1f}")


if __name__ == "__main__":
    main()
