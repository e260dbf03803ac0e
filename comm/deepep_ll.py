"""DeepEP's low-latency (decode) kernels behind the `Communicator` contract, and the choice
between them and the normal (prefill) kernels.

DeepEP (github.com/deepseek-ai/DeepEP, README "Example use in inference decoding",
`deep_ep/buffer.py`): `Buffer.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
num_experts, use_fp8=...)` sends one row per (token, expert) pair and returns them packed per
local expert, `recv_x [num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`
with `recv_count [num_local_experts]` int32: the first recv_count[e] rows of expert e are valid,
the rest is unset memory. `Buffer.low_latency_combine(x, topk_idx, topk_weights, handle)` takes
the experts' outputs in that same layout and returns, per source token, the sum over its pairs
of weight x output (it applies the routing weights itself). Every rank must have at most
num_max_dispatch_tokens_per_rank tokens; the buffer is sized for that bound.

What the local experts see (`compact_pairs`, `to_dispatch_result`): the valid rows only,
compacted in expert order into a fixed number of rows P, each with ONE id column: local expert
e with weight 1.0, then padding rows with id -1. P bounds the pairs this rank can receive,
ep_size x (the step's largest token count) x min(top_k, local experts), so it is a function of
shapes (nothing is read back to find the valid rows, as CUDA graphs want) and the experts'
buffers (sorted pairs, [pairs, 2I] activations) hold P pairs, not the k x E_local x
max_tokens x ep_size pairs of the packed layout with k id columns per row. At DeepSeek-V3 EP8
(E_local 32, 128 tokens per rank, k 8) that is 8,192 pairs instead of 262,144; the figures for
the served models are in docs/expert_parallel.md. The experts' outputs are written back into
the packed receive buffer in place (`scatter_to_packed`; every row of the compacted layout has
its own packed row, padding included, so the write is a permutation) and that buffer goes to
`low_latency_combine`, which applies the routing weights: exactly once. Transport is bfloat16
(`use_fp8=False`), so results equal TorchAllToAll's within bfloat16 rounding of the expert
outputs.

Mode choice (`choose_mode`): normal kernels above LOW_LATENCY_MAX_TOKENS tokens per rank,
low-latency at or below it, decided from the largest token count over the ranks, which every
rank knows after a 1-element all-reduce (MAX) or from `DeepEPCommunicator.begin_step`, so every
rank takes the same branch: a rank that alone chose the other kernel would wait forever in a
collective nobody else joined.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comm.base import DispatchResult

#: Tokens per rank up to which a step counts as decode-sized and uses the low-latency kernels
#: (DeepEP's own decode example uses 128: the largest decode batch per rank it is sized for).
LOW_LATENCY_MAX_TOKENS = 128
#: `DeepEPCommunicator(mode=...)` values.
MODES = ("auto", "normal", "low_latency")


@dataclass(frozen=True)
class LowLatencyHandle:
    """What `low_latency_combine` needs from its dispatch.

    Attributes:
        inner: DeepEP's low-latency handle.
        topk_idx: [T, k] the physical expert ids sent (DeepEP's index dtype, -1 allowed).
        topk_weights: [T, k] float32 routing weights, applied by the combine kernel.
        packed: [E_local, R, H] bfloat16, the receive buffer `low_latency_dispatch` returned;
            combine writes the experts' outputs into it.
        packed_row: [P] int64, the packed row (flat index e x R + j) of each compacted row.
        remote_rows: 1-element int64 device tensor, rows received from other ranks (for the
            combine byte counter).
    """

    inner: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    packed: torch.Tensor
    packed_row: torch.Tensor
    remote_rows: torch.Tensor


def choose_mode(mode: str, max_tokens_per_rank: int, low_latency_max_tokens: int) -> str:
    """The kernel, "normal" or "low_latency", for a step whose largest rank has
    `max_tokens_per_rank` tokens.

    Args:
        mode: "auto" (by the threshold), "normal" or "low_latency" (forced).
        max_tokens_per_rank: the largest T over the ranks: the same number on every rank.
        low_latency_max_tokens: the threshold (tokens per rank), the low-latency buffer's size.

    Raises:
        ValueError: an unknown mode, or "low_latency" forced above the buffer's token bound.
    """
    if mode not in MODES:
        raise ValueError(f"DeepEP mode must be one of {MODES}, got {mode!r}")
    fits = max_tokens_per_rank <= low_latency_max_tokens
    if mode == "low_latency" and not fits:
        raise ValueError(
            f"DeepEP low-latency kernels take at most {low_latency_max_tokens} tokens per rank "
            f"(the buffer's num_max_dispatch_tokens_per_rank); a rank has {max_tokens_per_rank}"
        )
    if mode == "auto":
        return "low_latency" if fits else "normal"
    return mode


def max_tokens_over_ranks(num_tokens: int, group: Any, device: torch.device) -> int:
    """The largest `num_tokens` over the group's ranks: one 1-element all-reduce (MAX) on
    `device` and one host read of it (a device sync on CUDA)."""
    count = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def max_pairs(world_size: int, max_tokens_per_rank: int, top_k: int, local_experts: int) -> int:
    """P: the most (token, expert) pairs one rank can receive in a step, ep_size x the
    largest token count x min(top_k, local experts) (a token's k experts are distinct, so at
    most min(k, E_local) of its pairs land on one rank)."""
    return world_size * max_tokens_per_rank * min(top_k, local_experts)


def compact_pairs(recv_count: torch.Tensor, rows_per_expert: int, num_pairs: int) -> torch.Tensor:
    """The packed row of each of `num_pairs` compacted rows, without a host sync.

    Compacted row p < sum(recv_count) is valid row j of local expert e (experts in order, rows
    in order); the rows after it are assigned, in order, the packed rows that hold nothing
    (j >= recv_count[e]), so the map is one-to-one and a scatter through it is a permutation.

    Args:
        recv_count: [E_local] int32/int64, valid rows per local expert (each <= R).
        rows_per_expert: R, rows per expert in the packed layout.
        num_pairs: P <= E_local x R.

    Returns:
        [P] int64 flat packed rows e x R + j, on recv_count's device.
    """
    count = recv_count.long()
    device = count.device
    pairs = torch.arange(num_pairs, device=device)
    total = count.sum()
    last = count.numel() - 1
    valid_end = count.cumsum(0)
    expert = torch.searchsorted(valid_end, pairs, right=True).clamp(max=last)
    valid_row = pairs - (valid_end - count)[expert]
    empty = rows_per_expert - count
    empty_end = empty.cumsum(0)
    spare = (pairs - total).clamp(min=0)
    spare_expert = torch.searchsorted(empty_end, spare, right=True).clamp(max=last)
    spare_row = count[spare_expert] + spare - (empty_end - empty)[spare_expert]
    valid = pairs < total
    row_expert = torch.where(valid, expert, spare_expert)
    row = torch.where(valid, valid_row, spare_row)
    return row_expert * rows_per_expert + row


def to_dispatch_result(
    recv_x: torch.Tensor, recv_count: torch.Tensor, packed_row: torch.Tensor, handle: Any
) -> DispatchResult:
    """The compacted valid rows of the packed per-expert layout as a `DispatchResult`.

    Args:
        recv_x: [E_local, R, H] bfloat16, rows of expert e valid below recv_count[e].
        recv_count: [E_local] int32 valid rows per local expert.
        packed_row: [P] int64 from `compact_pairs`.
        handle: the `LowLatencyHandle` for combine.

    Returns:
        hidden [P, H] (a copy of the selected rows), topk_ids [P, 1] int32 (the local expert on
        the first sum(recv_count) rows, -1 after), topk_weights [P, 1] float32 (1.0 / 0.0:
        `low_latency_combine` applies the routing weights).
    """
    experts, rows, hidden_size = recv_x.shape
    expert = (packed_row // rows).to(torch.int32)
    valid = torch.arange(packed_row.numel(), device=packed_row.device) < recv_count.long().sum()
    ids = torch.where(valid, expert, -1)[:, None]
    weights = valid.float()[:, None]
    hidden = recv_x.reshape(experts * rows, hidden_size)[packed_row]
    return DispatchResult(hidden, ids, weights, handle)


def scatter_to_packed(expert_out: torch.Tensor, handle: LowLatencyHandle) -> torch.Tensor:
    """expert_out [P, H] written into the handle's packed buffer at `packed_row` (in place, a
    permutation) -> [E_local, R, H] bfloat16 for `low_latency_combine`.

    Raises:
        ValueError: expert_out does not have the P rows dispatch delivered.
    """
    rows = handle.packed_row.numel()
    if expert_out.dim() != 2 or expert_out.shape[0] != rows:
        raise ValueError(
            f"combine expects expert_out [{rows}, H] (the rows dispatch delivered), "
            f"got {tuple(expert_out.shape)}"
        )
    packed = handle.packed
    flat = packed.view(-1, packed.shape[-1])
    flat.index_copy_(0, handle.packed_row, expert_out.to(packed.dtype))
    return packed


def allocate_buffer(
    group: Any, hidden_size: int, num_experts: int, low_latency_max_tokens: int | None
) -> Any:
    """A `deep_ep.Buffer` sized as DeepEP's README does for `hidden_size` bf16 tokens: the
    normal kernels' NVLink/RDMA hints, and when `low_latency_max_tokens` is given also the
    low-latency RDMA hint (`get_low_latency_rdma_size_hint`), with `low_latency_mode=True` and
    one queue pair per local expert (one buffer serves both kernels, as SGLang's "auto")."""
    deep_ep = importlib.import_module("deep_ep")
    world = group.size()
    hidden_bytes = hidden_size * 2
    num_nvl_bytes, num_rdma_bytes = 0, 0
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    for config in configs:
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, world))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, world))
    if low_latency_max_tokens is None:
        return deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        low_latency_max_tokens, hidden_size, world, num_experts
    )
    return deep_ep.Buffer(
        group,
        num_nvl_bytes,
        max(num_rdma_bytes, ll_bytes),
        low_latency_mode=True,
        num_qps_per_rank=max(1, num_experts // world),
    )
