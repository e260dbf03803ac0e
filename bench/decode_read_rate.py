"""Decode kernels' weight read rate at real shapes, against a streaming read in the same sitting.

A batch-1 decode step is bound by reading weights (issue 41: gpt-oss-20b reads ~3.7 GB a
token). This measures, in one process and one sitting:

- the streaming rate: `torch.sum` over a float32 buffer of `--stream-mb` (2 threads by
  default; `torch.set_num_threads`), a sample taken before every kernel case, so the figure
  follows the machine's load through the run; the report gives the median and the best;
- each decode kernel the engine binds at real shapes, at 1, 2, 4, 8 rows (`--rows`):
  the bfloat16 linear as `LinearKernel` runs a bf16 layer on this CPU (`AmxLinear`: AMX tiles
  or AVX512-BF16, `kernels.dense.amx.bf16_backend`), the 4-bit linear (`PackedQuantLinear`,
  bfloat16 inputs as a bf16 model gives them: MXFP4 for gpt-oss-20b, int4 group 128 with
  bfloat16 scales for Qwen3-30B-A3B), and the 4-bit fused MoE (`PackedQuantExperts`, MXFP4,
  32 experts, top-4, hidden = intermediate = 2880, gpt-oss's clamped SwiGLU) at 1 token
  (`--expert-tokens`: others, e.g. a prefill's 256);
  shapes: gpt-oss-20b qkv [5120, 2880], o [2880, 4096], LM head [201088, 2880];
  Qwen3-30B-A3B qkv [5120, 2048], o [2048, 4096], LM head [151936, 2048].

Per case: GB/s of weight bytes read (the packed bytes a call reads; for the experts, those of
the experts the routing picks) and the ratio to the median streaming rate. Weights are random
(values do not change what is read). Small matrices are cloned into `--footprint-mb` of copies
rotated call by call (the 32 MiB L3 does not serve them); the experts are routed at random each
call. Times: per case, `--repeats` batches (each about `--batch-s` seconds), the median batch's
mean per call. `--baseline PATH` loads another build of the native library (the
`_moe_engine_cpu*.so` of a `$MOE_ENGINE_CACHE/native/moe_engine_cpu_*` directory, e.g. built
from main) and alternates it with this checkout's batch by batch (before/after in one sitting;
the experts' format is given to it without `DOT_FLAG`, unknown before, unless
`--baseline-dot`).
The load average is printed at the start and the end: the machine is shared, so the numbers
are noisy; compare only rows of one run.

    PYTHONPATH=$PWD python bench/decode_read_rate.py
    PYTHONPATH=$PWD python bench/decode_read_rate.py --only gpt-oss --rows 1 --baseline OLD.so
    PYTHONPATH=$PWD python bench/decode_read_rate.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_weights import load_baseline  # noqa: E402
from kernels.dense.amx import AmxLinear, bf16_backend  # noqa: E402
from kernels.dense.native_linear_q4 import PackedQuantLinear  # noqa: E402
from kernels.moe.activation import SwiGLU  # noqa: E402
from kernels.moe.native import DOT_FLAG, PackedQuantExperts  # noqa: E402
from kernels.native.library import load_native, using  # noqa: E402

#: (model, layer, out features N, in features K), and the 4-bit method of the model's linears.
SHAPES = (("gpt-oss-20b", "qkv", 5120, 2880), ("gpt-oss-20b", "o", 2880, 4096),
          ("gpt-oss-20b", "lm_head", 201088, 2880),
          ("qwen3-30b-a3b", "qkv", 5120, 2048), ("qwen3-30b-a3b", "o", 2048, 4096),
          ("qwen3-30b-a3b", "lm_head", 151936, 2048))
Q4_METHOD = {"gpt-oss-20b": ("mxfp4", 32), "qwen3-30b-a3b": ("int4", 128)}
#: gpt-oss-20b's experts: count, top-k, hidden, intermediate.
EXPERTS, TOP_K, HIDDEN, INTER = 32, 4, 2880, 2880
GPT_OSS_SWIGLU = SwiGLU(alpha=1.702, limit=7.0)


@dataclass
class Case:
    """One kernel at one batch size: `calls()` yields a fresh call each time (rotating copies)."""

    name: str
    rows: int
    nbytes: int  # weight bytes one call reads
    calls: Iterator[Callable[[], object]]
    baseline_calls: Iterator[Callable[[], object]] | None = None  # else `calls`


def _rotate(fns: list[Callable[[], object]]) -> Iterator[Callable[[], object]]:
    while True:
        yield from fns


def _copies(nbytes: int, footprint_mb: float) -> int:
    return max(1, int(footprint_mb * 1e6 // max(nbytes, 1)))


def _bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)


def _amx(n: int, k: int, gen: torch.Generator) -> AmxLinear:
    """An `AmxLinear` of random packed bf16 weights [ceil(N/16), K/2, 16, 2] (no bias)."""
    return AmxLinear(_bf16(-(-n // 16), k // 2, 16, 2, gen=gen), torch.empty(0), n, k)


def _q4(n: int, k: int, method: str, group: int, gen: torch.Generator) -> PackedQuantLinear:
    """A `PackedQuantLinear` of random codes and scales in the kernel's layout."""
    tiles = -(-n // 16)
    codes = torch.randint(0, 256, (tiles, k // 2, 16), dtype=torch.uint8, generator=gen)
    if method == "mxfp4":
        scales = torch.randint(118, 126, (tiles, k // group, 16), dtype=torch.uint8,
                               generator=gen)
    else:
        scales = (torch.rand(tiles, k // group, 16, generator=gen) * 0.01).bfloat16()
    return PackedQuantLinear(method, codes, scales, torch.empty(0), n, k, group)


def _experts(gen: torch.Generator) -> PackedQuantExperts:
    """gpt-oss-20b-shaped MXFP4 experts of random codes and scales."""
    e, h, i = EXPERTS, HIDDEN, INTER

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    def scales(*shape: int) -> torch.Tensor:
        return torch.randint(118, 126, shape, dtype=torch.uint8, generator=gen)

    empty = torch.empty(0, dtype=torch.uint8)
    return PackedQuantExperts("mxfp4", codes(e, 2, i // 16, h // 2, 16),
                              scales(e, 2, i // 16, h // 32, 16), empty,
                              codes(e, h // 16, i // 2, 16), scales(e, h // 16, i // 32, 16),
                              empty, i, h, 32)


def linear_cases(model: str, layer: str, n: int, k: int, rows: list[int], footprint_mb: float,
                 gen: torch.Generator) -> Iterator[Case]:
    """The bf16 and the 4-bit linear of one shape at each batch size (weights built lazily,
    one kernel's copies alive at a time)."""
    nbytes = -(-n // 16) * 16 * k * 2
    objs = [_amx(n, k, gen) for _ in range(_copies(nbytes, footprint_mb))]
    for m in rows:
        x = _bf16(m, k, gen=gen)
        yield Case(f"{model} {layer} bf16", m, objs[0].nbytes,
                   _rotate([lambda o=o, x=x: o(x) for o in objs]))
    del objs
    gc.collect()
    method, group = Q4_METHOD[model]
    first = _q4(n, k, method, group, gen)
    objs = [first] + [_q4(n, k, method, group, gen)
                      for _ in range(_copies(first.nbytes, footprint_mb) - 1)]
    for m in rows:
        x = _bf16(m, k, gen=gen)
        yield Case(f"{model} {layer} {method}", m, first.nbytes,
                   _rotate([lambda o=o, x=x: o(x) for o in objs]))
    del objs, first
    gc.collect()


def expert_case(tokens: list[int], gen: torch.Generator, baseline_dot: bool
                ) -> Iterator[Case]:
    """gpt-oss-20b's MXFP4 experts at each of `tokens`, routed at random each call (the bytes
    are those of the distinct experts picked)."""
    experts = _experts(gen)
    # a baseline library from before `DOT_FLAG` reads the flagged format as another one
    flagless = dataclasses.replace(experts)
    flagless.__dict__["weight_args"] = experts.weight_args._replace(
        format=experts.weight_args.format & ~DOT_FLAG)
    per_expert = experts.nbytes // EXPERTS
    for t in tokens:
        x = _bf16(t, HIDDEN, gen=gen)
        routes = [torch.rand(t, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K].to(torch.int32)
                  for _ in range(8)]
        used = statistics.mean(len(torch.unique(r)) for r in routes)

        def calls(obj: PackedQuantExperts, x: torch.Tensor = x,
                  routes: list[torch.Tensor] = routes) -> Iterator[Callable[[], object]]:
            for ids in _rotate(routes):
                weights = torch.softmax(torch.rand(len(ids), TOP_K, generator=gen), -1)
                yield lambda ids=ids, w=weights: obj(x, w, ids, activation=GPT_OSS_SWIGLU)

        yield Case("gpt-oss-20b experts mxfp4", t, int(per_expert * used), calls(experts),
                   None if baseline_dot else calls(flagless))


def stream_gbs(buf: torch.Tensor) -> float:
    """One streaming read of `buf` (torch.sum), GB/s."""
    t = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t) / 1e9


def time_case(case: Case, variants: dict[str, ModuleType | None], repeats: int,
              batch_s: float) -> dict[str, float]:
    """Per variant, the median over `repeats` batches of the mean ms per call; variants
    alternate batch by batch. A batch is as many calls as took `batch_s` on the first."""
    def run(mod: ModuleType | None, n: int) -> float:
        calls = case.calls if mod is None or case.baseline_calls is None else case.baseline_calls
        fns = [next(calls) for _ in range(n)]
        t = time.perf_counter()
        if mod is None:
            for fn in fns:
                fn()
        else:
            with using(mod):
                for fn in fns:
                    fn()
        return (time.perf_counter() - t) / n * 1e3

    for mod in variants.values():
        run(mod, 2)
    n = max(1, int(batch_s * 1e3 / run(next(iter(variants.values())), 2)))
    ms: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v, mod in variants.items():
            ms[v].append(run(mod, n))
    return {v: statistics.median(t) for v, t in ms.items()}


def all_cases(args: argparse.Namespace, gen: torch.Generator) -> Iterator[Case]:
    for model, layer, n, k in SHAPES:
        if any(s in f"{model} {layer}" for s in args.only):
            yield from linear_cases(model, layer, n, k, args.rows, args.footprint_mb, gen)
    if any(s in "gpt-oss-20b experts" for s in args.only):
        yield from expert_case(args.expert_tokens, gen, args.baseline_dot)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    load_native("linear_cpu")
    variants: dict[str, ModuleType | None] = {"this": None}
    if args.baseline:
        variants = {"baseline": load_baseline(args.baseline), "this": None}
    gen = torch.Generator().manual_seed(0)
    buf = torch.ones(int(args.stream_mb * 1e6 // 4), dtype=torch.float32)
    stream = [stream_gbs(buf) for _ in range(args.repeats)]
    load_start, rows = os.getloadavg(), []
    for case in all_cases(args, gen):
        stream += [stream_gbs(buf) for _ in range(2)]
        ms = time_case(case, variants, args.repeats, args.batch_s)
        for v, t in ms.items():
            rows.append({"kernel": case.name, "rows": case.rows, "variant": v,
                         "ms": round(t, 4), "weight_bytes": case.nbytes,
                         "gbs": round(case.nbytes / t / 1e6, 2)})
        if not args.json:
            print(" | ".join(f"{r['kernel']} x{r['rows']} {r['variant']}: {r['ms']:.3f} ms "
                             f"{r['gbs']:.1f} GB/s" for r in rows[-len(ms):]), flush=True)
    median = statistics.median(stream)
    for r in rows:
        r["ratio"] = round(r["gbs"] / median, 3)
    return {"bf16_backend": bf16_backend(), "threads": args.threads,
            "stream_mb": args.stream_mb, "stream_gbs_median": round(median, 2),
            "stream_gbs_best": round(max(stream), 2), "stream_samples": len(stream),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "rows": rows}


def print_table(result: dict) -> None:
    print(f"\nstreaming read ({result['stream_mb']:.0f} MB torch.sum, {result['threads']} "
          f"threads): median {result['stream_gbs_median']} GB/s, best "
          f"{result['stream_gbs_best']} GB/s over {result['stream_samples']} samples; "
          f"bf16 backend {result['bf16_backend']}; load average "
          f"{result['loadavg_start']} -> {result['loadavg_end']}")
    print(f"{'kernel':34} {'rows':>4} {'variant':>8} {'MB':>8} {'ms':>9} {'GB/s':>7} "
          f"{'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['kernel']:34} {r['rows']:>4} {r['variant']:>8} "
              f"{r['weight_bytes'] / 1e6:>8.1f} {r['ms']:>9.3f} {r['gbs']:>7.1f} "
              f"{r['ratio']:>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--expert-tokens", type=int, nargs="+", default=[1],
                   help="tokens per call of the experts' case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="batches per case (median)")
    p.add_argument("--batch-s", type=float, default=0.15, help="seconds per batch")
    p.add_argument("--footprint-mb", type=float, default=256.0,
                   help="copies of each small weight rotated call by call")
    p.add_argument("--stream-mb", type=float, default=2048.0)
    p.add_argument("--only", nargs="+", default=[""],
                   help="cases whose 'model layer' contains one of these")
    p.add_argument("--baseline", help="another build's _moe_engine_cpu*.so, alternated")
    p.add_argument("--baseline-dot", action="store_true",
                   help="the baseline library takes the experts' DOT_FLAG (built after it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
