"""Bytes and buffers of the expert-parallel layouts at real model shapes (no GPU needed).

For each model, ep size and tokens per rank, routing is drawn the way the model routes
(Qwen3-30B-A3B: 8 of 128 experts uniformly; DeepSeek-V3: 4 of 8 groups, then 8 of the 256
experts in them), every rank with the same token count, experts placed contiguously
(`comm.ExpertPlacement`), and per rank (averaged over ranks and draws):

- `TorchAllToAll`'s two layouts (`comm.torch_a2a`): bytes sent to other ranks by one dispatch
  plus its combine (packed rows of `comm.rows`, partial sums back), and the bytes of their
  send/receive buffers plus the experts' pair buffers ([pairs, I] activations and [pairs, H]
  outputs, bf16: `kernels.moe.fused_moe`), for the variable splits and the fixed capacity;
- DeepEP's low-latency path (`comm.deepep_ll`, 128 tokens per rank buffer): the pairs handed to
  the experts before (every packed row with k id columns) and after (`max_pairs` rows of one
  id), and their buffers.

    python bench/ep_layouts.py [--draws 4] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from comm.deepep_ll import LOW_LATENCY_MAX_TOKENS, max_pairs
from comm.placement import ExpertPlacement
from comm.rows import row_layout

MIB = 1 << 20


@dataclass(frozen=True)
class Model:
    """The MoE shapes that set the bytes (bf16 activations)."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    groups: int = 1  # expert groups (DeepSeek-V3: 8) and how many a token picks
    top_groups: int = 1


QWEN3_30B = Model("Qwen3-30B-A3B", 128, 8, 2048, 768)
DEEPSEEK_V3 = Model("DeepSeek-V3", 256, 8, 7168, 2048, groups=8, top_groups=4)
CASES = [(QWEN3_30B, ep, t) for ep in (2, 4, 8) for t in (1, 64, 256)]
CASES += [(DEEPSEEK_V3, 8, t) for t in (1, 64, 128, 256)]


def route(model: Model, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] expert ids drawn as the model's router picks them (uniform scores)."""
    per_group = model.num_experts // model.groups
    groups = torch.rand(num_tokens, model.groups, generator=gen).topk(model.top_groups).indices
    scores = torch.rand(num_tokens, model.num_experts, generator=gen)
    allowed = torch.zeros(num_tokens, model.groups, dtype=torch.bool)
    allowed.scatter_(1, groups, True)
    scores[~allowed.repeat_interleave(per_group, 1)] = -1.0
    return scores.topk(model.top_k).indices.int()


def a2a_row(model: Model, ep: int, tokens: int, draws: int) -> dict:
    """Per-rank bytes of one dispatch + combine in both layouts, averaged."""
    placement = ExpertPlacement.contiguous(model.num_experts, ep)
    hidden_bytes = model.hidden * 2
    _, row_bytes = row_layout(model.top_k, hidden_bytes)
    pair_bytes = (model.intermediate + model.hidden) * 2
    gen = torch.Generator().manual_seed(0)
    sent = remote = 0.0
    for _ in range(draws):
        for rank in range(ep):
            dest, _ = placement.route(route(model, tokens, gen), rank)
            in_rank = torch.zeros(tokens, ep, dtype=torch.bool).scatter_(1, dest, True)
            sent += in_rank.sum().item() / (draws * ep)
            remote += (in_rank.sum() - in_rank[:, rank].sum()).item() / (draws * ep)
    received = sent  # every rank has the same token count: rows in = rows out on average
    fixed_rows = ep * tokens
    per_row = row_bytes + hidden_bytes  # payload row out + partial sums back
    return {
        "model": model.name, "ep": ep, "tokens_per_rank": tokens,
        "variable_wire_MiB": remote * per_row / MIB,
        "fixed_wire_MiB": (ep - 1) * tokens * per_row / MIB,
        "variable_buffers_MiB": ((sent + received) * per_row
                                 + received * model.top_k * pair_bytes) / MIB,
        "fixed_buffers_MiB": (2 * fixed_rows * per_row
                              + fixed_rows * model.top_k * pair_bytes) / MIB,
    }  # fmt: skip


def low_latency_row(model: Model, ep: int, tokens: int) -> dict:
    """Pairs and expert buffers of DeepEP's low-latency path, before and after compaction."""
    local = model.num_experts // ep
    packed_rows = local * LOW_LATENCY_MAX_TOKENS * ep
    before = packed_rows * model.top_k
    after = min(max_pairs(ep, tokens, model.top_k, local), packed_rows)
    pair_bytes = (model.intermediate + model.hidden) * 2
    return {
        "model": model.name, "ep": ep, "tokens_per_rank": tokens,
        "pairs_before": before, "pairs_after": after,
        "expert_buffers_before_MiB": before * pair_bytes / MIB,
        "expert_buffers_after_MiB": (after * pair_bytes + after * model.hidden * 2) / MIB,
        "deepep_recv_x_MiB": packed_rows * model.hidden * 2 / MIB,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4, help="routing draws per rank")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args()
    a2a = [a2a_row(m, ep, t, args.draws) for m, ep, t in CASES]
    ll = [low_latency_row(m, ep, t) for m, ep, t in CASES if t <= LOW_LATENCY_MAX_TOKENS]
    if args.json:
        print(json.dumps({"all_to_all": a2a, "low_latency": ll}, indent=1))
        return
    print("TorchAllToAll per rank, one dispatch + combine (MiB): wire and buffers")
    print(
        f"{'model':14} {'ep':>2} {'T':>4} | {'wire var':>9} {'fixed':>9} | "
        f"{'buf var':>9} {'fixed':>9}"
    )
    for r in a2a:
        print(
            f"{r['model']:14} {r['ep']:>2} {r['tokens_per_rank']:>4} | "
            f"{r['variable_wire_MiB']:9.3f} {r['fixed_wire_MiB']:9.3f} | "
            f"{r['variable_buffers_MiB']:9.2f} {r['fixed_buffers_MiB']:9.2f}"
        )
    print("\nDeepEP low-latency, pairs handed to the experts and their buffers (MiB)")
    print(
        f"{'model':14} {'ep':>2} {'T':>4} | {'pairs before':>12} {'after':>7} | "
        f"{'buf before':>10} {'after':>8} | {'recv_x':>7}"
    )
    for r in ll:
        print(
            f"{r['model']:14} {r['ep']:>2} {r['tokens_per_rank']:>4} | "
            f"{r['pairs_before']:>12} {r['pairs_after']:>7} | "
            f"{r['expert_buffers_before_MiB']:10.1f} {r['expert_buffers_after_MiB']:8.1f} | "
            f"{r['deepep_recv_x_MiB']:7.1f}"
        )


if __name__ == "__main__":
    main()
