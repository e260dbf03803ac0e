"""Achieved memory bandwidth of the Triton fused MoE and paged attention kernels on one GPU.

    python bench/gpu_kernels.py [--out DIR] [--repeats 20] [--json]
    python bench/gpu_kernels.py --dry-run --out DIR   # CPU, TRITON_INTERPRET=1, tiny shapes

Fused MoE (`kernels.moe.fused_moe.fused_moe` bf16, `fused_moe_int4` w4a16 symmetric,
`fused_moe_mxfp4`) at 1, 8, 64 and 512 tokens for two layer shapes:

- `qwen3-30b-a3b`: hidden 2048, moe_intermediate 768, 128 experts, top-8 (Qwen3-30B-A3B's
  config.json); int4 group 128.
- `gpt-oss-20b`: hidden 2880, intermediate 2880, 32 experts, top-4 (gpt-oss-20b's config.json);
  int4 group 64 (128 does not divide 2880).

Routing: softmax top-k of standard normal router logits, renormalised (seed 0). Weight
bandwidth = bytes of the expert weights the step reads / kernel time, where the bytes are the
distinct experts hit (`topk_ids.unique()`) times one expert's bytes in that format (w13 + w2:
bf16 values; int4 packed codes + float32 scales; MXFP4 packed codes + uint8 E8M0 scales).
Activations are not counted. A 256 MiB buffer is zeroed before each timed call so that no
weight is served from L2 (60 MB on an H200; triton.testing.do_bench does the same).

Decode attention (`kernels.attention.triton_attention.paged_attention`, imported lazily; a
"missing" row
when it is not there): batch 64, one query token per sequence over 4096 tokens of context,
Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128), bf16 cache in blocks of
16 tokens placed in shuffled blocks. KV bandwidth = K and V bytes of every context token /
kernel time.

Copy bandwidth: `dst.copy_(src)` of 1 GiB on the device, (read + write bytes) / time; each
kernel's bandwidth is also given as a percentage of it. Times are CUDA events around each call,
after `--warmup` calls, median of `--repeats`; a MoE time is the whole `fused_moe*` call
(`moe_align_block_size`, both grouped GEMMs, the sum over the k slots), as the model pays it.

`--dry-run`: the same code on this CPU on tiny shapes (the same layer names and token counts),
Triton under its interpreter, one timed call per row (no warm-up) with `time.perf_counter`; it
proves the table is produced, its numbers mean nothing. Writes `gpu_kernels.md` and
`gpu_kernels.json` under `--out`. Exit status: 0, 1 when a kernel raised (its row says so), 2
without CUDA (not a dry run).
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


@dataclass(frozen=True)
class AttentionShape:
    """A decode batch: `batch` sequences of `context` tokens, one new query token each."""

    name: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


MOE_SHAPES = (
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, 128),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, 64),
)
ATTENTION = AttentionShape("qwen3-30b-a3b decode", 64, 4096, 32, 4, 128, 16)
#: --dry-run: the same names, shapes the interpreter runs in seconds (tl.dot needs dims >= 16;
#: MXFP4 needs K a multiple of 32; top-1 keeps the 512-token rows to 32 M-blocks).
DRY_MOE_SHAPES = (
    MoeShape("qwen3-30b-a3b", 32, 32, 8, 1, 32),
    MoeShape("gpt-oss-20b", 32, 32, 4, 1, 32),
)
DRY_ATTENTION = AttentionShape("qwen3-30b-a3b decode", 2, 48, 4, 2, 16, 16)


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
    {format: (per-expert bytes, fn(hidden, topk_weights, topk_ids) -> [T, H])}."""
    from kernels.moe.fused_moe import fused_moe, fused_moe_int4, fused_moe_mxfp4
    from quant.int4 import quantize_int4
    from quant.mxfp4 import quantize_mxfp4

    e, i, h = shape.num_experts, shape.intermediate, shape.hidden
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * 0.02).to(torch.bfloat16)
    p13, s13, z13 = quantize_int4(w13, shape.int4_group, symmetric=True)
    p2, s2, z2 = quantize_int4(w2, shape.int4_group, symmetric=True)
    (b13, m13), (b2, m2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return {
        "bf16": (expert_bytes(w13, w2), lambda x, tw, ti: fused_moe(x, w13, w2, tw, ti)),
        "int4": (
            expert_bytes(p13, s13, z13, p2, s2, z2),
            lambda x, tw, ti: fused_moe_int4(x, p13, s13, p2, s2, tw, ti, z13, z2),
        ),
        "mxfp4": (
            expert_bytes(b13, m13, b2, m2),
            lambda x, tw, ti: fused_moe_mxfp4(x, b13, m13, b2, m2, tw, ti),
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
            per_expert, fn = experts[fmt]
            row = {"layer": shape.name, "format": fmt, "tokens": tokens, "experts_hit": hit,
                   "weight_bytes": hit * per_expert}  # fmt: skip
            try:
                ms = timer.median_ms(lambda fn=fn, a=(x, topk_weights, topk_ids): fn(*a))
            except Exception as exc:  # one broken kernel must not hide the others' figures
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                gbs = row["weight_bytes"] / (ms / 1e3) / 1e9
                row |= {"ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}
            rows.append(row)
    return rows


def attention_inputs(shape: AttentionShape, device: torch.device, g: torch.Generator) -> dict:
    """A decode batch over a bf16 paged cache: every sequence's blocks shuffled in the pool."""
    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=g, device=device).to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, generator=g, device=device).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g, device=device)
    return {
        "q": torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, generator=g,
                         device=device).to(torch.bfloat16),  # fmt: skip
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": perm.view(shape.batch, blocks_per_seq).to(torch.int32),
        "seq_lens": torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(shape.batch + 1, dtype=torch.int32, device=device),
    }


def attention_row(shape: AttentionShape, timer: Timer, copy_gbs: float, g) -> dict:
    """Decode attention's KV bandwidth, or a row with `missing` when the kernel is absent."""
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * 2
    row = {"name": shape.name, "batch": shape.batch, "context": shape.context,
           "q_heads": shape.num_q_heads, "kv_heads": shape.num_kv_heads,
           "head_dim": shape.head_dim, "kv_bytes": kv_bytes}  # fmt: skip
    try:
        from kernels.attention.triton_attention import paged_attention
    except ImportError as exc:
        module = "kernels.attention.triton_attention"
        row["missing"] = f"{module}.paged_attention not importable ({exc})"
        return row
    inputs = attention_inputs(shape, timer.device, g)
    scale = shape.head_dim**-0.5

    def call() -> object:
        return paged_attention(**inputs, scale=scale, max_query_len=1)

    try:
        ms = timer.median_ms(call)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row
    gbs = kv_bytes / (ms / 1e3) / 1e9
    return row | {"ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}


def _figures(r: dict) -> str:
    if "missing" in r or "error" in r:
        return f"| - | - | - | {r.get('missing') or 'error: ' + r['error']} |"
    return f"| {r['ms']:.4f} | {r['gbs']:.1f} | {r['pct_of_copy']:.1f}% | ok |"


def markdown(report: dict) -> str:
    """The report as markdown: a header line, the MoE table, the attention table."""
    lines = [
        f"device {report['device']}, torch {report['torch']}, triton {report['triton']}, "
        f"copy bandwidth {report['copy_bandwidth_gbs']:.1f} GB/s (read + write)"
        + (" -- DRY RUN on the CPU (interpreter, tiny shapes): not figures" if report["dry_run"]
           else "")
        + ("" if report["complete"] else " -- INCOMPLETE (stopped part-way)"),  # fmt: skip
        "",
        "| layer | format | tokens | experts hit | weight MiB | ms | GB/s | % of copy | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["moe"]:
        lines.append(f"| {r['layer']} | {r['format']} | {r['tokens']} | {r['experts_hit']} | "
                     f"{r['weight_bytes'] / 2**20:.2f} " + _figures(r))  # fmt: skip
    a = report["attention"]
    lines += [
        "",
        "| attention | batch x context | q/kv heads x dim | KV MiB | ms | GB/s | % of copy "
        "| status |",
        "|---|---|---|---:|---:|---:|---:|---|",
        f"| {a['name']} | {a['batch']} x {a['context']} | {a['q_heads']}/{a['kv_heads']} x "
        f"{a['head_dim']} | {a['kv_bytes'] / 2**20:.2f} " + _figures(a),
    ]
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
    # attention first: one kernel to compile, so a MoE step that runs out of time keeps it
    report["attention"] = attention_row(
        DRY_ATTENTION if args.dry_run else ATTENTION, timer, copy_gbs, g
    )
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
    failed = [r for r in report["moe"] + [report["attention"]] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
