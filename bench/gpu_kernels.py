"""The Triton kernels at real shapes on one GPU: each call checked against a float64 reference,
then timed, its bandwidth given as a percentage of the device's copy bandwidth.

    python bench/gpu_kernels.py [--out DIR] [--repeats 20] [--json]
    python bench/gpu_kernels.py --dry-run --out DIR   # CPU, TRITON_INTERPRET=1, tiny shapes

Fused MoE (`kernels.moe.fused_moe.fused_moe` bf16, `fused_moe_int4` w4a16 symmetric,
`fused_moe_mxfp4`) at 1, 8, 64 and 512 tokens for two layer shapes:

- `qwen3-30b-a3b`: hidden 2048, moe_intermediate 768, 128 experts, top-8 (Qwen3-30B-A3B's
  config.json); int4 group 128.
- `gpt-oss-20b`: hidden 2880, intermediate 2880, 32 experts, top-4 (gpt-oss-20b's config.json);
  int4 group 64 (128 does not divide 2880).

Routing: softmax top-k of standard normal router logits, renormalised (seed 0). Each row is
checked first: relative Frobenius error against `fused_moe_reference` in float64 on the same
weight values (4-bit ones dequantized exactly), bound `MOE_TOL` (bf16 rounds GEMM1's output and
the result); a row over it fails the run. Weight bandwidth = bytes of the expert weights the
step reads / kernel time, where the bytes are the distinct experts hit (`topk_ids.unique()`)
times one expert's bytes in that format (w13 + w2: bf16 values; int4 packed codes + float32
scales; MXFP4 packed codes + uint8 E8M0 scales). Activations are not counted. A 256 MiB buffer
is zeroed before each timed call so that no weight is served from L2 (60 MB on an H200;
triton.testing.do_bench does the same).

Attention (`bench/gpu_attention_rows.py`): paged decode at Qwen3-30B-A3B's widths (batch 64 x
4096 keys: one split; batch 1 x 32768: the flash-decoding splits and their merge), gpt-oss-20b's
(64/8 heads x 64) with sinks, with and without the 128-token window, both split; a prefill chunk
of 512 queries over 2048 cached keys; MLA absorbed decode at DeepSeek-V2-Lite's widths (16
heads, rank 512 + rope 64), batched and split at batch 1. Each checked against
`bench/gpu_reference.py` in float64 (bound 1e-2 in bf16), then timed.

Copy bandwidth: `dst.copy_(src)` of 1 GiB on the device, (read + write bytes) / time; each
kernel's bandwidth is also given as a percentage of it. Times are CUDA events around each call,
after `--warmup` calls, median of `--repeats`; a MoE time is the whole `fused_moe*` call
(`moe_align_block_size`, both grouped GEMMs, the sum over the k slots), as the model pays it.

`--dry-run`: the same code on this CPU on tiny shapes (the same row names; splits forced > 1
where the real shape splits), Triton under its interpreter, one timed call per row (no warm-up)
with `time.perf_counter`; it proves the table is produced and checks the kernels' arithmetic,
its timings mean nothing. Writes `gpu_kernels.md` and `gpu_kernels.json` under `--out`. Exit
status: 0, 1 when a kernel raised or missed its bound (its row says so), 2 without CUDA (not a
dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if "--dry-run" in sys.argv[1:]:  # before anything imports triton: jit decides at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention_rows import (  # noqa: E402
    ATTENTION,
    DRY_ATTENTION,
    DRY_MLA,
    MLA,
    attention_row,
    mla_row,
)
from gpu_reference import moe_ref, rel_error  # noqa: E402

#: Relative Frobenius error bound of a bf16 fused-MoE call against float64.
MOE_TOL = 2e-2
TOKENS = (1, 8, 64, 512)
FORMATS = ("bf16", "int4", "mxfp4")


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer: sizes in elements; `int4_group` values per int4 scale along K."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    int4_group: int


MOE_SHAPES = (
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, 128),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, 64),
)
#: --dry-run: the same names, shapes the interpreter runs in seconds (tl.dot needs dims >= 16;
#: MXFP4 needs K a multiple of 32; top-1 keeps the 512-token rows to 32 M-blocks).
DRY_MOE_SHAPES = (
    MoeShape("qwen3-30b-a3b", 32, 32, 8, 1, 32),
    MoeShape("gpt-oss-20b", 32, 32, 4, 1, 32),
)


class Timer:
    """Median milliseconds per call: CUDA events on a GPU, `time.perf_counter` on the CPU."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        cuda = device.type == "cuda"
        # zeroed before each timed call so that the weights come from HBM, not L2
        self.flush = torch.empty(256 * 2**20 if cuda else 1, dtype=torch.uint8, device=device)

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.repeats):
            self.flush.zero_()
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


def copy_bandwidth_gbs(timer: Timer, nbytes: int) -> float:
    """(read + write bytes) of one `dst.copy_(src)` of `nbytes` / its median time, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3) / 1e9


def expert_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of one expert's slice of each `[E, ...]` tensor (None: absent, 0 bytes)."""
    return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)


def make_experts(shape: MoeShape, device: torch.device, g: torch.Generator) -> dict:
    """bf16 weights (std 0.02, as an initialised checkpoint) and each format's kernel inputs:
    {format: (per-expert bytes, fn(hidden, topk_weights, topk_ids) -> [T, H],
    fn() -> the (w13, w2) values the kernel computes with, float32)}."""
    from kernels.moe.fused_moe import fused_moe, fused_moe_int4, fused_moe_mxfp4
    from quant.int4 import dequantize_int4, quantize_int4
    from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    e, i, h = shape.num_experts, shape.intermediate, shape.hidden
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * 0.02).to(torch.bfloat16)
    p13, s13, z13 = quantize_int4(w13, shape.int4_group, symmetric=True)
    p2, s2, z2 = quantize_int4(w2, shape.int4_group, symmetric=True)
    (b13, m13), (b2, m2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    f32 = torch.float32
    return {
        "bf16": (expert_bytes(w13, w2), lambda x, tw, ti: fused_moe(x, w13, w2, tw, ti),
                 lambda: (w13.float(), w2.float())),
        "int4": (
            expert_bytes(p13, s13, z13, p2, s2, z2),
            lambda x, tw, ti: fused_moe_int4(x, p13, s13, p2, s2, tw, ti, z13, z2),
            lambda: (dequantize_int4(p13, s13, z13, f32), dequantize_int4(p2, s2, z2, f32)),
        ),
        "mxfp4": (
            expert_bytes(b13, m13, b2, m2),
            lambda x, tw, ti: fused_moe_mxfp4(x, b13, m13, b2, m2, tw, ti),
            lambda: (dequantize_mxfp4(b13, m13, f32), dequantize_mxfp4(b2, m2, f32)),
        ),
    }


def route(tokens: int, shape: MoeShape, device: torch.device, g: torch.Generator):
    """(topk_weights [T, k] float32 renormalised, topk_ids [T, k] int32): softmax top-k."""
    logits = torch.randn(tokens, shape.num_experts, generator=g, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def moe_rows(shape: MoeShape, tokens_list, timer: Timer, copy_gbs: float, g) -> list[dict]:
    """One row per (format, tokens) of `shape`; a kernel that raises gives a row with `error`."""
    device = timer.device
    experts = make_experts(shape, device, g)
    rows = []
    for tokens in tokens_list:
        x = (torch.randn(tokens, shape.hidden, generator=g, device=device)).to(torch.bfloat16)
        topk_weights, topk_ids = route(tokens, shape, device, g)
        hit = int(torch.unique(topk_ids).numel())
        for fmt in FORMATS:
            per_expert, fn, values = experts[fmt]
            row = {"layer": shape.name, "format": fmt, "tokens": tokens, "experts_hit": hit,
                   "weight_bytes": hit * per_expert, "tol": MOE_TOL}  # fmt: skip
            try:
                want = moe_ref(x, *values(), topk_weights, topk_ids)
                row["err"] = rel_error(fn(x, topk_weights, topk_ids), want)
                row["ok"] = row["err"] < MOE_TOL
                del want
                ms = timer.median_ms(lambda fn=fn, a=(x, topk_weights, topk_ids): fn(*a))
            except Exception as exc:  # one broken kernel must not hide the others' figures
                row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            else:
                gbs = row["weight_bytes"] / (ms / 1e3) / 1e9
                row |= {"ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}
            rows.append(row)
    return rows


def _figures(r: dict) -> str:
    """"| err | ms | GB/s | % of copy | status |" cells of a row."""
    err = f"{r['err']:.1e}" if "err" in r else "-"
    if "error" in r:
        return f"| {err} | - | - | - | error: {r['error']} |"
    status = "ok" if r["ok"] else f"FAILED: error {r['err']:.2e} >= {r['tol']:g}"
    return f"| {err} | {r['ms']:.4f} | {r['gbs']:.1f} | {r['pct_of_copy']:.1f}% | {status} |"


def markdown(report: dict) -> str:
    """The report as markdown: a header line, the MoE table, the attention table."""
    lines = [
        f"device {report['device']}, torch {report['torch']}, triton {report['triton']}, "
        f"copy bandwidth {report['copy_bandwidth_gbs']:.1f} GB/s (read + write)"
        + (" -- DRY RUN on the CPU (interpreter, tiny shapes): not figures" if report["dry_run"]
           else "")
        + ("" if report["complete"] else " -- INCOMPLETE (stopped part-way)"),  # fmt: skip
        "",
        "| layer | format | tokens | experts hit | weight MiB | rel. error | ms | GB/s "
        "| % of copy | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["moe"]:
        lines.append(f"| {r['layer']} | {r['format']} | {r['tokens']} | {r['experts_hit']} | "
                     f"{r['weight_bytes'] / 2**20:.2f} " + _figures(r))  # fmt: skip
    lines += ["", "| attention | kind | shape | splits | MiB read | rel. error | ms | GB/s "
              "| % of copy | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["attention"]:
        tflops = f" ({r['tflops']:.1f} TFLOP/s)" if "tflops" in r else ""
        lines.append(f"| {r['name']}{tflops} | {r['kind']} | {r['shape']} | {r['splits']} | "
                     f"{r['bytes'] / 2**20:.2f} " + _figures(r))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Measure everything; `save(report)` after each part, so that a run stopped by a timeout
    leaves the parts it finished (`complete` stays False)."""
    import triton

    device = torch.device("cpu" if args.dry_run else "cuda")
    timer = Timer(device, warmup=0 if args.dry_run else args.warmup,
                  repeats=1 if args.dry_run else args.repeats)  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    copy_timer = Timer(device, warmup=max(1, timer.warmup), repeats=timer.repeats)
    copy_gbs = copy_bandwidth_gbs(copy_timer, 2**20 if args.dry_run else 2**30)
    report = {
        "dry_run": args.dry_run,
        "complete": False,
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_interpret": bool(triton.knobs.runtime.interpret),
        "copy_bandwidth_gbs": copy_gbs,
        "repeats": timer.repeats,
        "moe": [],
    }
    # attention first: few kernels to compile, so a MoE step that runs out of time keeps them
    report["attention"] = []
    for case in DRY_ATTENTION if args.dry_run else ATTENTION:
        report["attention"].append(attention_row(case, timer, copy_gbs, g, torch.bfloat16))
        save(report)
    for case in DRY_MLA if args.dry_run else MLA:
        report["attention"].append(mla_row(case, timer, copy_gbs, g, torch.bfloat16))
        save(report)
    for shape in DRY_MOE_SHAPES if args.dry_run else MOE_SHAPES:
        report["moe"] += moe_rows(shape, args.tokens, timer, copy_gbs, g)
        save(report)
    report["complete"] = True
    save(report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--repeats", type=int, default=20, help="timed calls per row (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    p.add_argument("--out", type=Path, default=None, help="write gpu_kernels.md/.json here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton interpreter, tiny shapes, 1 call: checks the code only")
    p.add_argument("--json", action="store_true", help="print the JSON report, not the table")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_kernels.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--dry-run checks the code on the CPU", file=sys.stderr)  # fmt: skip
        return 2

    def save(report: dict) -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_kernels.md").write_text(markdown(report))
            (args.out / "gpu_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"gpu_kernels.py: {len(report['moe'])} MoE rows measured", file=sys.stderr,
              flush=True)  # fmt: skip

    report = run(args, save)
    print(json.dumps(report) if args.json else markdown(report), end="" if not args.json else "\n")
    failed = [r for r in report["moe"] + report["attention"] if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
