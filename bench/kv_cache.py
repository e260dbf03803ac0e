"""KV-cache benchmark: hybrid sliding-window / full-attention groups and prefix caching.

Three figures (issue 5):

1. `kv_bytes`: a gpt-oss-shaped model (gpt-oss-20b's attention: 24 layers alternating sliding
   window 128 and full attention, 8 KV heads of 64 dims, bfloat16, blocks of 16 tokens). One
   request (prompt 4,000 tokens, then decode) is driven through the real `Scheduler` and
   `KVCacheManager` (no forward pass: the cache bookkeeping does not depend on the weights) to
   a 4,096-token context; the bytes it holds there (blocks held per group x bytes per block)
   against the same model with every layer given full attention. Target: at most 0.55x.
2. `max_batch`: a fixed KV budget (`--kv-budget`, default 4 GiB) for the same shape; 64
   requests of prompt 4,000 + 96 output tokens submitted at once, scheduler only; the largest
   decode batch at >= 4,000 tokens of context in one step (and preemptions), hybrid against
   full-attention only, with the pool's blocks / blocks one 4,096-token request holds.
3. `ttft`: the Qwen3-MoE bench checkpoint (bench/throughput.py, 114 M parameters) through
   `moe_engine.LLM`; `--ttft-requests` prompts of `--prompt-len` tokens whose first 90% are
   the same, submitted one after another; time from `add_request` to the first token, median
   over all but the first request (which fills the cache), with and without
   `enable_prefix_caching`. Target: at least 5x faster with it.

    python bench/kv_cache.py            # all three (a few minutes on 2 CPU cores)
    python bench/kv_cache.py --json     # one JSON object on stdout
    python bench/kv_cache.py --skip-ttft
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import ensure_bench_checkpoint  # noqa: E402

from kernels.env import cache_root  # noqa: E402
from moe_engine.kv_cache import FULL_ATTENTION, KVCacheManager, make_kv_cache_groups  # noqa: E402
from moe_engine.models import model_shape
from moe_engine.request import Request  # noqa: E402
from moe_engine.sampling_params import SamplingParams  # noqa: E402
from moe_engine.scheduler import Scheduler  # noqa: E402
from moe_engine.startup.config import SchedulerConfig  # noqa: E402

GiB = 1 << 30
#: gpt-oss-20b's config.json fields that shape the KV cache (the rest is irrelevant here).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
BLOCK_SIZE = 16
STEP_TOKENS = 2048  # max_num_batched_tokens: the longest prefill chunk


def make_scheduler(hybrid: bool, num_blocks: int, max_num_seqs: int = 256):
    """Scheduler + KVCacheManager for the gpt-oss-20b shape (`hybrid` False: every layer full
    attention, one group); returns (scheduler, manager, bytes per block)."""
    shape = model_shape(GPT_OSS_20B)
    groups = shape.attention_groups()
    if not hybrid:
        groups = [(FULL_ATTENTION, None, tuple(range(shape.num_layers)))]
    kv_groups = make_kv_cache_groups(
        groups, block_size=BLOCK_SIZE, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, dtype=torch.bfloat16,
    )
    kv = KVCacheManager([g.spec for g in kv_groups], num_blocks)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=STEP_TOKENS)
    return Scheduler(config, kv), kv, kv_groups[0].spec.bytes_per_block


def _request(rid: str, rng: random.Random, prompt_len: int, max_tokens: int) -> Request:
    ids = [rng.randrange(3, 200000) for _ in range(prompt_len)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: 11 for s in out.scheduled if s.samples})
    return out


def kv_bytes_at(context: int = 4096, prompt_len: int = 4000) -> dict:
    """Bytes one request holds at `context` tokens, hybrid vs full attention only."""
    result = {}
    for hybrid in (True, False):
        sched, kv, block_bytes = make_scheduler(hybrid, num_blocks=4096)
        req = _request("r", random.Random(0), prompt_len, context - prompt_len + 1)
        sched.add_request(req)
        held_at, peak = None, 0
        while sched.num_unfinished:
            out = sched.schedule()
            blocks = sum(kv.num_blocks_held("r", g) for g in range(len(kv.specs)))
            peak = max(peak, blocks)
            s = out.scheduled[0]
            if s.start + s.num_tokens == context:
                held_at = [kv.num_blocks_held("r", g) for g in range(len(kv.specs))]
            sched.update(out, {"r": 11} if s.samples else {})
        key = "hybrid" if hybrid else "full_only"
        result[key] = dict(
            blocks_per_group=held_at,
            bytes=sum(held_at) * block_bytes,
            peak_bytes_during_prefill=peak * block_bytes,
            bytes_per_block=block_bytes,
        )
    result["context_tokens"] = context
    result["ratio"] = result["hybrid"]["bytes"] / result["full_only"]["bytes"]
    return result


def max_batch(kv_budget: int, num_requests: int = 64, prompt_len: int = 4000,
              max_tokens: int = 96) -> dict:
    """Largest decode batch at long context under one KV budget, hybrid vs full only."""
    result = {}
    for hybrid in (True, False):
        _, _, block_bytes = make_scheduler(hybrid, 1)
        num_blocks = kv_budget // block_bytes
        sched, kv, _ = make_scheduler(hybrid, num_blocks)
        rng = random.Random(1)
        for i in range(num_requests):
            sched.add_request(_request(str(i), rng, prompt_len, max_tokens))
        best, steps = 0, 0
        while sched.num_unfinished:
            out = _step(sched)
            steps += 1
            long_decodes = sum(1 for s in out.scheduled if s.num_tokens == 1 and s.start >= 4000)
            best = max(best, long_decodes)
        per_request = kv.max_blocks_per_request(prompt_len + max_tokens, STEP_TOKENS)
        result["hybrid" if hybrid else "full_only"] = dict(
            num_blocks=num_blocks,
            largest_decode_batch=best,
            preemptions=sched.num_preemptions,
            steps=steps,
            blocks_per_request_at_4096=per_request,
            pool_over_request=num_blocks // per_request,
        )
    result["kv_budget_bytes"] = kv_budget
    result["ratio"] = result["hybrid"]["largest_decode_batch"] / max(
        result["full_only"]["largest_decode_batch"], 1
    )
    return result


def ttft(cache_dir: Path, num_requests: int, prompt_len: int, shared: float = 0.9) -> dict:
    """Median time to first token of prompts sharing `shared` of their tokens, with and
    without prefix caching (the first request of each run, which fills the cache, apart)."""
    from moe_engine import LLM

    ckpt = ensure_bench_checkpoint(cache_dir)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 8191) for _ in range(round(shared * prompt_len))]
    prompts = [
        prefix + [rng.randrange(3, 8191) for _ in range(prompt_len - len(prefix))]
        for _ in range(num_requests)
    ]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    result = {}
    for caching in (False, True):
        llm = LLM(
            model=str(ckpt), max_model_len=2 * prompt_len, enable_prefix_caching=caching,
            max_num_batched_tokens=max(2048, prompt_len),
        )
        # warm-up, shares nothing with the prompts
        llm.generate([[5, 6, 7, 8] * 8], params, use_tqdm=False)
        engine = llm.engine
        times = []
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            engine.add_request(f"t{i}", prompt, params)
            while not any(o.new_token_ids for o in engine.step()):
                pass
            times.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        stats = engine.get_stats()
        result["on" if caching else "off"] = dict(
            first_s=times[0],
            median_s=statistics.median(times[1:]),
            all_s=times,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )
        del llm, engine
    result.update(
        checkpoint=str(ckpt), prompt_len=prompt_len, shared_prefix_tokens=len(prefix),
        requests=num_requests, compute_dtype="float32 or bfloat16 (see bench/README.md)",
        speedup=result["off"]["median_s"] / result["on"]["median_s"],
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--kv-budget", type=int, default=4 * GiB, help="bytes (default 4 GiB)")
    p.add_argument("--skip-ttft", action="store_true", help="no model run (figures 1-2)")
    p.add_argument("--ttft-requests", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--cache-dir", type=Path, default=None, help="bench checkpoint directory")
    args = p.parse_args(argv)
    report = dict(kv_bytes=kv_bytes_at(), max_batch=max_batch(args.kv_budget))
    if not args.skip_ttft:
        report["ttft"] = ttft(args.cache_dir or cache_root(), args.ttft_requests, args.prompt_len)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    kb, mb = report["kv_bytes"], report["max_batch"]
    print(
        f"KV bytes at {kb['context_tokens']} tokens (gpt-oss-20b shape, bf16): hybrid "
        f"{kb['hybrid']['bytes'] / 2**20:.1f} MiB {kb['hybrid']['blocks_per_group']} blocks, "
        f"full only {kb['full_only']['bytes'] / 2**20:.1f} MiB: {kb['ratio']:.3f}x "
        f"(target <= 0.55)"
    )
    print(
        f"largest decode batch at >= 4000 tokens, {mb['kv_budget_bytes'] / GiB:.1f} GiB: hybrid "
        f"{mb['hybrid']['largest_decode_batch']} ({mb['hybrid']['preemptions']} preemptions), "
        f"full only {mb['full_only']['largest_decode_batch']} "
        f"({mb['full_only']['preemptions']} preemptions): {mb['ratio']:.2f}x"
    )
    if "ttft" in report:
        t = report["ttft"]
        print(
            f"TTFT, {t['requests']} prompts of {t['prompt_len']} tokens sharing "
            f"{t['shared_prefix_tokens']}: median {t['off']['median_s'] * 1e3:.1f} ms without "
            f"prefix caching, {t['on']['median_s'] * 1e3:.1f} ms with: {t['speedup']:.1f}x "
            f"(target >= 5)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
