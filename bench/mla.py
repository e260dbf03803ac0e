"""MLA decode: absorbed vs expanded, step time and KV bytes (issue 14).

A DeepSeek-V3-shaped stack of `MLAAttention` layers (DeepSeek-V3's per-head dims: kv_lora_rank
512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; fewer heads and layers and a
narrower residual so it runs in seconds on 2 cores: hidden 1024, 16 heads, q_lora_rank 512,
4 layers, residual connections only) decodes one token per request over a paged latent cache
filled with random latents at a context of 1k and 4k tokens, batch 1 and 8:

- absorbed: the engine's decode path (query absorbed into latent space through W_UK,
  attention over the 576-value latents, W_UV after; `MLAAttention(absorb=True)`);
- expanded: the same layer with `absorb=False`: every step expands the gathered latents
  through kv_b_proj into per-head keys and values (what prefill does), then attends.

Both read the same latent cache. The KV-bytes columns are per token over the stack's layers:
the latent (layers x (kv_lora_rank + qk_rope_head_dim) x itemsize) against what an expanded,
MHA-style cache would hold (layers x heads x (qk_head_dim + v_head_dim) x itemsize); the last
line gives both for the real DeepSeek-V3 (61 layers, 128 heads, bf16). Step time: median of
`--reps` timed steps after one warm-up, wall clock.

    python bench/mla.py                  # the table (about a minute on 2 cores)
    python bench/mla.py --json           # one JSON object on stdout
    python bench/mla.py --contexts 1024 --batches 1 --reps 3
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_engine.models.layers.attention import (  # noqa: E402
    AttentionMetadata,
    build_attention_batch,
)
from moe_engine.models.layers.mla import MLAAttention  # noqa: E402
from moe_engine.models.layers.rotary import RotaryEmbedding  # noqa: E402

BLOCK_SIZE = 16
#: DeepSeek-V3 (config.json): layers, heads, kv_lora_rank, qk_rope, qk_nope, v.
DEEPSEEK_V3 = dict(layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128)


def kv_bytes_per_token(layers, heads, kv_lora_rank, rope, nope, v, itemsize) -> tuple[int, int]:
    """(latent bytes, expanded-cache bytes) one token leaves over `layers` layers."""
    latent = layers * (kv_lora_rank + rope) * itemsize
    expanded = layers * heads * (nope + rope + v) * itemsize
    return latent, expanded


def build_stack(args, dtype: torch.dtype) -> list[MLAAttention]:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(args.rope, max(args.contexts) + 1, 10000.0, interleaved=True)
    layers = []
    for _ in range(args.layers):
        layer = MLAAttention(
            args.hidden, args.heads, q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.nope,
            qk_rope_head_dim=args.rope, v_head_dim=args.v, rotary=rotary, dtype=dtype,
        )
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
        layers.append(layer.eval())
    return layers


def decode_inputs(batch: int, context: int, args, dtype: torch.dtype):
    """Per layer a latent cache holding `context` random tokens for each of `batch` requests
    (contiguous block ranges after the null block), and one decode step's metadata."""
    blocks = math.ceil((context + 1) / BLOCK_SIZE)
    latent = args.kv_lora_rank + args.rope
    caches = [torch.randn(batch * blocks + 1, BLOCK_SIZE, latent).to(dtype) for _ in
              range(args.layers)]
    tables = 1 + torch.arange(batch * blocks).view(batch, blocks)
    starts = torch.full((batch,), context)
    positions = starts.clone()
    slots = tables[torch.arange(batch), positions // BLOCK_SIZE] * BLOCK_SIZE + (
        positions % BLOCK_SIZE
    )
    batches = [build_attention_batch(0, torch.ones(batch, dtype=torch.int64), starts, tables,
                                     BLOCK_SIZE)]
    meta = AttentionMetadata(slot_mapping=slots, batches=batches)
    h = torch.randn(batch, args.hidden).to(dtype)
    return h, positions, meta, caches


@torch.inference_mode()
def time_step(layers, h, positions, meta, caches, reps: int) -> tuple[float, torch.Tensor]:
    """Median wall seconds of one decode step through the stack, and its output."""
    def step():
        x = h
        for layer, cache in zip(layers, caches, strict=True):
            x = x + layer(x, positions, meta, cache)
        return x

    out = step()  # warm-up (also splits W_UK / W_UV once)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    layers = build_stack(args, dtype)
    item = dtype.itemsize
    latent_b, expanded_b = kv_bytes_per_token(
        args.layers, args.heads, args.kv_lora_rank, args.rope, args.nope, args.v, item
    )
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            inputs = decode_inputs(batch, context, args, dtype)
            result = {}
            for absorb in (True, False):
                for layer in layers:
                    layer.absorb = absorb
                result[absorb] = time_step(layers, *inputs, reps=args.reps)
            (t_abs, o_abs), (t_exp, o_exp) = result[True], result[False]
            rows.append(dict(
                context=context, batch=batch, absorbed_ms=t_abs * 1e3, expanded_ms=t_exp * 1e3,
                speedup=t_exp / t_abs,
                max_rel_diff=float((o_abs - o_exp).abs().max() / o_exp.abs().max()),
                latent_kv_bytes=latent_b * context * batch,
                expanded_kv_bytes=expanded_b * context * batch,
            ))
    v3_latent, v3_expanded = kv_bytes_per_token(**DEEPSEEK_V3, itemsize=2)
    return dict(
        shape=dict(hidden=args.hidden, heads=args.heads, layers=args.layers,
                   q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                   qk_rope_head_dim=args.rope, qk_nope_head_dim=args.nope, v_head_dim=args.v,
                   dtype=args.dtype, threads=torch.get_num_threads()),
        kv_bytes_per_token=dict(latent=latent_b, expanded=expanded_b),
        deepseek_v3_bf16_kv_bytes_per_token=dict(latent=v3_latent, expanded=v3_expanded),
        rows=rows,
    )


def print_table(res: dict, command: str) -> None:
    s, kv = res["shape"], res["kv_bytes_per_token"]
    print(f"$ {command}")
    print(f"MLA stack: hidden {s['hidden']}, {s['heads']} heads, {s['layers']} layers, "
          f"kv_lora_rank {s['kv_lora_rank']}, rope {s['qk_rope_head_dim']}, nope "
          f"{s['qk_nope_head_dim']}, v {s['v_head_dim']}, {s['dtype']}, {s['threads']} threads")
    print(f"KV bytes per token over the stack: latent {kv['latent']:,} B, expanded cache "
          f"{kv['expanded']:,} B ({kv['expanded'] / kv['latent']:.1f}x)")
    print("| context | batch | absorbed ms/step | expanded ms/step | expanded/absorbed | "
          "latent KV | expanded KV | max rel diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        print(f"| {r['context']} | {r['batch']} | {r['absorbed_ms']:.2f} | "
              f"{r['expanded_ms']:.1f} | {r['speedup']:.1f}x | "
              f"{r['latent_kv_bytes'] / 2**20:.1f} MiB | "
              f"{r['expanded_kv_bytes'] / 2**20:.1f} MiB | {r['max_rel_diff']:.1e} |")
    v3 = res["deepseek_v3_bf16_kv_bytes_per_token"]
    print(f"DeepSeek-V3 (61 layers, 128 heads, bf16) KV bytes per token: latent "
          f"{v3['latent']:,} B, expanded cache {v3['expanded']:,} B "
          f"({v3['expanded'] / v3['latent']:.1f}x)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--q-lora-rank", type=int, default=512)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res, "python bench/mla.py " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv))


if __name__ == "__main__":
    main()
