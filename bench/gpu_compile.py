"""The Hopper compile check: every Triton kernel the engine launches, for every config it can
pick, compiled for a GPU on this CPU, and checked against the GPU's limits.

    python bench/gpu_compile.py [--arch sm_90|sm_100] [--quick] [--json [PATH]] [--jobs N]
        [--family NAME] [--op OP] [--quant Q] [--tokens 1,4] [--moe-config M,N,K,WARPS,STAGES]

1. Records: every driver of bench/gpu_variants.py calls the engine's real launcher (fused MoE
   bf16/fp16/fp32, int4, MXFP4; paged attention decode with its KV splits and merge, prefill;
   MLA decode) for each served family of bench/gpu_families.py and each point of the sweep
   (tokens 1..8192 and their odd neighbours, decode batches 1..256 over block tables as wide as
   ``max_model_len``), with Triton's launch intercepted (bench/gpu_recorder.py): the configs
   are the ones the launchers choose, specialised as a launch on that GPU specialises them.
2. Compiles each distinct variant once (``triton.compile(ASTSource(...),
   target=GPUTarget("cuda", 90 or 100, 32))``, ptxas from Triton's wheel), in ``--jobs``
   processes, and reads shared memory, registers, spills and global-load widths
   (bench/gpu_kernel_stats.py).
3. Prints one row per variant and a summary, writes ``--json``, and exits 1 when a variant needs
   more than 232,448 B of shared memory per block (the opt-in maximum of H100, H200 and B200:
   227 KiB), a decode-path variant spills registers (attention decode, merge, MLA decode, fused
   MoE at <= 256 tokens), or a compile fails. Each failure names the kernel, the config, the
   family and shape, and the numbers.

Results are cached per variant in ``$MOE_ENGINE_CACHE/gpu-compile/`` (key: Triton's version,
the target, the kernel's source hash and the whole specialisation), so a rerun after a config
change compiles only what changed. Run it without ``TRITON_INTERPRET=1``.

The full sweep (917 variants) took 12.4 minutes cold with 2 processes on the project's 2-core
machine (more under load; docs/kernels.md), about 20 s cached: it stays a bench, not CI even as
a ``slow`` test; tests/test_gpu_compile.py runs a quick subset that includes the int4
Qwen3-30B-A3B decode tiles. Works with Triton 3.6 and 3.9, for sm_90 and sm_100.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_families  # noqa: E402
import gpu_variants  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from gpu_kernel_stats import cubin_usage, format_loads, global_loads  # noqa: E402
from gpu_recorder import Launch, record_launches  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SHARED_LIMIT = 232_448  # bytes per block, opt-in maximum on sm_90 (H100/H200) and sm_100 (B200)
ARCHS = {"sm_90": 90, "sm_100": 100}
_CONFIG_NAMES = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "BLOCK_Q", "G_PAD", "BLOCK_H",
                 "BLOCK_N", "NUM_SPLITS", "SPLITS_PAD", "DIM_PAD", "HEAD_DIM_PAD", "BLOCK_PAIRS",
                 "NUM_EXPERTS_PAD", "TOP_K")  # fmt: skip


@dataclass
class Variant:
    """One distinct compile: the launch and every labelled call that produced it."""

    launch: Launch
    uses: list[dict[str, Any]] = field(default_factory=list)
    decode: bool = False
    result: dict[str, Any] | None = None

    def config(self) -> str:
        """``M16 N128 K128 w4 s3``-style: the tile constexprs, warps and stages."""
        values = self.launch.constexpr_values()
        short = {"BLOCK_SIZE_M": "M", "BLOCK_SIZE_N": "N", "BLOCK_SIZE_K": "K"}
        parts = [f"{short.get(n, n)}{'' if n in short else '='}{values[n]}"
                 for n in _CONFIG_NAMES if n in values]  # fmt: skip
        if values.get("ACTIVATION") is not None:
            parts.insert(0, "w13" if values["ACTIVATION"] else "w2")
        opts = self.launch.options
        return " ".join(parts + [f"w{opts['num_warps']}", f"s{opts['num_stages']}"])

    def where(self) -> str:
        first = self.uses[0]
        more = f" (+{len(self.uses) - 1})" if len(self.uses) > 1 else ""
        return f"{first['family']} {first['dtype']} {first['quant']} {first['shape']}{more}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="sm_90")
    p.add_argument("--quick", action="store_true", help="bf16 and a few token counts only")
    p.add_argument("--json", nargs="?", const="gpu_compile.json", default=None, metavar="PATH",
                   help="write the results as JSON (default path gpu_compile.json)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="compile processes (default min(4, cores))")
    p.add_argument("--family", action="append", help="only families containing this (repeat)")
    p.add_argument("--op", action="append", choices=[d.__name__ for d in gpu_variants.DRIVERS],
                   help="only these drivers (repeat)")
    p.add_argument("--quant", action="append", help="only formats/layer kinds starting so")
    p.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"),
                   help="only these compute dtypes (repeat)")
    p.add_argument("--tokens", help="comma-separated token counts / decode batches")
    p.add_argument("--moe-config", help="force every fused-MoE call to M,N,K,WARPS,STAGES")
    p.add_argument("--no-cache", action="store_true", help="ignore and rewrite cached results")
    p.add_argument("--quiet", action="store_true", help="no per-variant table")
    args = p.parse_args(argv)
    if args.tokens and not all(x.strip().isdigit() and int(x) > 0 for x in args.tokens.split(",")):
        p.error(f"--tokens must be positive integers separated by commas, got {args.tokens!r}")
    if args.moe_config and len(args.moe_config.split(",")) != 5:
        p.error(f"--moe-config must be M,N,K,WARPS,STAGES (5 integers), got {args.moe_config!r}")
    return args


def _sweep(args: argparse.Namespace) -> gpu_families.Sweep:
    sweep = gpu_families.QUICK if args.quick else gpu_families.FULL
    if args.dtype:
        names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        sweep = replace(sweep, dtypes=tuple(names[d] for d in args.dtype))
    if args.tokens:
        counts = tuple(int(x) for x in args.tokens.split(","))
        sweep = replace(sweep, num_tokens=counts, decode_batches=counts)
    if args.moe_config:
        from kernels.moe.fused_moe_configs import MoeTileConfig

        config = MoeTileConfig(*(int(x) for x in args.moe_config.split(",")))
        sweep = replace(sweep, moe_config=config)
    return sweep


def _wanted(args: argparse.Namespace, labels: dict[str, Any]) -> bool:
    if args.dtype is not None and labels["dtype"] not in args.dtype:
        return False
    return args.quant is None or any(labels["quant"].startswith(q) for q in args.quant)


def collect(args: argparse.Namespace, target: GPUTarget) -> dict[str, Variant]:
    """Run every selected driver under the recorder; variants by `Launch.key`, in order."""
    variants: dict[str, Variant] = {}
    sweep = _sweep(args)
    families = [
        f
        for f in gpu_families.FAMILIES
        if not args.family or any(n.lower() in f.name.lower() for n in args.family)
    ]
    drivers = [d for d in gpu_variants.DRIVERS if not args.op or d.__name__ in args.op]
    labels: dict[str, Any] = {}
    with record_launches(target, labels) as launches:
        for fam in families:
            for driver in drivers:
                for case in driver(fam, sweep):
                    if not _wanted(args, case.labels):
                        continue
                    labels.clear()
                    labels.update(case.labels, decode=case.decode)
                    case.call()
    for launch in launches:
        variant = variants.setdefault(launch.key, Variant(launch))
        variant.uses.append(launch.labels)
        variant.decode = variant.decode or launch.labels["decode"]
    return variants


# --- compiling -------------------------------------------------------------------------------

_PENDING: list[Launch] = []  # read by forked workers


def _compile(index: int, arch: int) -> dict[str, Any]:
    launch = _PENDING[index]
    start = time.monotonic()
    try:
        src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
        usage = cubin_usage(kernel.asm["cubin"])
        return {"shared": int(kernel.metadata.shared), **usage,
                "loads": global_loads(kernel.asm["ptx"]),
                "compile_s": round(time.monotonic() - start, 2)}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported per variant, fails the check
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}


def _cache_path(key: str, arch: int) -> Path:
    root = os.environ.get("MOE_ENGINE_CACHE") or os.path.expanduser("~/.cache/moe-engine")
    return Path(root) / "gpu-compile" / f"triton{triton.__version__}-sm{arch}-{key}.json"


def compile_all(variants: dict[str, Variant], arch: int, jobs: int, use_cache: bool) -> float:
    """Fill each variant's ``result`` (cached or compiled); returns the compile wall time (s)."""
    todo = []
    for key, variant in variants.items():
        path = _cache_path(key, arch)
        if use_cache and path.exists():
            variant.result = json.loads(path.read_text())
        else:
            todo.append(key)
    print(f"{len(variants)} variants, {len(variants) - len(todo)} cached, compiling "
          f"{len(todo)} for sm_{arch} in {jobs} processes", file=sys.stderr)  # fmt: skip
    _PENDING[:] = [variants[k].launch for k in todo]
    start = time.monotonic()
    with multiprocessing.get_context("fork").Pool(max(1, jobs)) as pool:
        results = pool.imap(_compile_star, [(i, arch) for i in range(len(todo))])
        for done, (key, result) in enumerate(zip(todo, results, strict=True), 1):
            variants[key].result = result
            if "error" not in result:
                path = _cache_path(key, arch)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result))
            if done % 10 == 0 or done == len(todo):
                print(f"  compiled {done}/{len(todo)} ({time.monotonic() - start:.0f} s)",
                      file=sys.stderr)  # fmt: skip
    return time.monotonic() - start


def _compile_star(job: tuple[int, int]) -> dict[str, Any]:
    return _compile(*job)


# --- checking and reporting ----------------------------------------------------------------


def failures(variants: dict[str, Variant], shared_limit: int = SHARED_LIMIT) -> list[str]:
    """One message per variant over a limit (or failing to compile)."""
    out = []
    for v in variants.values():
        r, name = v.result or {}, v.launch.kernel
        head = f"{name} [{v.config()}] for {v.where()}"
        if "error" in r:
            out.append(f"{head}: compile failed: {r['error']}")
            continue
        if r["shared"] > shared_limit:
            out.append(f"{head}: {r['shared']:,} B shared memory > {shared_limit:,} B per block")
        if v.decode and (r["stack"] > 0 or r["spill_stores"] > 0):
            out.append(f"{head}: decode kernel spills: {r['regs']} registers, "
                       f"{r['stack']} B stack frame, {r['spill_stores']} spill stores")  # fmt: skip
    return out


def print_table(variants: dict[str, Variant]) -> None:
    rows = [("kernel", "config", "family dtype quant shape (+more uses)", "shared B", "regs",
             "spill", "global loads (bytes:count)")]  # fmt: skip
    for v in variants.values():
        r = v.result or {}
        if "error" in r:
            rows.append((v.launch.kernel, v.config(), v.where(), "ERROR", "", "", r["error"][:60]))
            continue
        spill = f"{r['stack']}B/{r['spill_stores']}st" if r["stack"] or r["spill_stores"] else "0"
        rows.append((v.launch.kernel, v.config(), v.where(), f"{r['shared']:,}",
                     str(r["regs"]), spill, format_loads(r["loads"])))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def summary(variants: dict[str, Variant], calls: int) -> dict[str, Any]:
    per_kernel: dict[str, dict[str, Any]] = {}
    for v in variants.values():
        r = v.result or {}
        k = per_kernel.setdefault(v.launch.kernel, {"variants": 0, "max_shared": 0, "max_regs": 0,
                                                    "spilling": 0, "errors": 0})  # fmt: skip
        k["variants"] += 1
        if "error" in r:
            k["errors"] += 1
            continue
        k["max_shared"] = max(k["max_shared"], r["shared"])
        k["max_regs"] = max(k["max_regs"], r["regs"])
        k["spilling"] += bool(r["stack"] or r["spill_stores"])
    return {"launcher_calls": calls, "variants": len(variants), "per_kernel": per_kernel}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    arch = ARCHS[args.arch]
    start = time.monotonic()
    variants = collect(args, GPUTarget("cuda", arch, 32))
    calls = sum(len(v.uses) for v in variants.values())
    if not variants:  # a mistyped --family / --quant matches nothing: not a pass
        print("gpu_compile.py: no launch matches the filters (--family, --op, --quant, --dtype, "
              "--tokens); nothing to check", file=sys.stderr)
        return 2
    record_s = time.monotonic() - start
    compile_s = compile_all(variants, arch, args.jobs, not args.no_cache)
    if not args.quiet:
        print_table(variants)
    info = summary(variants, calls)
    problems = failures(variants)
    total_s = time.monotonic() - start
    print(f"\n{args.arch}: {calls} launches -> {len(variants)} distinct variants; recorded in "
          f"{record_s:.1f} s, compiled in {compile_s:.1f} s ({args.jobs} processes), total "
          f"{total_s:.1f} s (Triton {triton.__version__})")  # fmt: skip
    for name, k in info["per_kernel"].items():
        print(
            f"  {name}: {k['variants']} variants, max shared {k['max_shared']:,} B, max "
            f"{k['max_regs']} registers, {k['spilling']} spilling, {k['errors']} errors"
        )
    if args.json:
        payload = {"arch": args.arch, "triton": triton.__version__, "shared_limit": SHARED_LIMIT,
                   "summary": info, "failures": problems, "seconds": round(total_s, 1),
                   "variants": [{"kernel": v.launch.kernel, "config": v.config(),
                                 "decode": v.decode, "uses": v.uses, **(v.result or {})}
                                for v in variants.values()]}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    for message in problems:
        print(f"FAIL: {message}")
    print(
        f"{'FAIL' if problems else 'OK'}: {len(problems)} problems in {len(variants)} variants "
        f"(limit {SHARED_LIMIT:,} B shared per block; no spills on the decode path)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
