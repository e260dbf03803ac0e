"""KV bytes per token and weight bytes of published MoE configs, by the startup plan's own
arithmetic (issue 14).

Each config.json under tests/data/configs (DeepSeek-V3, Kimi-K2-Instruct, GLM-4.5: their
published fields, nothing downloaded) is read by its architecture's file
(`moe_engine.models.model_shape`) and given to `plan.make_plan` exactly as `moe-serve` does at
startup: weights in `--dtype` (default bfloat16: FP8 checkpoints are served dequantized, or
with `--quantization int4|mxfp4` experts), one rank, blocks of 16 tokens. Printed per config:
the KV cache per token over all layers (MLA: the latent only), the weights split into routed
experts and the rest, and the plan's own `describe()` line for the KV cache. A config whose
architecture this checkout does not serve yet is listed with the reason.

    python bench/plan_configs.py                 # the table
    python bench/plan_configs.py --json          # one JSON object on stdout
    python bench/plan_configs.py --dtype float32 --configs path/to/config.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_engine.errors import StartupError  # noqa: E402
from moe_engine.models import model_shape  # noqa: E402
from moe_engine.startup.plan import GiB, make_plan  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "configs"


def plan_figures(path: Path, dtype: torch.dtype) -> dict:
    """The plan's figures for one config.json: {"config", "architecture", "layers",
    "kv_bytes_per_token", "kv_line", "weight_bytes_experts", "weight_bytes_other"} (bytes), or
    {"config", "unresolved": reason} when the engine cannot read it."""
    cfg = json.loads(path.read_text())
    try:
        shape = model_shape(cfg)
    except (StartupError, ValueError) as e:
        return {"config": path.name, "unresolved": str(e)}
    plan = make_plan(shape, dtype, block_size=16, max_model_len=4096, kv_cache_memory=GiB)
    kv_line = next(line for line in plan.describe().splitlines() if line.startswith("KV cache"))
    return {
        "config": path.name,
        "architecture": shape.architecture,
        "model_type": cfg.get("model_type"),
        "layers": shape.num_layers,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_line": kv_line,
        "weight_bytes_experts": plan.weight_bytes_experts,
        "weight_bytes_other": plan.weight_bytes_other,
    }


def print_table(rows: list[dict], dtype: str, command: str) -> None:
    print(f"$ {command}")
    print(f"| config | architecture (model_type) | KV B/token ({dtype}) | experts GiB | "
          f"other GiB | plan's KV line |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        if "unresolved" in r:
            continue
        print(f"| {r['config']} | {r['architecture']} ({r['model_type']}) | "
              f"{r['kv_bytes_per_token']:,} | {r['weight_bytes_experts'] / GiB:.1f} | "
              f"{r['weight_bytes_other'] / GiB:.1f} | {r['kv_line']} |")
    for r in rows:
        if "unresolved" in r:
            print(f"not resolved: {r['config']}: {r['unresolved']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", type=Path, nargs="+", default=sorted(CONFIGS.glob("*.json")))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [plan_figures(path, getattr(torch, args.dtype)) for path in args.configs]
    if args.json:
        print(json.dumps({"dtype": args.dtype, "configs": rows}))
    else:
        argv = sys.argv[1:] if argv is None else argv
        command = " ".join(["python bench/plan_configs.py", *map(shlex.quote, argv)])
        print_table(rows, args.dtype, command)


if __name__ == "__main__":
    main()
