"""Weight bandwidth of the native CPU kernels at decode and small-batch sizes.

A decode step is bound by reading the weights: each linear and each used expert is read once
per step. This times the native kernels alone (no torch path beside them) on the reference
checkpoint's shapes (BENCH.md bench-qwen3-moe) and reports the bytes of weights each call
reads over its time, GB/s:

- linears, bfloat16-packed (`kernels.dense.native_linear.PackedLinear`): qkv 512 -> 768, o_proj
  512 -> 512, lm_head 512 -> 8192; bytes = N * K * 2. The same shapes in 4 bits
  (`kernels.dense.native_linear_q4.PackedQuantLinear`, as `--quantized-layers all` holds them): int4
  group 128 with bfloat16 scales (a bf16 checkpoint's `--quantization int4`) and MXFP4; bytes =
  codes + scales, bfloat16 inputs (as a bf16 model's layers give them).
- one MoE layer's experts (32 experts, top-4, hidden 512, intermediate 256):
  bf16 (`kernels.moe.native.PackedExperts`), int4 group 128 symmetric with float32 scales
  (the engine's `--quantization int4`), int4 with bfloat16 scales, and MXFP4
  (`PackedQuantExperts`); bytes = the packed bytes of every expert the routing uses (an expert
  with several rows is read once).

Weights: random bfloat16 values (scale 0.02); routing: softmax top-4 of random logits.
`--footprint-mb` of copies of each weight set are rotated call by call so that a call finds its
weights in L3, not in the 2 MiB L2 that the previous call left them in (0: one copy, L2-hot).
`--variants avx2 avx512` loads both builds of the native library (`kernels.native.library
.load_variant`) and alternates them batch by batch on the same weights, so that the machine's
load hits both alike; by default the process's own variant runs (`MOE_ENGINE_CPU_ISA`). Times:
median of 5 batches' mean per call, a batch lasting about 60 ms.

`--baseline PATH` adds a library built from another commit (e.g. the one before this
benchmark: check it out, load its kernels once so they build, and pass the
`_moe_engine_cpu*.so` of its `$MOE_ENGINE_CACHE/native/moe_engine_cpu_<digest>/`), alternated
first; `--repeat N` sweeps N times and reports per cell the median (each sweep is itself the
median of 5 batches).

    python bench/cpu_weights.py --rows 1 2 4 8 64 --threads 1 --variants avx2 avx512
    python bench/cpu_weights.py --threads 1 --baseline OLD.so --variants avx2 avx512 --repeat 3
    python bench/cpu_weights.py --threads 2 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.util
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

from kernels.dense.native_linear import PackedLinear
from kernels.dense.native_linear_q4 import PackedQuantLinear
from kernels.moe.native import PackedExperts, PackedQuantExperts
from kernels.native.binding import MODULE
from kernels.native.library import load_native, load_variant, loaded_isa, using
from quant.int4 import Int4Weight, quantize_int4
from quant.mxfp4 import quantize_mxfp4

E, H, INTER, TOP_K = 32, 512, 256, 4
LINEARS = (("qkv", 768, 512), ("o_proj", 512, 512), ("lm_head", 8192, 512))


def _time_ms(fns: dict[str, Callable[[], object]], min_seconds: float = 0.3
             ) -> dict[str, float]:
    """Per function, the median of 5 batches' mean milliseconds per call; the batches of the
    functions alternate (round by round), so that the machine's load hits them alike. A batch
    is as many calls as take the first function about min_seconds / 5."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    first = next(iter(fns.values()))
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds / 5:
        first()
        n += 1
    means: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(n):
                fn()
            means[name].append((time.perf_counter() - t) / n * 1e3)
    return {name: sorted(m)[2] for name, m in means.items()}


def _copies(obj: object, nbytes: int, footprint_mb: float) -> list[object]:
    """`obj` and clones of its tensor fields, as many as make `footprint_mb` (at least one)."""
    n = max(1, int(footprint_mb * 1e6 // max(nbytes, 1)))
    out = [obj]
    for _ in range(n - 1):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        out.append(dataclasses.replace(obj, **{
            k: v.clone() for k, v in fields.items() if isinstance(v, torch.Tensor)}))
    return out


def _rotating(objs: list[object], *args: torch.Tensor) -> Callable[[], object]:
    ring = itertools.cycle(objs)
    return lambda: next(ring)(*args)


def _on(variant: ModuleType | None, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run on `variant`'s module (`kernels.native.library.using`), or on the process's own."""
    if variant is None:
        return fn

    def run() -> object:
        with using(variant):
            return fn()

    return run


def _int4(w13: torch.Tensor, w2: torch.Tensor, scale_dtype: torch.dtype) -> PackedQuantExperts:
    def per_expert(w: torch.Tensor) -> list[Int4Weight]:
        packed, scales, zeros = quantize_int4(w.float(), 128, symmetric=True,
                                              scale_dtype=scale_dtype)
        return [Int4Weight(packed[e], scales[e], None) for e in range(len(w))]

    return PackedQuantExperts.from_int4(per_expert(w13), per_expert(w2))


def expert_sets(g: torch.Generator) -> dict[str, object]:
    """name -> packed experts of one layer, all from the same bf16 weights."""
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.02).bfloat16()
    return {
        "bf16": PackedExperts.pack(w13, w2),
        "int4": _int4(w13, w2, torch.float32),
        "int4_bf16s": _int4(w13, w2, torch.bfloat16),
        "mxfp4": PackedQuantExperts.from_mxfp4(quantize_mxfp4(w13.float()),
                                               quantize_mxfp4(w2.float())),
    }


def run(rows: list[int], footprint_mb: float,
        variants: dict[str, ModuleType | None]) -> list[dict]:
    """One row per (kernel, batch rows, variant): ms per call, weight bytes per call, GB/s.

    Args:
        variants: name -> native module (`kernels.native.library.load_variant`), or None for the
            process's own (`load_native`); timed alternately.
    """
    g = torch.Generator().manual_seed(0)
    cases = []  # (kernel, rows, weight bytes, the call)
    for name, n, k in LINEARS:
        weight = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        packed = PackedLinear.pack(weight)
        nbytes = packed.weight.numel() * packed.weight.element_size()
        objs = _copies(packed, nbytes, footprint_mb)
        for m in rows:
            cases.append((f"linear {name}", m, nbytes,
                          _rotating(objs, torch.randn(m, k, generator=g))))
        for method in ("int4", "mxfp4"):
            q4 = PackedQuantLinear.quantize(weight, None, method, 128, torch.bfloat16)
            objs = _copies(q4, q4.nbytes, footprint_mb)
            for m in rows:
                cases.append((f"linear {name} {method}", m, q4.nbytes,
                              _rotating(objs, torch.randn(m, k, generator=g).bfloat16())))
    router = torch.randn(E, H, generator=g)
    for name, experts in expert_sets(g).items():
        objs = _copies(experts, experts.nbytes, footprint_mb)
        for m in rows:
            x = torch.randn(m, H, generator=g)
            weights, ids = torch.softmax(x @ router.T, -1).topk(TOP_K, dim=-1)
            ids = ids.to(torch.int32)
            nbytes = experts.nbytes * int(torch.unique(ids).numel()) // E
            cases.append((f"experts {name}", m, nbytes, _rotating(objs, x, weights, ids)))
    out = []
    for kernel, m, nbytes, call in cases:
        ms = _time_ms({v: _on(mod, call) for v, mod in variants.items()})
        out += [_row(kernel, m, v, ms[v], nbytes) for v in variants]
    return out


def _row(kernel: str, rows: int, variant: str, ms: float, nbytes: int) -> dict:
    return {"kernel": kernel, "rows": rows, "variant": variant, "ms": round(ms, 4),
            "weight_bytes": nbytes, "gbs": round(nbytes / ms / 1e6, 1)}


def load_baseline(path: str) -> ModuleType:
    """A native library built from another commit (the `_moe_engine_cpu*.so` in its build
    directory under `$MOE_ENGINE_CACHE/native/`), loaded as a module beside this one's. Not
    checked against this ABI: the entry points timed here (moe_linear, moe_fused_moe,
    moe_fused_moe_q4) kept their prototypes from ABI 1 to 2."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def median_runs(runs: list[list[dict]]) -> list[dict]:
    """Per (kernel, rows, variant), the row of the median time over `runs` (same order)."""
    out = []
    for rows in zip(*runs, strict=True):
        ms = statistics.median(r["ms"] for r in rows)
        out.append(_row(rows[0]["kernel"], rows[0]["rows"], rows[0]["variant"], ms,
                        rows[0]["weight_bytes"]))
    return out


def table(results: list[dict]) -> list[str]:
    """Markdown rows: kernel, M, weight MB per call, GB/s (us per call) per variant, and the
    last variant's speed over the first's."""
    variants = list(dict.fromkeys(r["variant"] for r in results))
    lines = ["| kernel | M | MB read | " + " | ".join(variants)
             + f" | {variants[-1]} / {variants[0]} |", "|---" * (len(variants) + 4) + "|"]
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in results:
        cells.setdefault((r["kernel"], r["rows"]), {})[r["variant"]] = r
    for (kernel, m), by in cells.items():
        first, last = by[variants[0]], by[variants[-1]]
        lines.append(f"| {kernel} | {m} | {first['weight_bytes'] / 1e6:.2f} | " + " | ".join(
            f"{by[v]['gbs']:.1f} ({by[v]['ms'] * 1e3:.0f})" for v in variants)
            + f" | {first['ms'] / last['ms']:.2f}x |")
    return lines


def main(rows: list[int], footprint_mb: float, as_json: bool,
         variant_names: list[str] | None = None, baseline: str | None = None,
         repeat: int = 1) -> None:
    """Time and print a markdown table (or JSON with `as_json`).

    Args:
        variant_names: the library variants to alternate (`kernels.native.library.load_variant`);
            default the process's own.
        baseline: a library built from another commit (`load_baseline`), alternated first.
        repeat: sweeps; each cell is the median over them.
    """
    load_native("linear_cpu")
    variants: dict[str, ModuleType | None] = {}
    if baseline:
        variants["baseline"] = load_baseline(baseline)
    if variant_names:
        variants |= {v: load_variant(v) for v in variant_names}
    else:
        variants["default"] = None
    load = os.getloadavg()[0]
    results = median_runs([run(rows, footprint_mb, variants) for _ in range(repeat)])
    head = {"threads": torch.get_num_threads(), "isa": loaded_isa(),
            "footprint_mb": footprint_mb, "repeat": repeat,
            "load": f"{load:.1f} -> {os.getloadavg()[0]:.1f}"}
    if as_json:
        print(json.dumps({**head, "results": results}, indent=1))
        return
    print(", ".join(f"{k} {v}" for k, v in head.items())
          + "; GB/s of weights read (us per call)")
    print("\n".join(table(results)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 64])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--footprint-mb", type=float, default=64.0,
                   help="MB of weight copies rotated (0: one copy, L2-hot)")
    p.add_argument("--variants", nargs="+", choices=["avx2", "avx512"], default=None,
                   help="library variants to alternate (default: the process's own)")
    p.add_argument("--baseline", default=None,
                   help="path of a library built from another commit, alternated first")
    p.add_argument("--repeat", type=int, default=1, help="sweeps (median over them)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    main(a.rows, a.footprint_mb, a.json, a.variants, a.baseline, a.repeat)
