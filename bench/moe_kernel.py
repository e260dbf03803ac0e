"""One MoE layer's expert computation at bench-qwen3-moe sizes, bf16 vs int4 vs MXFP4, side by side.

    python bench/moe_kernel.py [--tokens 1 8 64 512] [--repeats 20] [--json]
    python bench/moe_kernel.py --device cuda      # the Triton kernels on a GPU

CPU (default): each format through two paths. "native" is what the engine runs when the native
kernel builds (the default): "bf16" is `kernels.moe.native.PackedExperts` (what `FusedMoE`
packs) on bf16-rounded weights in the engine's compute dtype
(`moe_engine.startup.env.compute_dtype(bfloat16)`: float32 on CPUs without native bf16 matmul,
reported as `compute_dtype`; bf16-exact, so packed as bfloat16), "int4" (group `--group-size`,
symmetric) and "mxfp4" are `QuantizedExperts` quantized from the same weights, which run
`kernels.moe.native.PackedQuantExperts` (codes decoded in registers). "torch" is the
torch backend (`--kernel-backend fused_moe=torch`), called directly:
`kernels.moe.torch_cpu.fused_moe_cpu`,
`kernels.moe.torch_int4.fused_moe_int4_cpu` and `kernels.moe.torch_mxfp4.fused_moe_mxfp4_cpu` on
the same
weights. Without a native build only the torch rows are timed. Repetitions are interleaved (one
call of each path per round, so machine noise hits all alike); the figure is the median per
call. Ratios are speedups over bf16 native (bf16 native ms / path ms; > 1 is faster).

CUDA (`--device cuda`): `kernels.moe.fused_moe.fused_moe` (bf16), `fused_moe_int4` and
`fused_moe_mxfp4` timed with CUDA events, and the achieved weight bandwidth: bytes of the expert
weights the step touches (experts with at least one token, their packed weights, scales and
zero points) over the time, against the copy bandwidth of the device (read + write bytes of a
`Tensor.copy_` of 1 GiB over its time).

Routing: softmax top-k of random router logits (`moe_engine.models.layers.moe.softmax_topk`),
fixed seed. Sizes: 32 experts, top-4, hidden 512, expert intermediate 256 (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from moe_engine.models.layers.moe import softmax_topk
from moe_engine.startup.env import compute_dtype

PATHS = ("bf16", "int4", "mxfp4")
#: CPU paths: the native kernel (the engine's default) and the torch backend.
CPU_KINDS = ("native", "torch")


def make_layer(args: argparse.Namespace, g: torch.Generator) -> dict:
    """bf16 weights (random, scale 0.02 like an initialised checkpoint) and a router."""
    e, i, h = args.experts, args.intermediate, args.hidden
    return {
        "w13": (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16),
        "w2": (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16),
        "router": torch.randn(e, h, generator=g),
    }


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each function; each round calls every function once."""
    for fn in fns.values():  # warm-up: workspaces, tables, first-call costs
        fn(), fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def run_cpu(args: argparse.Namespace) -> dict:
    from kernels.moe.native import PackedExperts
    from kernels.moe.torch_cpu import fused_moe_cpu
    from kernels.native.library import load_native
    from kernels.plan import KernelPlan
    from moe_engine.models.layers.quantized_experts import QuantizedExperts

    g = torch.Generator().manual_seed(0)
    layer = make_layer(args, g)
    dtype = compute_dtype(torch.bfloat16)
    w13, w2 = layer["w13"].to(dtype), layer["w2"].to(dtype)
    native = load_native("moe_cpu") is not None

    def experts(method: str, group: int, backend: str) -> QuantizedExperts:
        q = QuantizedExperts(layer["w13"].float(), layer["w2"].float(), method, group)
        q.bind_kernels(KernelPlan.uniform(backend))
        return q

    int4_torch = experts("int4", args.group_size, "torch")
    mxfp4_torch = experts("mxfp4", 32, "torch")
    if native:
        int4 = experts("int4", args.group_size, "native-cpu")
        mxfp4 = experts("mxfp4", 32, "native-cpu")
    bf16 = PackedExperts.pack(w13, w2) if native else None
    kinds = CPU_KINDS if native else ("torch",)
    results = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=g).to(dtype)
        weights, ids = softmax_topk(x.float() @ layer["router"].T, args.top_k, renormalize=True)
        fns = {
            "bf16_torch": lambda x=x, w=weights, i=ids: fused_moe_cpu(x, w13, w2, w, i),
            "int4_torch": lambda x=x, w=weights, i=ids: int4_torch(x, w, i),
            "mxfp4_torch": lambda x=x, w=weights, i=ids: mxfp4_torch(x, w, i),
        }
        if native:
            fns |= {
                "bf16_native": lambda x=x, w=weights, i=ids: bf16(x, w, i),
                "int4_native": lambda x=x, w=weights, i=ids: int4(x, w, i),
                "mxfp4_native": lambda x=x, w=weights, i=ids: mxfp4(x, w, i),
            }
        ms = interleaved_medians(fns, args.repeats)
        base = ms["bf16_native" if native else "bf16_torch"]
        row: dict[str, float | int] = {"experts_used": int(torch.unique(ids).numel())}
        for kind in kinds:
            for p in PATHS:
                row[f"{p}_{kind}_ms"] = round(ms[f"{p}_{kind}"], 3)
                row[f"{p}_{kind}_speedup_vs_bf16_{kinds[0]}"] = round(base / ms[f"{p}_{kind}"], 2)
        results[tokens] = row
    return {
        "device": "cpu",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "int4_group_size": args.group_size,
        "native": native,
        "tokens": results,
    }


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Device copy bandwidth, GB/s: (read + write bytes) of `dst.copy_(src)` over its time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def cuda_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds per call, CUDA events around each call, after two warm-up calls."""
    fn(), fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def run_cuda(args: argparse.Namespace) -> dict:
    from kernels.moe.fused_moe import fused_moe, fused_moe_int4, fused_moe_mxfp4
    from quant.int4 import quantize_int4
    from quant.mxfp4 import quantize_mxfp4

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    layer = make_layer(args, g)
    w13, w2 = layer["w13"].to(device), layer["w2"].to(device)
    q4 = [quantize_int4(w.float(), args.group_size, symmetric=True) for w in (w13, w2)]
    qmx = [quantize_mxfp4(w) for w in (w13, w2)]

    def per_expert_bytes(tensors: list[torch.Tensor | None]) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    bytes_per_expert = {
        "bf16": per_expert_bytes([w13, w2]),
        "int4": per_expert_bytes([t for q in q4 for t in q]),
        "mxfp4": per_expert_bytes([t for q in qmx for t in q]),
    }
    copy_gbs = copy_bandwidth_gbs(device)
    results = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=g).to(device, torch.bfloat16)
        weights, ids = softmax_topk(
            x.float() @ layer["router"].to(device).T, args.top_k, renormalize=True
        )
        used = int(torch.unique(ids).numel())
        fns = {
            "bf16": lambda x=x, w=weights, i=ids: fused_moe(x, w13, w2, w, i),
            "int4": lambda x=x, w=weights, i=ids: fused_moe_int4(
                x, q4[0][0], q4[0][1], q4[1][0], q4[1][1], w, i
            ),
            "mxfp4": lambda x=x, w=weights, i=ids: fused_moe_mxfp4(x, *qmx[0], *qmx[1], w, i),
        }
        row: dict[str, float | int] = {"experts_used": used}
        for name, fn in fns.items():
            ms = cuda_median_ms(fn, args.repeats)
            gbs = used * bytes_per_expert[name] / (ms / 1e3) / 1e9
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_weight_gbs"] = round(gbs, 1)
            row[f"{name}_pct_of_copy"] = round(100 * gbs / copy_gbs, 1)
        results[tokens] = row
    return {
        "device": torch.cuda.get_device_name(device),
        "compute_dtype": "bfloat16",
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "int4_group_size": args.group_size,
        "tokens": results,
    }


def print_table(report: dict) -> None:
    cuda = "copy_bandwidth_gbs" in report
    head = f"device {report['device']}, compute dtype {report['compute_dtype']}"
    if cuda:
        head += f", copy bandwidth {report['copy_bandwidth_gbs']} GB/s"
    else:
        head += f", {report['threads']} threads"
    print(head + f", int4 group {report['int4_group_size']}")
    if cuda:
        print(f"{'tokens':>6} {'experts':>7} " + " ".join(
            f"{p + ' ms':>10} {p + ' GB/s':>11} {'%copy':>6}" for p in PATHS
        ))  # fmt: skip
        for tokens, r in report["tokens"].items():
            print(f"{tokens:>6} {r['experts_used']:>7} " + " ".join(
                f"{r[p + '_ms']:>10.4f} {r[p + '_weight_gbs']:>11.1f} {r[p + '_pct_of_copy']:>6.1f}"
                for p in PATHS
            ))  # fmt: skip
        return
    kinds = CPU_KINDS if report["native"] else ("torch",)
    base = f"bf16 {kinds[0]}"
    print(f"ms per call; (x) = speedup over {base} ({base} ms / path ms)")
    print(f"{'tokens':>6} {'experts':>7} " + " ".join(
        f"{p + ' ' + kind:>20}" for kind in kinds for p in PATHS
    ))  # fmt: skip
    for tokens, r in report["tokens"].items():
        cells = [
            f"{r[f'{p}_{kind}_ms']:>11.3f} ({r[f'{p}_{kind}_speedup_vs_bf16_{kinds[0]}']:>5.2f}x)"
            for kind in kinds
            for p in PATHS
        ]
        print(f"{tokens:>6} {r['experts_used']:>7} " + " ".join(f"{c:>20}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--group-size", type=int, default=128, help="int4 values per scale")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(
                "bench/moe_kernel.py: --device cuda needs a CUDA GPU, and torch.cuda.is_available()"
                " is False here (CPU-only torch or no device); run without --device for the CPU"
                " paths",
                file=sys.stderr,
            )
            return 2
        report = run_cuda(args)
    else:
        report = run_cpu(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
