"""Bytes and time of one runtime-EPLB weight move (`moe_engine.eplb.ExpertMover`) on local gloo
ranks: every expert of every layer changes rank (rank r's experts go to rank r + 1), the worst
case of a rebalance, over `--ep` processes on this CPU; `--moves` alternates there and back
and reports the last move (the first pays gloo's connection set-up).

Per rank: experts moved, bytes sent and received, steps, the longest single step (the stall a
forward step would see beside it), the time of all steps, and the commit (in-place write plus
rebinding the layer's kernels). Layers are random, built as the engine shards them.

    python bench/eplb_move.py [--ep 2] [--layers 1] [--experts 8] [--hidden 32]
        [--intermediate 16] [--dtype float32|bfloat16] [--quantization none|int4|mxfp4]
        [--backend torch|native-cpu]
        [--max-bytes-per-step 67108864] [--moves 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comm import ExpertPlacement, TorchAllToAll
from kernels.plan import KernelPlan
from moe_engine.eplb import ExpertMover
from moe_engine.models.layers.moe import FusedMoE


def _layer(args: argparse.Namespace, local: list[int], comm: TorchAllToAll, rank: int,
           seed: int) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(args.experts, 2, args.hidden, args.intermediate, True,
                   getattr(torch, args.dtype), expert_bias=args.bias)
    moe.shard_experts(local, comm, rank)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    if args.quantization != "none":
        moe.quantize(args.quantization, 32)
    moe.bind_kernels(KernelPlan.uniform(args.backend, "cpu"))
    return moe


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.ep, timeout=timedelta(seconds=120))
    try:
        old = ExpertPlacement.contiguous(args.experts, args.ep)
        new = ExpertPlacement(args.experts, args.ep,
                              [old.slots[(r - 1) % args.ep] for r in range(args.ep)])
        comm = TorchAllToAll(None, old)
        moes = [_layer(args, old.local_experts(rank), comm, rank, 10 + i)
                for i in range(args.layers)]
        mover = ExpertMover(moes, comm, rank, None, KernelPlan.uniform(args.backend, "cpu"),
                            max_bytes_per_step=args.max_bytes_per_step)
        for i in range(args.moves):  # there and back; the last one is reported
            dist.barrier()
            mover.begin(*((old, new) if i % 2 == 0 else (new, old)))
            longest, done = 0.0, False
            while not done:
                start = time.perf_counter()
                done = mover.step()
                longest = max(longest, time.perf_counter() - start)
            stats = mover.commit()
        result = {**vars(stats), "longest_step_s": longest,
                  "expert_bytes": mover.layers[0].expert_bytes}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--bias", action="store_true", help="experts with biases")
    parser.add_argument("--quantization", choices=("none", "int4", "mxfp4"), default="none")
    parser.add_argument("--backend", choices=("torch", "native-cpu"), default="torch")
    parser.add_argument("--max-bytes-per-step", type=int, default=64 << 20)
    parser.add_argument("--moves", type=int, default=3,
                        help="moves there and back; the last (warm) one is reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_rank, args=(args, os.path.join(tmp, "store"), out), nprocs=args.ep)
        results = []
        for rank in range(args.ep):
            with open(f"{out}.{rank}") as f:
                results.append(json.load(f))
    if args.json:
        print(json.dumps({"args": vars(args), "ranks": results}))
        return
    print(f"{args.layers} layer(s) x {args.experts} experts, H {args.hidden}, I "
          f"{args.intermediate}, {args.dtype}, {args.quantization}, {args.backend}, "
          f"ep {args.ep}: "
          f"{results[0]['expert_bytes']} bytes per expert per layer")
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['experts_moved']} slots moved, sent {r['bytes_sent']} B, "
              f"received {r['bytes_received']} B, {r['steps']} steps, longest step "
              f"{r['longest_step_s'] * 1e3:.2f} ms, all steps {r['transfer_s'] * 1e3:.2f} ms, "
              f"commit {r['commit_s'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
