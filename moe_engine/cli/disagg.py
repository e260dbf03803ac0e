"""`moe-disagg plan`: what splitting prefill and decode costs on the wire for a model.

    moe-disagg plan --model CKPT_OR_CONFIG [--link-gbps 25,100,400] [--prompt-lens 128,1024]
                    [--dtype bfloat16] [--block-size 16] [--measure-prefill] [--json]

`--model` is a checkpoint folder or a config.json (published configs need no weights). For
each prompt length it prints the KV bytes a prefill instance sends (the blocks kept after the
prefill, per KV-cache group: `disagg.arithmetic`) and the time they take at each link rate;
`--measure-prefill` (a checkpoint with weights) also runs each prompt's prefill here (greedy,
max_tokens 1, median of 3 after a warm-up) and shows each transfer as a share of it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_engine.cli.serve import resolve_model
from moe_engine.disagg.arithmetic import (
    DEFAULT_LINKS_GBPS,
    DEFAULT_PROMPT_LENS,
    format_table,
    transfer_table,
)
from moe_engine.errors import StartupError
from moe_engine.startup.quant_config import DTYPES


def _numbers(kind: type, text: str) -> list:
    """Comma-separated positive finite numbers (argparse names the flag)."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}"
                                         ) from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be a finite number > 0, got "
                                         f"{text!r}")
    return values


def _block_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-disagg", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="KV bytes and link time per prompt length")
    plan.add_argument("--model", required=True,
                      help="checkpoint folder, config.json, or demo (the built-in demo)")
    plan.add_argument("--link-gbps", default=",".join(f"{g:g}" for g in DEFAULT_LINKS_GBPS),
                      type=lambda t: _numbers(float, t),
                      help="link rates in Gb/s (default: %(default)s)")
    plan.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)),
                      type=lambda t: _numbers(int, t),
                      help="prompt lengths in tokens (default: %(default)s)")
    plan.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                      help="KV cache dtype (default: %(default)s)")
    plan.add_argument("--block-size", type=_block_size, default=16,
                      help="tokens per KV block, a power of two (default: %(default)s)")
    plan.add_argument("--measure-prefill", action="store_true",
                      help="also time each prompt's prefill here (needs the weights)")
    plan.add_argument("--json", action="store_true", help="one JSON object instead")
    return p


def kv_specs_of(model: Path, dtype: torch.dtype, block_size: int) -> tuple[str, tuple, int]:
    """(architecture, KV-cache specs per group, max_position_embeddings) of a checkpoint
    folder or config.json, by the startup plan's own arithmetic.

    Raises:
        StartupError, ValueError: an architecture or config the engine cannot read.
        OSError: no config.json there.
    """
    from moe_engine.models import model_shape
    from moe_engine.startup.plan import GiB, make_plan

    path = model / "config.json" if model.is_dir() else model
    shape = model_shape(json.loads(path.read_text()))
    plan = make_plan(shape, dtype, block_size=block_size, max_model_len=4096,
                     kv_cache_memory=GiB)
    return shape.architecture, plan.kv_specs, shape.max_position_embeddings


def measure_prefill(model: Path, dtype: str, prompt_lens: list[int]) -> dict[int, float]:
    """Median seconds of a max_tokens=1 greedy request per prompt length (random ids), on
    this machine, after one warm-up each."""
    from moe_engine.offline.llm import LLM
    from moe_engine.sampling_params import SamplingParams

    llm = LLM(str(model), dtype=dtype, max_model_len=max(prompt_lens) + 1,
              max_num_batched_tokens=max(2048, max(prompt_lens)), max_num_seqs=1)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = {}
    for n in prompt_lens:
        prompt = torch.randint(3, llm.engine.vocab_size, (n,), generator=g).tolist()
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times[1:])
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dtype = DTYPES[args.dtype]
    try:
        model = Path(resolve_model(args.model)) if args.model == "demo" else Path(args.model)
        arch, specs, context = kv_specs_of(model, dtype, args.block_size)
        if args.measure_prefill and not model.is_dir():
            raise ValueError("--measure-prefill needs a checkpoint folder with weights, not "
                             "a config file")
    except (OSError, ValueError, StartupError) as exc:
        print(f"error: --model {args.model}: {exc}", file=sys.stderr)
        return 2
    lens = args.prompt_lens
    beyond = [n for n in lens if n >= context]
    if beyond:
        print(f"note: prompt lengths {beyond} reach the model's max_position_embeddings "
              f"{context}: {'left out' if args.measure_prefill else 'arithmetic only'}",
              file=sys.stderr)
        if args.measure_prefill:
            lens = [n for n in lens if n < context]
    prefill = None
    if args.measure_prefill and lens:
        try:
            prefill = measure_prefill(model, args.dtype, lens)
        except (StartupError, ValueError) as exc:
            print(f"error: --measure-prefill: {exc}", file=sys.stderr)
            return 1
    rows = transfer_table(specs, lens, args.link_gbps, prefill)
    per_token = sum(s.bytes_per_token for s in specs)
    if args.json:
        print(json.dumps({"model": str(model), "architecture": arch,
                          "kv_bytes_per_token": per_token, "dtype": args.dtype,
                          "rows": [{"prompt_len": r.prompt_len, "bytes": r.num_bytes,
                                    "link_s": {f"{g:g}": s for g, s in r.link_s.items()},
                                    "prefill_s": r.prefill_s} for r in rows]}))
        return 0
    print(f"{arch} ({model}), KV cache {args.dtype}: {per_token} bytes per prompt token "
          f"over all layers (full-attention groups; sliding windows send at most their "
          "window), line rate, no overlap with compute")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
