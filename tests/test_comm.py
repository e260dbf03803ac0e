"""Expert-parallel communicators against a single-process reference.

Multi-rank cases run on gloo with 2 and 4 local processes: one `run_ranks` start per world size
executes every case in sequence (`run_all_cases`), each rank reporting the problems it found per
case, so one test per (case, world size) reads its verdict from a shared result. Each rank
builds every rank's inputs from one seed, so it knows the reference for its own tokens (the
plain-torch `fused_moe_reference` on the full batch with all experts) and the exact rows a
reference dispatch must deliver to it. Inputs are fresh per run; the seed is in every failure.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import RankFailure, case_results, run_ranks

from comm import (
    CommCounts,
    DeepEPCommunicator,
    ExpertPlacement,
    NoopCommunicator,
    TorchAllToAll,
    deepep_unavailable_reason,
    make_communicator,
)
from kernels.moe.reference import fused_moe_reference
from kernels.moe.torch_cpu import fused_moe_cpu

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 17, 12, 4  # odd H exercises row padding
WATCHDOG_S = 120.0


@dataclass
class Batch:
    """One rank's MoE input: hidden [T, H], topk_ids [T, k] int32, topk_weights [T, k] fp32."""

    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


Router = Callable[[int, int, torch.Generator], torch.Tensor]  # (T, src rank, gen) -> ids


def random_router(num_tokens: int, src: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, uniformly."""
    return torch.rand(num_tokens, NUM_EXPERTS, generator=gen).topk(TOP_K).indices.int()


def one_rank_router(placement: ExpertPlacement, pick_rank: Callable) -> Router:
    """All k experts of a token on one rank, `pick_rank(gen)`, drawn from its slots."""

    def route(num_tokens: int, src: int, gen: torch.Generator) -> torch.Tensor:
        rows = []
        for _ in range(num_tokens):
            local = torch.tensor(placement.local_experts(pick_rank(gen)))
            rows.append(local[torch.randperm(local.numel(), generator=gen)[:TOP_K]])
        return torch.stack(rows).int() if rows else torch.empty(0, TOP_K, dtype=torch.int32)

    return route


def hot_router(hot: int) -> Router:
    """Expert `hot` in every token, the other k - 1 experts random."""

    def route(num_tokens: int, src: int, gen: torch.Generator) -> torch.Tensor:
        scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
        scores[:, hot] = 2.0
        return scores.topk(TOP_K).indices.int()

    return route


def make_batches(
    seed: int,
    counts: list[int],
    router: Router,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = HIDDEN,
) -> list[Batch]:
    """Every rank's inputs, identical on all ranks for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for src, num_tokens in enumerate(counts):
        hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
        ids = router(num_tokens, src, gen)
        weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
        batches.append(Batch(hidden, ids, weights / weights.sum(-1, keepdim=True)))
    return batches


def make_experts(
    seed: int, dtype: torch.dtype, hidden_size: int = HIDDEN
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] of all experts."""
    gen = torch.Generator().manual_seed(seed + 7919)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, hidden_size, generator=gen) * 0.3
    w2 = torch.randn(NUM_EXPERTS, hidden_size, INTERMEDIATE, generator=gen) * 0.3
    return w13.to(dtype), w2.to(dtype)


def replica_placement(world_size: int) -> ExpertPlacement:
    """Contiguous plus one slot per rank: hot expert 0 copied on every rank, expert E-1 on
    rank 0; slot order reversed so local ids differ from global order."""
    per_rank = NUM_EXPERTS // world_size
    slots = []
    for rank in range(world_size):
        row = list(range(rank * per_rank, (rank + 1) * per_rank)) + [0 if rank else NUM_EXPERTS - 1]
        slots.append(row[::-1])
    return ExpertPlacement(NUM_EXPERTS, world_size, slots)


# ---------------------------------------------------------------- reference dispatch and checks


def expected_dispatch(
    batches: list[Batch], placement: ExpertPlacement, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `rank` must receive, built token by token: rows by source rank then token, each
    once, with local slot ids (-1 elsewhere) and weights (0 elsewhere)."""
    hidden, ids, weights = [], [], []
    for src, batch in enumerate(batches):
        dest, slot = placement.route(batch.topk_ids, src)
        for t in range(batch.hidden.shape[0]):
            here = dest[t] == rank
            if here.any():
                hidden.append(batch.hidden[t])
                ids.append(torch.where(here, slot[t], -1))
                weights.append(torch.where(here, batch.topk_weights[t], 0.0))
    if not hidden:
        dtype = batches[0].hidden.dtype
        return (
            torch.empty(0, HIDDEN, dtype=dtype),
            torch.empty(0, TOP_K, dtype=torch.int32),
            torch.empty(0, TOP_K),
        )
    return torch.stack(hidden), torch.stack(ids).int(), torch.stack(weights)


def reference_output(
    batches: list[Batch], rank: int, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`fused_moe_reference` on all ranks' tokens with all experts, rows of `rank`'s tokens."""
    full = fused_moe_reference(
        torch.cat([b.hidden for b in batches]),
        w13,
        w2,
        torch.cat([b.topk_weights for b in batches]),
        torch.cat([b.topk_ids for b in batches]),
    )
    start = sum(b.hidden.shape[0] for b in batches[:rank])
    return full[start : start + batches[rank].hidden.shape[0]]


def close(what: str, actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> list[str]:
    """[] when equal within tolerance (exact when no tolerance given), else one message."""
    try:
        torch.testing.assert_close(actual.cpu(), expected, **(tol or {"rtol": 0, "atol": 0}))
    except AssertionError as error:
        return [f"{what}: {error}"]
    return []


def expected_counts(
    batch: Batch, placement: ExpertPlacement, rank: int, received: int
) -> dict[str, int | list[int]]:
    """The counters one dispatch + combine of `batch` must leave in `stats.last`."""
    dest, _ = placement.route(batch.topk_ids, rank)
    per_rank = [int((dest == r).any(1).sum()) for r in range(placement.ep_size)]
    hidden_bytes = HIDDEN * batch.hidden.element_size()
    return {
        "dispatches": 1,
        "combines": 1,
        "tokens_in": batch.hidden.shape[0],
        "tokens_sent_per_rank": per_rank,
        "tokens_received": received,
        "remote_pairs": int((dest != rank).sum()),
        "min_dispatch_bytes": (sum(per_rank) - per_rank[rank]) * hidden_bytes,
        # rows received from other ranks go back as partial sums; our own rows stay here
        "combine_bytes_sent": (received - per_rank[rank]) * hidden_bytes,
    }


def check_counts(
    counts: CommCounts, expected: dict, rank: int, row_overhead: int = 12 * TOP_K + 15
) -> list[str]:
    """Compare the counters; dispatch bytes must be the floor plus at most `row_overhead`
    bytes (ids, weights, padding) per remote row."""
    problems = [
        f"stats.{key} = {getattr(counts, key)}, expected {value}"
        for key, value in expected.items()
        if getattr(counts, key) != value
    ]
    per_rank = expected["tokens_sent_per_rank"]
    low = expected["min_dispatch_bytes"]
    high = low + (sum(per_rank) - per_rank[rank]) * row_overhead
    if not low <= counts.dispatch_bytes_sent <= high:
        problems.append(f"dispatch_bytes_sent {counts.dispatch_bytes_sent} not in [{low}, {high}]")
    return problems


def round_trip(
    comm,
    placement: ExpertPlacement,
    rank: int,
    batches: list[Batch],
    experts: tuple[torch.Tensor, torch.Tensor],
    tol: dict,
    device: str = "cpu",
    exact_order: bool = True,
    check_stats: bool = True,
) -> list[str]:
    """dispatch -> local experts -> combine on `rank`; compare rows, output and counters."""
    w13, w2 = experts
    mine = batches[rank]
    sent = comm.dispatch(
        mine.hidden.to(device), mine.topk_ids.to(device), mine.topk_weights.to(device)
    )
    local = placement.local_experts(rank)
    expert_fn = fused_moe_cpu if device == "cpu" else fused_moe_reference
    out = expert_fn(
        sent.hidden, w13[local].to(device), w2[local].to(device), sent.topk_weights, sent.topk_ids
    )
    combined = comm.combine(out, sent.handle)

    exp_hidden, exp_ids, exp_weights = expected_dispatch(batches, placement, rank)
    problems = []
    if exact_order:
        problems += close("received hidden", sent.hidden, exp_hidden)
        problems += close("received topk_ids", sent.topk_ids, exp_ids)
        problems += close("received topk_weights", sent.topk_weights, exp_weights)
    problems += close("combined output", combined, reference_output(batches, rank, w13, w2), **tol)
    if combined.dtype != mine.hidden.dtype:
        problems.append(f"combined dtype {combined.dtype}, expected {mine.hidden.dtype}")
    if check_stats:
        expected = expected_counts(mine, placement, rank, exp_hidden.shape[0])
        problems += check_counts(comm.stats.last, expected, rank)
    return problems


# ---------------------------------------------------------------- the cases (run on every rank)

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}


def case_uneven_odd(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    batches = make_batches(seed, [7, 3, 9, 1][:world], random_router)
    comm = TorchAllToAll(None, placement)
    return round_trip(comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL)


def case_zero_tokens(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    batches = make_batches(seed, [5, 0, 3, 0][:world], random_router)
    comm = TorchAllToAll(None, placement)
    return round_trip(comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL)


def case_all_idle(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    batches = make_batches(seed, [0] * world, random_router)
    comm = TorchAllToAll(None, placement)
    return round_trip(comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL)


def case_all_to_one_rank(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    router = one_rank_router(placement, lambda gen: world - 1)
    batches = make_batches(seed, [4, 6, 3, 5][:world], router)
    comm = TorchAllToAll(None, placement)
    problems = round_trip(
        comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL
    )
    everyone = sum(b.hidden.shape[0] for b in batches)
    if comm.stats.last.tokens_received != (everyone if rank == world - 1 else 0):
        problems.append(f"rank {rank} received {comm.stats.last.tokens_received} tokens")
    return problems


def case_topk_on_one_rank(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    router = one_rank_router(placement, lambda gen: int(torch.randint(world, (1,), generator=gen)))
    batches = make_batches(seed, [6, 5, 7, 4][:world], router)
    comm = TorchAllToAll(None, placement)
    problems = round_trip(
        comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL
    )
    sent = sum(comm.stats.last.tokens_sent_per_rank)
    if sent != batches[rank].hidden.shape[0]:  # k experts on one rank: one row, not k
        problems.append(f"{sent} rows sent for {batches[rank].hidden.shape[0]} tokens")
    return problems


def case_replicas(rank: int, world: int, seed: int) -> list[str]:
    placement = replica_placement(world)
    batches = make_batches(seed, [9, 7, 8, 6][:world], hot_router(0))
    comm = TorchAllToAll(None, placement)
    problems = round_trip(
        comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL
    )
    per_replica = [0] * world  # pairs of hot expert 0 each copy receives, over all sources
    for src, batch in enumerate(batches):
        dest, _ = placement.route(batch.topk_ids, src)
        for r in dest[batch.topk_ids == 0].tolist():
            per_replica[r] += 1
    if max(per_replica) - min(per_replica) > world or min(per_replica) == 0:
        problems.append(f"hot expert pairs per replica rank {per_replica} are not shared")
    return problems


def case_bf16(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    batches = make_batches(seed, [6, 3, 5, 2][:world], random_router, torch.bfloat16)
    comm = TorchAllToAll(None, placement)
    return round_trip(comm, placement, rank, batches, make_experts(seed, torch.bfloat16), BF16_TOL)


def case_interleaved_handles(rank: int, world: int, seed: int) -> list[str]:
    """Two dispatches in flight (two layers' worth), combined in reverse order."""
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    first = make_batches(seed, [3, 4, 1, 2][:world], random_router)
    second = make_batches(seed + 1, [2, 5, 3, 0][:world], random_router)
    w13, w2 = make_experts(seed, torch.float32)
    local = placement.local_experts(rank)
    comm = TorchAllToAll(None, placement)
    sent = [
        comm.dispatch(b[rank].hidden, b[rank].topk_ids, b[rank].topk_weights)
        for b in (first, second)
    ]
    outs = [
        fused_moe_cpu(s.hidden, w13[local], w2[local], s.topk_weights, s.topk_ids) for s in sent
    ]
    combined = [comm.combine(outs[1], sent[1].handle), comm.combine(outs[0], sent[0].handle)]
    problems = close(
        "second output", combined[0], reference_output(second, rank, w13, w2), **FP32_TOL
    )
    problems += close(
        "first output", combined[1], reference_output(first, rank, w13, w2), **FP32_TOL
    )
    total = comm.stats.total
    received = sum(expected_dispatch(b, placement, rank)[0].shape[0] for b in (first, second))
    if (total.dispatches, total.combines, total.tokens_received) != (2, 2, received):
        problems.append(f"total counters {total.as_dict()} (received {received})")
    return problems


class FakeDeepEPBuffer:
    """A gloo stand-in for `deep_ep.Buffer` that keeps its documented normal-mode contract
    (contiguous experts, int64 topk_idx, bf16 rows, local recv ids with -1, combine adds),
    built on TorchAllToAll; weights of -1 slots are garbage, as DeepEP leaves them unset."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple:
        if topk_idx.dtype != torch.int64:
            raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
        world = dist.get_world_size()
        if num_experts % world:
            raise ValueError(f"{num_experts} experts on {world} ranks")
        dest = topk_idx // (num_experts // world)
        in_rank = torch.zeros(topk_idx.shape[0], world, dtype=torch.bool)
        in_rank.scatter_(1, dest, True)
        per_expert = torch.bincount(topk_idx.flatten(), minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x: torch.Tensor, **kw: torch.Tensor) -> tuple:
        if x.dtype != torch.bfloat16 or kw["topk_weights"].dtype != torch.float32:
            raise TypeError(f"x {x.dtype}, topk_weights {kw['topk_weights'].dtype}")
        layout = self.get_dispatch_layout(kw["topk_idx"], kw["num_tokens_per_expert"].numel())
        if not torch.equal(layout[3], kw["is_token_in_rank"]):
            raise ValueError("is_token_in_rank does not match topk_idx")
        placement = ExpertPlacement.contiguous(
            kw["num_tokens_per_expert"].numel(), dist.get_world_size()
        )
        inner = TorchAllToAll(None, placement)
        sent = inner.dispatch(x, kw["topk_idx"].int(), kw["topk_weights"])
        recv_idx = sent.topk_ids.long()
        recv_weights = sent.topk_weights.masked_fill(recv_idx < 0, 7.0)
        per_local = torch.bincount(recv_idx[recv_idx >= 0], minlength=placement.num_local_experts)
        return sent.hidden, recv_idx, recv_weights, per_local.tolist(), (inner, sent.handle), None

    def combine(self, x: torch.Tensor, handle: tuple) -> tuple:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"combine x must be bf16, got {x.dtype}")
        inner, inner_handle = handle
        return inner.combine(x, inner_handle), None, None

    # low-latency kernels: one row per (token, expert), packed per local expert; rows past
    # recv_count are NaN here (unset memory in DeepEP), so a consumer reading them shows

    cleaned = 0  # clean_low_latency_buffer calls
    ll_dispatches = 0  # low_latency_dispatch calls

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        self.cleaned += 1

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        max_tokens: int,
        num_experts: int,
        use_fp8: bool = True,
    ) -> tuple:
        if x.dtype != torch.bfloat16 or topk_idx.dtype != torch.int64 or use_fp8:
            raise TypeError(f"x {x.dtype}, topk_idx {topk_idx.dtype}, use_fp8 {use_fp8}")
        if x.shape[0] > max_tokens:
            raise ValueError(f"{x.shape[0]} tokens > num_max_dispatch_tokens_per_rank {max_tokens}")
        self.ll_dispatches += 1
        world = dist.get_world_size()
        local = num_experts // world
        # fixed capacity sized by the buffer's own bound (the same on every rank): like the
        # real kernels, nothing is read back to the host
        inner = TorchAllToAll(None, ExpertPlacement.contiguous(num_experts, world), mode="fixed")
        top_k = topk_idx.shape[1]
        inner.step_max_tokens = max_tokens * top_k
        pair_ids = topk_idx.reshape(-1, 1).int()
        sent = inner.dispatch(x.repeat_interleave(top_k, 0), pair_ids, torch.ones(pair_ids.shape))
        ids = sent.topk_ids[:, 0].long()
        valid = ids >= 0
        expert = torch.where(valid, ids, local)  # padding rows: a spare expert, dropped
        one_hot = expert[:, None] == torch.arange(local + 1)  # F.one_hot reads its max back
        position = (one_hot.cumsum(0) - 1).gather(1, expert[:, None])[:, 0]
        position = torch.where(valid, position, 0)
        packed = torch.full((local + 1, max_tokens * world, x.shape[1]), float("nan"))
        packed = packed.to(torch.bfloat16)
        packed[expert, position] = sent.hidden
        count = (
            torch.zeros(local + 1, dtype=torch.int64)
            .scatter_add_(0, expert, torch.ones_like(expert))[:local]
            .int()
        )
        return packed[:local], count, (inner, sent.handle, expert, position, top_k), None, None

    def low_latency_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple
    ) -> tuple:
        if x.dtype != torch.bfloat16 or topk_weights.dtype != torch.float32:
            raise TypeError(f"x {x.dtype}, topk_weights {topk_weights.dtype}")
        inner, inner_handle, expert, position, top_k = handle
        spare = torch.zeros(1, *x.shape[1:], dtype=x.dtype)
        rows = torch.cat([x, spare])[expert, position]  # only rows below recv_count are read
        back = inner.combine(rows, inner_handle).float()  # [T * k, H]
        weighted = back * topk_weights.reshape(-1, 1)
        return weighted.view(-1, top_k, x.shape[2]).sum(1).to(torch.bfloat16), None, None


def case_deepep_adapter_fake(rank: int, world: int, seed: int) -> list[str]:
    """The DeepEP adapter's own logic (physical ids for replicas, id/weight conversion, stats)
    on the fake buffer; the real kernels are covered by test_deepep_real (GPU only)."""
    placement = replica_placement(world)
    batches = make_batches(seed, [5, 8, 0, 3][:world], hot_router(0), torch.bfloat16)
    comm = DeepEPCommunicator(None, placement, buffer=FakeDeepEPBuffer(), mode="normal")
    experts = make_experts(seed, torch.bfloat16)
    return round_trip(comm, placement, rank, batches, experts, BF16_TOL)


def low_latency_problems(
    comm: DeepEPCommunicator, placement: ExpertPlacement, rank: int, batches: list[Batch]
) -> list[str]:
    """The latest dispatch's counters against the pairs `rank` must receive (one row per
    (token, local expert) pair, not per token)."""
    problems = []
    if comm.last_mode != "low_latency":
        problems.append(f"dispatch used the {comm.last_mode} kernels, expected low_latency")
    received = 0
    for src, batch in enumerate(batches):
        dest, _ = placement.route(batch.topk_ids, src)
        received += int((dest == rank).sum())
    dest, _ = placement.route(batches[rank].topk_ids, rank)
    per_rank = [int((dest == r).sum()) for r in range(placement.ep_size)]
    last = comm.stats.last
    if (last.tokens_received, last.tokens_sent_per_rank) != (received, per_rank):
        problems.append(
            f"received {last.tokens_received} rows / sent {last.tokens_sent_per_rank}, "
            f"expected {received} / {per_rank}"
        )
    return problems


def case_deepep_low_latency_fake(rank: int, world: int, seed: int) -> list[str]:
    """Low-latency kernels through the packed per-expert layout (NaN past the counts): the
    same outputs as the reference; replicas, a rank with no tokens."""
    placement = replica_placement(world)
    batches = make_batches(seed, [5, 8, 0, 3][:world], hot_router(0), torch.bfloat16)
    comm = DeepEPCommunicator(
        None, placement, buffer=FakeDeepEPBuffer(), mode="low_latency", low_latency_max_tokens=8
    )
    experts = make_experts(seed, torch.bfloat16)
    problems = round_trip(
        comm, placement, rank, batches, experts, BF16_TOL, exact_order=False, check_stats=False
    )
    return problems + low_latency_problems(comm, placement, rank, batches)


def case_deepep_auto_mode_fake(rank: int, world: int, seed: int) -> list[str]:
    """ "auto" takes the same kernel on every rank, from the largest rank's tokens: normal
    while one rank has more than the threshold, low-latency below it (cleaning the buffer
    after normal use), and `begin_step` overrides the all-reduce."""
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    buffer = FakeDeepEPBuffer()
    comm = DeepEPCommunicator(None, placement, buffer=buffer, low_latency_max_tokens=6)
    experts = make_experts(seed, torch.bfloat16)
    problems = []
    steps = [
        ([5, 8, 0, 3], None, "normal"),
        ([2, 1, 0, 6], None, "low_latency"),
        ([2, 1, 0, 3], 7, "normal"),
        ([2, 1, 0, 3], 3, "low_latency"),
    ]
    for i, (counts, announced, mode) in enumerate(steps):
        comm.begin_step(announced)
        batches = make_batches(seed + i, counts[:world], random_router, torch.bfloat16)
        ll = mode == "low_latency"
        problems += round_trip(
            comm,
            placement,
            rank,
            batches,
            experts,
            BF16_TOL,
            exact_order=not ll,
            check_stats=not ll,
        )
        if comm.last_mode != mode:
            problems.append(f"step {i} {counts[:world]}: {comm.last_mode}, expected {mode}")
    if buffer.cleaned != 2:
        problems.append(f"clean_low_latency_buffer called {buffer.cleaned} times, expected 2")
    return problems


def case_placement_swap(rank: int, world: int, seed: int) -> list[str]:
    """`set_placement` (runtime EPLB): after a swap, TorchAllToAll and the DeepEP adapter route
    by the new placement (replicas included); a placement of another shape is refused."""
    target = replica_placement(world)
    rotated = ExpertPlacement(
        NUM_EXPERTS, world, [target.slots[(r + 1) % world] for r in range(world)]
    )
    problems = []
    for name, comm, dtype, tol in (
        ("torch", TorchAllToAll(None, rotated), torch.float32, FP32_TOL),
        ("deepep", DeepEPCommunicator(None, rotated, buffer=FakeDeepEPBuffer(), mode="normal"),
         torch.bfloat16, BF16_TOL),
    ):
        experts = make_experts(seed, dtype)
        for i, placement in enumerate((rotated, target)):
            if i:
                comm.set_placement(placement)
            batches = make_batches(seed + i, [5, 8, 0, 3][:world], hot_router(0), dtype)
            problems += [f"{name} {i}: {p}" for p in
                         round_trip(comm, placement, rank, batches, experts, tol)]
        try:
            comm.set_placement(ExpertPlacement.contiguous(NUM_EXPERTS, world))
            problems.append(f"{name}: a placement with fewer slots per rank was taken")
        except ValueError as exc:
            if "num_local_experts" not in str(exc):
                problems.append(f"{name}: refusal does not name the field: {exc}")
        if comm.placement is not target:
            problems.append(f"{name}: the refused placement replaced the serving one")
    return problems


def case_factory_picks_torch_on_gloo(rank: int, world: int, seed: int) -> list[str]:
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, world)
    comm = make_communicator(None, placement, dtype=torch.bfloat16)
    if type(comm) is not TorchAllToAll:
        return [f"make_communicator chose {type(comm).__name__} on gloo"]
    batches = make_batches(seed, [2, 3, 1, 4][:world], random_router)
    return round_trip(comm, placement, rank, batches, make_experts(seed, torch.float32), FP32_TOL)


CASES: dict[str, Callable[[int, int, int], list[str]]] = {
    "uneven_odd": case_uneven_odd,
    "zero_tokens": case_zero_tokens,
    "all_idle": case_all_idle,
    "all_to_one_rank": case_all_to_one_rank,
    "topk_on_one_rank": case_topk_on_one_rank,
    "replicas": case_replicas,
    "bf16": case_bf16,
    "interleaved_handles": case_interleaved_handles,
    "deepep_adapter_fake": case_deepep_adapter_fake,
    "deepep_low_latency_fake": case_deepep_low_latency_fake,
    "deepep_auto_mode_fake": case_deepep_auto_mode_fake,
    "factory_picks_torch_on_gloo": case_factory_picks_torch_on_gloo,
    "placement_swap": case_placement_swap,
}


def run_all_cases(rank: int, world: int, seed: int) -> dict[str, list[str]]:
    """Every case in order on this rank: {case: problems found}."""
    return {name: case(rank, world, seed + i) for i, (name, case) in enumerate(CASES.items())}


# ---------------------------------------------------------------- multi-rank tests


@pytest.fixture(scope="module")
def ep_results() -> Callable[[int], dict[str, list[str]]]:
    """Results of all cases per world size, computed once (one process start per size)."""
    return case_results(run_all_cases, list(CASES), random.randrange(2**31), WATCHDOG_S)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_matches_reference(
    ep_results: Callable[[int], dict[str, list[str]]], case: str, world: int
) -> None:
    problems = ep_results(world)[case]
    assert not problems, "\n".join(problems)


def _barrier_or_fail(rank: int, world: int, how: str) -> None:
    if rank == 1:
        if how == "hang":
            time.sleep(600)
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()


@pytest.mark.slow
def test_watchdog_kills_a_hung_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"still running after the 4 s watchdog"):
        run_ranks(_barrier_or_fail, 2, args=("hang",), timeout_s=4, collective_timeout_s=300)
    assert time.monotonic() - start < 30


def test_rank_error_is_reported_and_peers_killed() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed.*broke on purpose"):
        run_ranks(_barrier_or_fail, 2, args=("raise",), timeout_s=60, collective_timeout_s=300)
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------- real DeepEP (GPU machines)


#: A hidden size DeepEP's low-latency kernels are built for (they support a fixed list).
LOW_LATENCY_HIDDEN = 2048


def run_deepep_cases(rank: int, world: int, seed: int) -> list[str]:
    """Normal kernels, then low-latency kernels, then "auto" switching between them."""
    torch.cuda.set_device(rank)
    placement = replica_placement(world)
    counts = [5, 8, 0, 3, 6, 1, 4, 2][:world]
    batches = make_batches(seed, counts, hot_router(0), torch.bfloat16)
    comm = DeepEPCommunicator(None, placement, mode="normal")
    experts = make_experts(seed, torch.bfloat16)
    problems = round_trip(
        comm, placement, rank, batches, experts, BF16_TOL, device="cuda", exact_order=False
    )
    batches = make_batches(seed, counts, hot_router(0), torch.bfloat16, LOW_LATENCY_HIDDEN)
    experts = make_experts(seed, torch.bfloat16, LOW_LATENCY_HIDDEN)
    comm = DeepEPCommunicator(None, placement, low_latency_max_tokens=8)
    for step, steps_batches in enumerate(
        [
            batches,
            batches,
            make_batches(
                seed + 1, [c * 4 for c in counts], hot_router(0), torch.bfloat16, LOW_LATENCY_HIDDEN
            ),
            batches,
        ]
    ):
        problems += [
            f"step {step}: {p}"
            for p in round_trip(
                comm,
                placement,
                rank,
                steps_batches,
                experts,
                BF16_TOL,
                device="cuda",
                exact_order=False,
                check_stats=False,
            )
        ]
    return problems


def _gpu_ranks_or_skip() -> int:
    reason = deepep_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    world = min(torch.cuda.device_count(), 8)
    if world < 2 or NUM_EXPERTS % world:
        pytest.skip(f"needs 2, 4 or 8 CUDA devices, found {torch.cuda.device_count()}")
    return world


@pytest.mark.gpu
def test_deepep_real() -> None:
    """Real DeepEP normal and low-latency kernels (and "auto" switching, which cleans the
    low-latency buffer after normal use) against the reference on 2+ GPUs."""
    world = _gpu_ranks_or_skip()
    seed = random.randrange(2**31)
    per_rank = run_ranks(run_deepep_cases, world, args=(seed,), timeout_s=300, backend="nccl")
    problems = [f"seed {seed} rank {r}: {p}" for r, res in enumerate(per_rank) for p in res]
    assert not problems, "\n".join(problems)


def run_nccl_cases(rank: int, world: int, seed: int) -> list[str]:
    """TorchAllToAll over NCCL with CUDA tensors: rows, ids, weights exact and counters."""
    torch.cuda.set_device(rank)
    problems = []
    for i, (name, dtype) in enumerate([("fp32", torch.float32), ("bf16", torch.bfloat16)]):
        placement = replica_placement(world)
        batches = make_batches(seed + i, [7, 0, 9, 1, 4, 3, 5, 2][:world], hot_router(0), dtype)
        comm = make_communicator(None, placement, backend="torch", device="cuda")
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        problems += [
            f"{name}: {p}"
            for p in round_trip(
                comm, placement, rank, batches, make_experts(seed, dtype), tol, device="cuda"
            )
        ]
    return problems + fixed_layout_without_syncs(rank, world, seed)


def fixed_layout_without_syncs(rank: int, world: int, seed: int) -> list[str]:
    """After begin_step, "auto" on CUDA takes the fixed capacity: its dispatch and combine run
    under torch's sync debug mode set to "error" (any host sync raises), and the output equals
    the reference."""
    placement = replica_placement(world)
    counts = [7, 0, 9, 1, 4, 3, 5, 2][:world]
    batches = make_batches(seed + 5, counts, hot_router(0), torch.bfloat16)
    w13, w2 = make_experts(seed, torch.bfloat16)
    local = placement.local_experts(rank)
    comm = make_communicator(None, placement, backend="torch", device="cuda")
    comm.begin_step(counts[rank])
    mine = batches[rank]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sent = comm.dispatch(mine.hidden.cuda(), mine.topk_ids.cuda(), mine.topk_weights.cuda())
        torch.cuda.set_sync_debug_mode(0)
        out = fused_moe_reference(
            sent.hidden, w13[local].cuda(), w2[local].cuda(), sent.topk_weights, sent.topk_ids
        )
        torch.cuda.set_sync_debug_mode("error")
        combined = comm.combine(out, sent.handle)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    problems = [] if comm.last_layout == "fixed" else [f"layout {comm.last_layout}"]
    reference = reference_output(batches, rank, w13, w2)
    return problems + close("fixed layout output", combined, reference, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL refuses two ranks on one GPU)",
)
def test_torch_all_to_all_on_nccl_real() -> None:
    world = min(torch.cuda.device_count(), 8)
    world = max(w for w in (2, 4, 8) if w <= world)
    seed = random.randrange(2**31)
    per_rank = run_ranks(run_nccl_cases, world, args=(seed,), timeout_s=300, backend="nccl")
    problems = [f"seed {seed} rank {r}: {p}" for r, res in enumerate(per_rank) for p in res]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- single-process tests


def test_contiguous_placement_maps_ids() -> None:
    placement = ExpertPlacement.contiguous(16, 4)
    ids = torch.randint(16, (9, 3), dtype=torch.int32)
    dest, slot = placement.route(ids, src_rank=2)
    assert torch.equal(dest, ids.long() // 4) and torch.equal(slot, ids % 4)
    assert slot.dtype == torch.int32 and placement.local_experts(3) == [12, 13, 14, 15]
    assert placement.is_contiguous and not placement.has_replicas


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((16, 3), "ep_size 3 does not divide num_experts 16"),
        ((8, 16), "ep_size 16 is larger than num_experts 8"),
        ((4, 2, [[0, 1], [2, 3, 3]]), r"uneven slot counts \[2, 3\]"),
        ((4, 2, [[0, 1], []]), "uneven slot counts"),
        ((4, 2, [[0, 1], [2, 9]]), r"rank 1: unknown expert 9 \(num_experts 4\)"),
        ((4, 2, [[0, 1], [1, 2]]), r"experts \[3\] are on no rank"),
        ((4, 2, [[0, 0], [2, 3]]), r"rank 0 holds experts \[0\] more than once"),
        ((4, 2, [[0, 1, 2, 3]]), "placement lists 1 ranks but ep_size is 2"),
        ((4, 0), "must both be at least 1"),
    ],
)
def test_placement_validation(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(*args)


def test_placement_check_names_both_numbers() -> None:
    placement = ExpertPlacement.contiguous(16, 4)
    placement.check(16, 4)
    with pytest.raises(ValueError, match="num_experts 16, the model 8"):
        placement.check(8, 4)
    with pytest.raises(ValueError, match="ep_size 4, but 2 ranks are running"):
        placement.check(16, 2)


def test_placement_json_round_trip(tmp_path: Path) -> None:
    placement = ExpertPlacement(6, 2, [[5, 0, 1, 2], [3, 4, 5, 0]])
    path = tmp_path / "placement.json"
    placement.save(path)
    assert json.loads(path.read_text()) == {
        "version": 1,
        "num_experts": 6,
        "ep_size": 2,
        "slots": [[5, 0, 1, 2], [3, 4, 5, 0]],
    }
    assert ExpertPlacement.load(path) == placement
    path.write_text(json.dumps({**placement.to_dict(), "version": 2}))
    with pytest.raises(ValueError, match=r"placement.json: unsupported version 2"):
        ExpertPlacement.load(path)
    path.write_text(json.dumps({"version": 1, "num_experts": 6, "ep_size": 2}))
    with pytest.raises(ValueError, match=r"missing key 'slots'"):
        ExpertPlacement.load(path)
    path.write_text(json.dumps({**placement.to_dict(), "slots": [[0, 1, 2], [3, 4, 6]]}))
    with pytest.raises(ValueError, match=rf"{os.sep}placement.json: .*unknown expert 6"):
        ExpertPlacement.load(path)


def test_replicas_share_tokens_round_robin() -> None:
    placement = ExpertPlacement(4, 3, [[0, 1], [0, 2], [0, 3]])  # expert 0 on all three ranks
    ids = torch.tensor([[0, 1]] * 7 + [[2, 3]] * 2, dtype=torch.int32)
    for src in range(3):
        dest, slot = placement.route(ids, src_rank=src)
        hot = dest[ids == 0].tolist()
        assert hot[0] == src  # the offset spreads the remainder over sources
        assert max(hot.count(r) for r in range(3)) - min(hot.count(r) for r in range(3)) <= 1
        assert torch.equal(slot[ids == 0], torch.zeros(7, dtype=torch.int32))
        assert dest[ids == 3].tolist() == [2, 2] and slot[ids == 3].tolist() == [1, 1]
        again = placement.route(ids, src_rank=src)
        assert torch.equal(again[0], dest) and torch.equal(again[1], slot)
    assert placement.replicas(0) == [(0, 0), (1, 0), (2, 0)] and placement.has_replicas


def test_counts_since_and_add() -> None:
    a = CommCounts(dispatches=1, tokens_sent_per_rank=[2, 3], dispatch_bytes_sent=10)
    total = a.copy()
    total.add(CommCounts(dispatches=2, tokens_sent_per_rank=[1, 1], dispatch_bytes_sent=5))
    assert total.tokens_sent_per_rank == [3, 4] and total.dispatches == 3
    delta = total.since(a)
    assert delta.tokens_sent_per_rank == [1, 1] and delta.dispatch_bytes_sent == 5
    assert a.tokens_sent_per_rank == [2, 3]  # copy() is independent


def test_make_communicator_choices() -> None:
    assert isinstance(make_communicator(None, ExpertPlacement.contiguous(8, 1)), NoopCommunicator)
    with pytest.raises(ValueError, match="unknown communicator backend 'nvshmem'"):
        make_communicator(None, ExpertPlacement.contiguous(8, 1), backend="nvshmem")
    with pytest.raises(ValueError, match="noop communicator needs ep_size 1"):
        make_communicator(None, ExpertPlacement.contiguous(8, 2), backend="noop")
    reason = deepep_unavailable_reason()
    if reason is not None:
        with pytest.raises(ValueError, match="'deepep' cannot run here"):
            make_communicator(None, ExpertPlacement.contiguous(8, 2), backend="deepep")
