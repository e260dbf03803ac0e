"""Qwen3-Next's hybrid cache: the batch a memory budget holds, and decode cost against context.

Two parts (the issue's bench for `Qwen3NextForCausalLM`):

1. Arithmetic, no weights: the published Qwen3-Next-80B-A3B config.json (`QWEN3_NEXT_80B`
   below: 48 layers, every 4th gated full attention, the other 36 Gated DeltaNet; bfloat16)
   and the same config with every layer full attention, read by `moe_engine.models.model_shape`
   and planned by `moe_engine.startup.plan.make_plan` as `moe-serve --kv-cache-memory 4GiB
   --max-num-seqs B --max-model-len 4096` plans them (blocks of 16 tokens). Per model: KV
   bytes per token, the linear-attention state per request (conv state in bfloat16, recurrent
   state in float32, as `kv_cache.state.MambaSpec` stores it; and what it would be with a
   bfloat16 recurrent state), the bytes one request of 4096 tokens holds (its KV blocks and its
   state slot), and the largest decode batch B whose B requests of 4096 tokens all fit at once:
   the largest B for which the plan's `num_blocks` (what the budget leaves after the B + 1
   state slots, the null slot included) covers B x `blocks_per_request(4096)`, i.e. what the
   engine's scheduler runs together without preempting.

2. Measured decode step time: two small random checkpoints, made once under the cache
   directory (`bench-hybrid-qwen3-next-<dtype>`, `bench-hybrid-full-attn-<dtype>`): a
   Qwen3-Next-shaped model (`SMALL_CONFIG`: hidden 256, 8 layers [linear, linear, linear,
   full] x 2, gated attention with 4 q / 2 KV heads of 64, linear layers 4 key / 8 value heads
   of 32, 16 experts top-2 of width 128, a shared expert of 128, vocab 2048) and the same
   config with all 8 layers full attention. Each is served by the offline `moe_engine.LLM`
   (`max_model_len` = the longest context + output tokens, `max_num_batched_tokens` 2048, so a
   16k prompt is prefilled in chunks of 2048 queries; prefix caching off), whose `EngineCore`
   this script steps itself: per context L, `batch` requests of random L-token prompts and
   `--output-len` output tokens (greedy, ignore EOS); every step after the one in which the
   last request got its first token (all prefill done) is a decode step, timed alone (wall
   clock around `EngineCore.step()`). Figure: the median ms per decode step of a run, median
   over `--runs` runs, the rows taking turns run after run (after one untimed short warm-up
   request per model and batch). Forward hooks on the token mixers split each step's time
   into the Gated DeltaNet modules ("in linear layers") and the gated attention modules ("in
   attention layers", projections and norms included); the rest is MoE, norms, sampling and
   the engine's own work. The growth from the shortest to the longest context is the
   attention layers' cost of reading the longer KV cache; a linear layer's state is the same
   size at every context, so the hybrid's linear layers should not grow at all and the
   hybrid's step should grow about 2/8 = 1/4 as much as the full model's (2 of its 8 layers
   attend).

    python bench/hybrid_state.py                  # both parts (3-4 minutes on 2 cores)
    python bench/hybrid_state.py --json --json-out hybrid.json
    python bench/hybrid_state.py --batches 1,4 --runs 5
    python bench/hybrid_state.py --quick          # seconds: contexts 256,1024, 8 tokens, 1 run
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_engine  # noqa: E402, F401  (first: it sets OMP_WAIT_POLICY before torch loads)

# isort: split
import torch  # noqa: E402
from workload import (  # noqa: E402
    add_greedy_requests,
    apply_quick_defaults,
    ensure_random_checkpoint,
)

from moe_engine.models import model_shape  # noqa: E402
from moe_engine.startup.plan import format_bytes, make_plan  # noqa: E402

logger = logging.getLogger("bench.hybrid_state")

MiB = 1 << 20
BLOCK_SIZE = 16
FULL, LINEAR = "full_attention", "linear_attention"

#: Qwen/Qwen3-Next-80B-A3B-Instruct config.json, its published fields (nothing downloaded).
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

#: The measured models' config (transformers `Qwen3NextConfig` fields): Qwen3-Next's layout
#: (3 linear : 1 full) at a size that decodes a 16k context in milliseconds on 2 cores.
SMALL_CONFIG: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "layer_types": [LINEAR, LINEAR, LINEAR, FULL] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

#: Row names of the two models (both parts).
HYBRID, FULL_ATTN = "hybrid", "full-attention"


def all_full_attention(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with every layer full attention (the same-size comparison model)."""
    out = dict(cfg)
    out.pop("full_attention_interval", None)
    out["layer_types"] = [FULL] * int(cfg["num_hidden_layers"])
    return out


# -- part 1: arithmetic ---------------------------------------------------------------------


def state_bytes(shape, recurrent_itemsize: int, conv_itemsize: int) -> int:
    """One request's linear-attention state over all linear layers: per layer the conv state
    C x (W - 1) and the recurrent state Hv x Dk x Dv."""
    (c, w), (hv, dk, dv) = shape.linear_state_shapes()
    layers = len(shape.linear_attention_layers())
    return layers * (c * w * conv_itemsize + hv * dk * dv * recurrent_itemsize)


def fits(batch: int, *, state: int, kv_per_block: int, blocks: int, budget: int) -> bool:
    """Whether `batch` requests of `blocks` KV blocks each fit: the budget less the batch + 1
    state slots (null slot included; none without linear layers) buys at least batch x blocks
    blocks (`plan.make_plan` with --kv-cache-memory)."""
    slots = batch + 1 if state else 0
    return max(budget - slots * state, 0) // kv_per_block >= batch * blocks


def largest_batch(state: int, kv_per_block: int, blocks: int, budget: int) -> int:
    """The largest batch `fits` admits (0 when not even one request fits)."""
    b = 0
    while fits(b + 1, state=state, kv_per_block=kv_per_block, blocks=blocks, budget=budget):
        b += 1
    return b


def plan_largest_batch(shape, dtype: torch.dtype, context: int, budget: int,
                       block_size: int) -> tuple[int, Any]:
    """The largest max_num_seqs B whose plan (--kv-cache-memory budget, --max-model-len
    context) holds B requests of `context` tokens at once, and that plan."""
    def plan_of(b: int):
        return make_plan(shape, dtype, block_size=block_size, max_model_len=context,
                         kv_cache_memory=budget, max_num_seqs=b)

    b, best = 0, None
    while True:
        p = plan_of(b + 1)
        if p.num_blocks < (b + 1) * p.blocks_per_request(context):
            return b, best
        b, best = b + 1, p


def kv_manager_admits(plan, batch: int, context: int) -> bool:
    """Whether the engine's `KVCacheManager`, built as `EngineCore` builds it from `plan`
    (its KV groups, `num_blocks`, `num_state_slots` state slots), holds `batch` requests of
    `context` tokens at once (each taking its blocks and state slot)."""
    from moe_engine.kv_cache.manager import KVCacheManager
    from moe_engine.kv_cache.state import StateSlotPool
    from moe_engine.request import Request
    from moe_engine.sampling_params import SamplingParams

    kv = KVCacheManager(list(plan.kv_specs), plan.num_blocks, state_slots=StateSlotPool(
        plan.num_state_slots) if plan.num_state_slots else None)
    prompt = [3] * context
    return all(kv.allocate_slots(Request(f"r{i}", prompt, SamplingParams(max_tokens=1)), context)
               for i in range(batch))


def arithmetic_row(name: str, cfg: dict[str, Any], *, context: int, budget: int,
                   block_size: int) -> dict[str, Any]:
    """Part 1's figures for one config (bytes; batches in requests)."""
    shape = model_shape(cfg)
    dtype = getattr(torch, str(cfg.get("torch_dtype", "bfloat16")))
    batch, plan = plan_largest_batch(shape, dtype, context, budget, block_size)
    if plan is None:  # not even one request: the plan of batch 1, for the per-request figures
        plan = make_plan(shape, dtype, block_size=block_size, max_model_len=context,
                         kv_cache_memory=budget, max_num_seqs=1)
    blocks = plan.blocks_per_request(context)
    kv_request = blocks * plan.kv_bytes_per_block
    state = plan.state_bytes_per_request
    state_bf16 = state_bytes(shape, 2, dtype.itemsize)
    assert state == state_bytes(shape, 4, dtype.itemsize)  # the plan's is MambaSpec's
    batch_bf16 = largest_batch(state_bf16, plan.kv_bytes_per_block, blocks, budget)
    linear = len(shape.linear_attention_layers())
    over = make_plan(shape, dtype, block_size=block_size, max_model_len=context,
                     kv_cache_memory=budget, max_num_seqs=batch + 1)
    return {
        "model": name,
        "layers": shape.num_layers,
        "full_attention_layers": shape.num_layers - linear,
        "linear_attention_layers": linear,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_bytes_per_block": plan.kv_bytes_per_block,
        "blocks_per_request": blocks,
        "kv_bytes_per_request": kv_request,
        "state_bytes_per_request": state,
        "state_bytes_per_request_bf16": state_bf16,
        "bytes_per_request": kv_request + state,
        "bytes_per_request_bf16_state": kv_request + state_bf16,
        "max_batch": batch,
        "max_batch_bf16_state": batch_bf16,
        "num_blocks_at_max_batch": plan.num_blocks if batch else 0,
        "state_memory_at_max_batch": plan.state_memory if batch else 0,
        # the engine's own block and slot accounting, at max_batch and one more
        "kv_manager_admits_max_batch": kv_manager_admits(plan, batch, context) if batch
        else None,
        "kv_manager_admits_one_more": kv_manager_admits(over, batch + 1, context),
    }


def arithmetic(context: int, budget: int, block_size: int, budget_text: str = ""
               ) -> dict[str, Any]:
    """Part 1: the 80B hybrid against the same config all full attention."""
    rows = [arithmetic_row(n, c, context=context, budget=budget, block_size=block_size)
            for n, c in ((HYBRID, QWEN3_NEXT_80B), (FULL_ATTN, all_full_attention(QWEN3_NEXT_80B)))]
    hyb, full = rows
    return {
        "config": "Qwen3-Next-80B-A3B (published config.json, bfloat16)",
        "context": context, "budget_bytes": budget, "budget": budget_text or str(budget),
        "block_size": block_size,
        "rows": rows,
        "ratio": round(hyb["max_batch"] / full["max_batch"], 3) if full["max_batch"] else None,
        "ratio_bf16_state": (round(hyb["max_batch_bf16_state"] / full["max_batch_bf16_state"], 3)
                             if full["max_batch_bf16_state"] else None),
    }


# -- part 2: measured decode steps ----------------------------------------------------------


def make_checkpoints(cache_dir: Path, dtype_name: str) -> dict[str, Path]:
    dtype = getattr(torch, dtype_name)
    return {
        HYBRID: ensure_random_checkpoint(cache_dir, f"bench-hybrid-qwen3-next-{dtype_name}",
                                         "qwen3_next", SMALL_CONFIG, dtype),
        FULL_ATTN: ensure_random_checkpoint(cache_dir, f"bench-hybrid-full-attn-{dtype_name}",
                                            "qwen3_next", all_full_attention(SMALL_CONFIG),
                                            dtype),
    }


class MixerTimer:
    """Wall time spent in the token mixers of each kind, from forward hooks: the Gated
    DeltaNet modules ("linear") and the gated attention modules ("attention", their
    projections, norms and rope included), summed over the model's layers."""

    KINDS = ("linear", "attention")

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        from moe_engine.models.layers.gated_delta_net import GatedDeltaNet
        from moe_engine.models.qwen3_next import GatedAttention

        self.totals = dict.fromkeys(self.KINDS, 0.0)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._start = 0.0
        self.counts = dict.fromkeys(self.KINDS, 0)
        for module in model.modules():
            kind = ("linear" if isinstance(module, GatedDeltaNet)
                    else "attention" if isinstance(module, GatedAttention) else None)
            if kind is not None:
                self.counts[kind] += 1
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(lambda *_, k=kind: self._post(k))

    def _pre(self, *_: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, kind: str) -> None:
        self._sync()
        self.totals[kind] += time.perf_counter() - self._start

    def take(self) -> dict[str, float]:
        """Seconds per kind since the last take."""
        out, self.totals = self.totals, dict.fromkeys(self.KINDS, 0.0)
        return out


class Row:
    """One loaded model, stepped by `run_once`."""

    def __init__(self, name: str, llm: Any) -> None:
        self.name, self.llm, self.counter = name, llm, 0
        self.mixers = MixerTimer(llm.engine.model, llm.engine.device)


def run_once(row: Row, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """All `prompts` submitted at once, stepped until done; the decode steps' wall times.

    Raises:
        RuntimeError: a request produced other than `output_len` tokens, or no decode step
            ran after the prefills.
    """
    engine = row.llm.engine
    ids = add_greedy_requests(row, prompts, output_len)
    got: dict[str, int] = dict.fromkeys(ids, 0)
    decode_times: list[float] = []
    mixer_times: dict[str, list[float]] = {k: [] for k in MixerTimer.KINDS}
    prefilled = False
    t0 = time.perf_counter()
    prefill_s = 0.0
    while engine.has_unfinished_requests():
        row.mixers.take()
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        mixers = row.mixers.take()
        if prefilled:
            decode_times.append(dt)
            for k, v in mixers.items():
                mixer_times[k].append(v)
        for d in deltas:
            got[d.request_id] += len(d.new_token_ids)
        if not prefilled and all(got.values()):
            prefilled, prefill_s = True, time.perf_counter() - t0
    bad = {rid: n for rid, n in got.items() if n != output_len}
    if bad or not decode_times:
        raise RuntimeError(f"{row.name}: tokens per request {got} (expected {output_len}), "
                           f"{len(decode_times)} decode steps")
    return {"step_ms": [1e3 * t for t in decode_times], "prefill_s": prefill_s,
            **{f"{k}_ms": [1e3 * t for t in v] for k, v in mixer_times.items()}}


def random_prompts(n: int, length: int, vocab: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, vocab - 1) for _ in range(length)] for _ in range(n)]


def load_rows(ckpts: dict[str, Path], args: argparse.Namespace) -> dict[str, Row]:
    from moe_engine import LLM

    rows = {}
    for name, path in ckpts.items():
        llm = LLM(model=str(path), dtype=args.dtype,
                  max_model_len=max(args.context_list) + args.output_len,
                  max_num_seqs=max(args.batch_list),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kernel_backend=args.kernel_backend, enable_prefix_caching=False)
        rows[name] = Row(name, llm)
    return rows


def measure(rows: dict[str, Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rounds of every (model, context, batch), median ms per decode step per entry."""
    vocab = int(SMALL_CONFIG["vocab_size"])
    for row in rows.values():  # untimed: first calls, allocator, kernel set-up
        for b in args.batch_list:
            run_once(row, random_prompts(b, 64, vocab, "warmup"), 8)
    tasks = [(m, length, b) for length in args.context_list for b in args.batch_list
             for m in rows]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {t: [] for t in tasks}
    for rnd in range(args.runs):
        for m, length, b in tasks:
            prompts = random_prompts(b, length, vocab, f"{args.seed}-{length}-{b}")
            res = run_once(rows[m], prompts, args.output_len)
            runs[(m, length, b)].append(res)
            logger.info("run %d: %s context %d batch %d: %.2f ms/decode step (%d steps), "
                        "prefill %.2f s", rnd + 1, m, length, b,
                        statistics.median(res["step_ms"]), len(res["step_ms"]),
                        res["prefill_s"])
    out = []
    for m, length, b in tasks:
        rs = runs[(m, length, b)]
        per_run = [statistics.median(r["step_ms"]) for r in rs]
        mixers = {f"{k}_ms_per_step": round(statistics.median(
            statistics.median(r[f"{k}_ms"]) for r in rs), 3) if rows[m].mixers.counts[k]
            else None for k in MixerTimer.KINDS}
        out.append({
            "model": m, "context": length, "batch": b,
            "ms_per_step": round(statistics.median(per_run), 3),
            "runs_ms": [round(x, 3) for x in per_run],
            **mixers,
            "decode_steps": len(rs[-1]["step_ms"]),
            "prefill_s": round(statistics.median(r["prefill_s"] for r in rs), 3),
        })
    return out


def growth(rows: list[dict[str, Any]], contexts: list[int], batches: list[int]
           ) -> list[dict[str, Any]]:
    """Per batch: each model's ms/step at the longest context less at the shortest, and the
    hybrid's growth over the full model's."""
    lo, hi = min(contexts), max(contexts)
    by = {(r["model"], r["context"], r["batch"]): r for r in rows}

    def grew(m: str, b: int, key: str) -> float | None:
        a, z = by[(m, lo, b)].get(key), by[(m, hi, b)].get(key)
        return None if a is None or z is None else round(z - a, 3)

    out = []
    for b in batches:
        g = {m: grew(m, b, "ms_per_step") for m in (HYBRID, FULL_ATTN)}
        out.append({
            "batch": b, "from_context": lo, "to_context": hi,
            "hybrid_ms": g[HYBRID], "full_attention_ms": g[FULL_ATTN],
            "ratio": round(g[HYBRID] / g[FULL_ATTN], 3) if g[FULL_ATTN] > 0 else None,
            "hybrid_linear_ms": grew(HYBRID, b, "linear_ms_per_step"),
            "hybrid_attention_ms": grew(HYBRID, b, "attention_ms_per_step"),
            "full_attention_attention_ms": grew(FULL_ATTN, b, "attention_ms_per_step"),
        })
        e = out[-1]
        att_h, att_f = e["hybrid_attention_ms"], e["full_attention_attention_ms"]
        e["attention_ratio"] = (round(att_h / att_f, 3) if att_h is not None and att_f
                                else None)
    return out


def expected_growth_ratio(cfg: dict[str, Any]) -> float:
    """Attention layers of the hybrid / of the all-full model (what the growth ratio should
    be about, if only the attention layers' cost grows with context)."""
    types = cfg["layer_types"]
    return types.count(FULL) / len(types)


# -- report ---------------------------------------------------------------------------------


def _yes(flag: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[flag]


def _ms(x: float | None, sign: str = "") -> str:
    return "-" if x is None else f"{x:{sign}.2f}"


def _mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


def arithmetic_table(a: dict[str, Any]) -> str:
    ctx, budget = a["context"], format_bytes(a["budget_bytes"])
    head = ["model", "layers (full + linear)", "KV per token", f"KV per request of {ctx}",
            "state per request (fp32 recurrent)", "state per request (bf16 recurrent)",
            f"bytes per request at {ctx}", f"largest batch in {budget}",
            "same if the recurrent state were bf16"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in a["rows"]:
        lines.append("| " + " | ".join([
            r["model"],
            f"{r['layers']} ({r['full_attention_layers']} + {r['linear_attention_layers']})",
            f"{r['kv_bytes_per_token'] / 1024:.0f} KiB",
            _mib(r["kv_bytes_per_request"]),
            _mib(r["state_bytes_per_request"]) if r["state_bytes_per_request"] else "0",
            _mib(r["state_bytes_per_request_bf16"]) if r["state_bytes_per_request_bf16"] else "0",
            _mib(r["bytes_per_request"]),
            str(r["max_batch"]),
            str(r["max_batch_bf16_state"]),
        ]) + " |")
    ratio = f"{a['ratio']:.2f}x" if a["ratio"] else "-"
    ratio_bf16 = f"{a['ratio_bf16_state']:.2f}x" if a["ratio_bf16_state"] else "-"
    lines.append(f"| hybrid / full | | | | | | | **{ratio}** | {ratio_bf16} |")
    return "\n".join(lines)


def decode_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | context | batch | ms/decode step | runs (ms) | in linear layers | "
             "in attention layers | decode steps | prefill s |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | "
                     f"{r['ms_per_step']:.2f} | {' / '.join(f'{x:.2f}' for x in r['runs_ms'])} | "
                     f"{_ms(r['linear_ms_per_step'])} | {_ms(r['attention_ms_per_step'])} | "
                     f"{r['decode_steps']} | {r['prefill_s']:.2f} |")
    return "\n".join(lines)


def growth_table(g: list[dict[str, Any]], expected: float) -> str:
    lines = ["| batch | context | hybrid growth ms | full-attention growth ms | "
             f"hybrid / full (expected about {expected:.2f}) | hybrid's linear layers | "
             "hybrid's attention layers | full model's attention layers | "
             "attention layers hybrid / full |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in g:
        ratio = f"{e['ratio']:.2f}" if e["ratio"] is not None else "-"
        lines.append(f"| {e['batch']} | {e['from_context']} -> {e['to_context']} | "
                     f"{e['hybrid_ms']:+.2f} | {e['full_attention_ms']:+.2f} | {ratio} | "
                     f"{_ms(e['hybrid_linear_ms'], '+')} | {_ms(e['hybrid_attention_ms'], '+')} | "
                     f"{_ms(e['full_attention_attention_ms'], '+')} | "
                     f"{_ms(e.get('attention_ratio'))} |")
    return "\n".join(lines)


def print_report(res: dict[str, Any]) -> None:
    load = res["load_average"]
    print(f"command: {res['command']}")
    print(f"{res['date']}; {res['threads']} threads; load average "
          f"{' '.join(f'{x:.2f}' for x in load['start'])} at start, "
          f"{' '.join(f'{x:.2f}' for x in load['end'])} at end; {res['duration_s']:.0f} s")
    a = res["arithmetic"]
    print()
    print(f"## {a['config']} vs the same config all full attention: requests of "
          f"{a['context']} tokens in a {format_bytes(a['budget_bytes'])} KV + state budget "
          f"(blocks of {a['block_size']}; the plan of --kv-cache-memory {a['budget']} "
          f"--max-num-seqs B --max-model-len {a['context']})")
    print()
    print(arithmetic_table(a))
    print()
    for r in a["rows"]:
        if r["max_batch"]:
            slots = (f" + {_mib(r['state_memory_at_max_batch'])} of state slots "
                     f"({r['max_batch']} + the null slot)" if r["state_bytes_per_request"]
                     else "")
            print(f"  {r['model']}: at batch {r['max_batch']} the plan has "
                  f"{r['num_blocks_at_max_batch']} KV blocks of "
                  f"{r['kv_bytes_per_block'] / 1024:.0f} KiB "
                  f"({r['max_batch'] * r['blocks_per_request']} needed){slots}; its "
                  f"KVCacheManager holds {r['max_batch']} requests of {a['context']} tokens "
                  f"at once: {_yes(r['kv_manager_admits_max_batch'])}, "
                  f"{r['max_batch'] + 1} (at --max-num-seqs {r['max_batch'] + 1}): "
                  f"{_yes(r['kv_manager_admits_one_more'])}")
    d = res.get("decode")
    if d is None:
        return
    print()
    print(f"## decode step time against context ({d['dtype']}, median of {d['runs']} runs, "
          f"{d['output_len']} output tokens, prefill chunks of "
          f"{d['max_num_batched_tokens']} tokens)")
    print(f"models: {d['models'][HYBRID]['layout']} ({d['models'][HYBRID]['checkpoint']}); "
          f"{d['models'][FULL_ATTN]['layout']} ({d['models'][FULL_ATTN]['checkpoint']})")
    print()
    print(decode_table(d["rows"]))
    print()
    print(growth_table(d["growth"], d["expected_growth_ratio"]))
    print()
    print(f"  expected: only the attention layers read a context-long cache; the linear layers' "
          f"state is fixed, so the hybrid's growth should be about "
          f"{d['expected_growth_ratio']:.2f} of the full model's "
          f"({d['models'][HYBRID]['attention_layers']} of "
          f"{d['models'][HYBRID]['layers']} layers attend)")


# -- main -----------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    """`1,4` -> [1, 4] (empty entries dropped)."""
    return [int(s) for s in text.split(",") if s.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.startup.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,16384",
                   help="prompt lengths of the decode part (tokens; growth: longest - shortest)")
    p.add_argument("--batches", default="1,4", help="requests decoding together")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--runs", type=int, default=3, help="timed runs per entry (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the small checkpoints' weights and the engine's dtype")
    p.add_argument("--kernel-backend", default="auto", metavar="SPEC")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="prefill chunk (the step's token budget)")
    p.add_argument("--budget", default="4GiB", help="part 1's KV + state budget")
    p.add_argument("--arith-context", type=int, default=4096, help="part 1's request length")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where the bench-hybrid-* checkpoints are made once")
    p.add_argument("--skip-decode", action="store_true", help="part 1 only (no weights)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: contexts 256,1024, batch 1, 8 output tokens, "
                        "one run (each can still be given)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--json-out", type=Path, default=None, help="also write it to this file")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick_defaults(args, argv, {"--contexts": "256,1024", "--batches": "1",
                                          "--output-len": 8, "--runs": 1})
    from moe_engine.startup.config import parse_bytes

    try:
        args.context_list = sorted(set(parse_ints(args.contexts)))
        args.batch_list = sorted(set(parse_ints(args.batches)))
        args.budget_bytes = parse_bytes(args.budget)
    except ValueError as exc:
        p.error(str(exc))
    if len(args.context_list) < 2 or min(args.context_list) < 1:
        p.error("--contexts: give at least two lengths >= 1")
    if not args.batch_list or min(args.batch_list) < 1:
        p.error("--batches: give batch sizes >= 1")
    if args.runs < 1 or args.output_len < 2:
        p.error("--runs must be >= 1 and --output-len >= 2 (one decode step at least)")
    longest = max(args.context_list) + args.output_len
    if longest > SMALL_CONFIG["max_position_embeddings"]:
        p.error(f"--contexts: {longest} tokens exceed the models' max_position_embeddings "
                f"{SMALL_CONFIG['max_position_embeddings']}")
    return args


def layout(cfg: dict[str, Any]) -> str:
    types = cfg["layer_types"]
    n = types.count(FULL)
    return f"{len(types)} layers, {n} full attention + {len(types) - n} linear"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    started = time.perf_counter()
    load_start = os.getloadavg()
    res: dict[str, Any] = {
        "command": " ".join(["python", "bench/hybrid_state.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "arithmetic": arithmetic(args.arith_context, args.budget_bytes, BLOCK_SIZE, args.budget),
    }
    if not args.skip_decode:
        ckpts = make_checkpoints(args.cache_dir, args.dtype)
        rows = load_rows(ckpts, args)
        res["threads"] = torch.get_num_threads()  # as the engine set it
        table = measure(rows, args)
        cfgs = {HYBRID: SMALL_CONFIG, FULL_ATTN: all_full_attention(SMALL_CONFIG)}
        res["decode"] = {
            "dtype": args.dtype, "runs": args.runs, "output_len": args.output_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "contexts": args.context_list, "batches": args.batch_list,
            "models": {m: {"checkpoint": str(ckpts[m]), "layout": layout(cfgs[m]),
                           "layers": len(cfgs[m]["layer_types"]),
                           "attention_layers": cfgs[m]["layer_types"].count(FULL),
                           "compute_dtype": str(rows[m].llm.engine.dtype).removeprefix("torch.")}
                       for m in rows},
            "rows": table,
            "growth": growth(table, args.context_list, args.batch_list),
            "expected_growth_ratio": expected_growth_ratio(SMALL_CONFIG),
        }
    res["load_average"] = {"start": load_start, "end": os.getloadavg()}
    res["duration_s"] = round(time.perf_counter() - started, 1)
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
