"""Offline throughput on the reference workload (../shared/BENCH.md): moe-engine vs transformers.

Checkpoint `bench-qwen3-moe` (random weights, real Qwen3-MoE architecture, 114.4 M parameters,
made once into the cache directory) and workload `mixed-64` (64 requests, prompts of 32-256
token ids, outputs of 16-256 tokens, greedy, ignore EOS, min_tokens = max_tokens). Both engines
run in this process, one after the other, each timed over the whole workload submitted at once:
output tokens / wall seconds, model load excluded, median of `--runs` runs after `--warmup`
warm-up runs.

Baseline: `transformers` `generate` with static batches of 8 requests in arrival order,
left-padded, each batch run to its longest output (only the requested output tokens count).

    python bench/throughput.py                       # full benchmark (several minutes)
    python bench/throughput.py --num-requests 8 --runs 1 --warmup 0   # smoke run
    python bench/throughput.py --json                # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("bench.throughput")

CHECKPOINT_NAME = "bench-qwen3-moe"
#: BENCH.md's checkpoint config, field for field.
BENCH_CONFIG = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: Totals of the full mixed-64 workload (BENCH.md), checked when all 64 requests run.
MIXED64_PROMPT_TOKENS = 9093
MIXED64_OUTPUT_TOKENS = 8906
ENGINE = "moe-engine"
BASELINE = "transformers-static-batching"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: prompt token ids and the exact number of output tokens."""

    prompt_token_ids: list[int]
    output_len: int


def mixed_workload(num_requests: int = 64) -> list[BenchRequest]:
    """The first `num_requests` requests of `mixed-64`, in arrival order (BENCH.md).

    Raises:
        ValueError: when num_requests is not in 1..64.
    """
    if not 1 <= num_requests <= 64:
        raise ValueError(f"num_requests must be in 1..64, got {num_requests}")
    rng = random.Random(0)
    requests = []
    for _ in range(64):
        prompt = [rng.randint(3, 8191) for _ in range(rng.randint(32, 256))]
        requests.append(BenchRequest(prompt, rng.randint(16, 256)))
    return requests[:num_requests]


def ensure_bench_checkpoint(cache_dir: Path) -> Path:
    """`cache_dir/bench-qwen3-moe`, created on first use (seed 0, bf16, 229 MB), atomically."""
    final = cache_dir / CHECKPOINT_NAME
    if (final / "config.json").is_file():
        return final
    from transformers import AutoConfig, AutoModelForCausalLM

    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("creating %s", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.tmp-", dir=cache_dir))
    try:
        cfg = AutoConfig.for_model("qwen3_moe", **BENCH_CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def run_moe_engine(ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace
                   ) -> Callable[[], int]:
    """Load the engine (untimed); return a function that runs the workload once and returns
    the number of output tokens it produced."""
    from moe_engine import LLM
    from moe_engine.request import SamplingParams

    llm = LLM(
        model=str(ckpt), dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                       ignore_eos=True)
        for r in requests
    ]

    def once() -> int:
        outputs = llm.generate(prompts, params)
        for out, req in zip(outputs, requests, strict=True):
            if len(out.token_ids) != req.output_len:
                raise RuntimeError(f"{ENGINE}: {len(out.token_ids)} tokens, "
                                   f"expected {req.output_len}")
        return sum(len(o.token_ids) for o in outputs)

    once.engine = llm  # type: ignore[attr-defined]  # keeps it alive while timed
    return once


def run_hf_static(ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace
                  ) -> Callable[[], int]:
    """Load transformers (untimed); return a function that runs the workload once with static
    batches of `args.batch_size`, left-padded, each batch to its longest output."""
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[args.baseline_dtype or args.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    pad = model.config.pad_token_id
    batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]

    def run_batch(batch: list[BenchRequest]) -> int:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
            min_new_tokens=longest, pad_token_id=pad,
        )
        if out.shape[1] - width != longest:
            raise RuntimeError(f"{BASELINE}: {out.shape[1] - width} tokens, expected {longest}")
        return sum(r.output_len for r in batch)  # only the tokens a request asked for count

    def once() -> int:
        with torch.inference_mode():
            return sum(run_batch(b) for b in batches)

    return once


def compute_dtype_of(name: str, once: Callable[[], int], args: argparse.Namespace) -> str:
    """The dtype an engine computed in: the engine's own choice (it computes bfloat16 weights in
    float32 on CPUs without native bfloat16), or the baseline's dtype."""
    if name == ENGINE:
        return str(once.engine.engine.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    return args.baseline_dtype or args.dtype


def measure(name: str, once: Callable[[], int], args: argparse.Namespace) -> dict:
    """Warm-up runs, then `args.runs` timed runs; the median's output tokens/s."""
    for i in range(args.warmup):
        t0 = time.perf_counter()
        once()
        logger.info("%s: warm-up %d took %.1f s", name, i + 1, time.perf_counter() - t0)
    rates, seconds = [], []
    for i in range(args.runs):
        t0 = time.perf_counter()
        tokens = once()
        dt = time.perf_counter() - t0
        rates.append(tokens / dt)
        seconds.append(round(dt, 3))
        logger.info("%s: run %d: %d tokens in %.2f s = %.1f tok/s", name, i + 1, tokens, dt,
                    tokens / dt)
    return {"output_tokens_per_s": round(statistics.median(rates), 2), "runs_s": seconds,
            "output_tokens": tokens}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before them")
    p.add_argument("--num-requests", type=int, default=64,
                   help="first N requests of mixed-64 (for a quick smoke run)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--engines", default=f"{ENGINE},{BASELINE}",
                   help="comma-separated subset of: " + f"{ENGINE},{BASELINE}")
    p.add_argument("--quantization", choices=["none", "int4", "mxfp4"], default="none",
                   help="4-bit routed experts for moe-engine (the baseline stays unquantized)")
    p.add_argument("--baseline-dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the transformers baseline (default: --dtype)")
    p.add_argument("--batch-size", type=int, default=8, help="baseline static batch size")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: derived)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where bench-qwen3-moe is made once (default: $MOE_ENGINE_CACHE or "
                        "~/.cache/moe-engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    requests = mixed_workload(args.num_requests)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    if args.num_requests == 64 and (prompt_tokens, output_tokens) != (
        MIXED64_PROMPT_TOKENS, MIXED64_OUTPUT_TOKENS
    ):
        raise RuntimeError(f"mixed-64 drifted: {prompt_tokens} prompt, {output_tokens} output")
    ckpt = ensure_bench_checkpoint(args.cache_dir)
    runners = {ENGINE: run_moe_engine, BASELINE: run_hf_static}
    engines: dict[str, dict] = {}
    for name in args.engines.split(","):
        if name not in runners:
            raise SystemExit(f"--engines: unknown engine {name!r}; choose from {sorted(runners)}")
        try:
            once = runners[name](ckpt, requests, args)
            engines[name] = measure(name, once, args)
            engines[name]["compute_dtype"] = compute_dtype_of(name, once, args)
        except Exception as exc:  # report the other engine's figure anyway
            logger.exception("%s failed", name)
            engines[name] = {"output_tokens_per_s": None, "error": f"{type(exc).__name__}: {exc}"}
        once = None
        gc.collect()
    mine = engines.get(ENGINE, {}).get("output_tokens_per_s")
    base = engines.get(BASELINE, {}).get("output_tokens_per_s")
    ratio = round(mine / base, 2) if mine and base else None
    result = {
        "workload": "mixed-64" if args.num_requests == 64 else f"mixed-64[:{args.num_requests}]",
        "checkpoint": str(ckpt), "dtype": args.dtype, "num_requests": len(requests),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "runs": args.runs, "warmup": args.warmup, "threads": torch.get_num_threads(),
        "engines": engines, "ratio": ratio,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"workload {result['workload']}: {len(requests)} requests, {prompt_tokens} prompt "
              f"tokens, {output_tokens} output tokens, {args.dtype}, "
              f"{torch.get_num_threads()} threads")
        for name, r in engines.items():
            rate = r["output_tokens_per_s"]
            shown = f"{rate:8.1f} output tok/s" if rate else f"failed: {r.get('error')}"
            print(f"  {name:32s} {shown}")
        print(f"  ratio {ENGINE} / {BASELINE}: {ratio if ratio else 'n/a'}")
    return 0 if all(r["output_tokens_per_s"] for r in engines.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
