"""vLLM's CPU settings side by side: which environment makes vLLM fastest on this machine.

Every variant is a `bench/vllm_runner.py` process (bench/vllm_peer.py's environment for its
`--vllm-config`, plus its own variables); all are loaded first, then they take turns on
mixed-64 in both modes exactly as in `bench/throughput.py` (bench/measure.py: settle wait,
idle CPU measured), median of `--runs` after `--warmup` rounds. Each runner holds about 3.5 GB
resident: six at once need about 20 GB.

    python bench/vllm_settings.py --dtype bfloat16 \
        --variant best-bt0=best --variant best-bt200=best:KMP_BLOCKTIME=200 \
        --variant 'aff=best:KMP_BLOCKTIME=1;KMP_AFFINITY=granularity=fine,compact,1,0' \
        --variant both-cores=both-cores --variant default=default

A variant is `LABEL=CONFIG[:NAME=VALUE[;NAME=VALUE...]]`, CONFIG one of vllm_peer.CONFIGS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_peer  # noqa: E402
from measure import measure_alternating  # noqa: E402
from peer_runner import PeerLaunch, PeerRunner  # noqa: E402
from workload import ensure_bench_checkpoint, mixed_workload, write_requests_file  # noqa: E402


def parse_variant(text: str) -> tuple[str, str, dict[str, str]]:
    """`"aff=best:A=1;B=x,y"` -> `("aff", "best", {"A": "1", "B": "x,y"})`.

    Raises:
        ValueError: no `LABEL=`, or an unknown config, or a setting without `=`.
    """
    label, sep, rest = text.partition("=")
    if not sep or not label:
        raise ValueError(f"--variant: expected LABEL=CONFIG[:NAME=VALUE;...], got {text!r}")
    config, _, settings = rest.partition(":")
    if config not in vllm_peer.CONFIGS:
        raise ValueError(f"--variant {label}: config {config!r} is not one of "
                         f"{vllm_peer.CONFIGS}")
    return label, config, vllm_peer.parse_env_pairs([s for s in settings.split(";") if s])


def main(argv: list[str] | None = None) -> int:
    from moe_engine.startup.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(vllm_peer.VLLM_DTYPES), default="bfloat16")
    p.add_argument("--variant", action="append", required=True, help="LABEL=CONFIG[:N=V;...]")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--vllm-venv", type=Path, default=vllm_peer.DEFAULT_VLLM_VENV)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    variants = [parse_variant(v) for v in args.variant]
    requests = mixed_workload(64)
    path = write_requests_file(requests)
    ckpt = ensure_bench_checkpoint(args.cache_dir)
    python = vllm_peer.ensure_vllm_venv(args.vllm_venv)
    load_start, rows = os.getloadavg(), {}
    try:
        for label, config, extra in variants:
            env, settings = vllm_peer.vllm_cpu_env(args.vllm_venv, config, extra)
            argv_ = [str(python), str(vllm_peer.BENCH_DIR / "vllm_runner.py"), "--model",
                     str(ckpt), "--requests", str(path), "--dtype", args.dtype]
            rows[label] = PeerRunner(PeerLaunch(label, argv_, env, args.dtype, settings),
                                     requests)
        out = measure_alternating(rows, ["batched", "batch1"], args.warmup, args.runs)
    finally:
        for row in rows.values():
            row.close()
        path.unlink(missing_ok=True)
    print(f"vLLM {args.dtype}, median of {args.runs} after {args.warmup} warm-up, alternating; "
          f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print("| variant | settings | batched tok/s (runs s) | batch1 tok/s (runs s) | idle CPU |")
    print("|---|---|---|---|---|")
    for (label, config, extra), res in zip(variants, out["results"].values(), strict=True):
        cells = [f"{r.get('output_tokens_per_s')} ({r.get('runs_s', r.get('error'))})"
                 for r in (res["batched"], res["batch1"])]
        print(f"| {label} | {config} {json.dumps(extra)} | {cells[0]} | {cells[1]} | "
              f"{out['idle'][label]['share']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
