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

What the local experts see (`to_dispatch_result`): the packed layout flattened to
N = num_local_experts x max_tokens x num_ranks rows, each row with top_k columns of which only
the first is used: local expert e with weight 1.0 on the valid rows, -1 everywhere else (the
experts skip -1, as they already do for TorchAllToAll's slots of other ranks). So the expert
code is the same for both kernels, nothing is synchronised with the host to find the valid
rows (the layout is fixed-size, as CUDA graphs want), and the weights are applied exactly once,
by the combine kernel. Transport is bfloat16 (`use_fp8=False`), so results equal
TorchAllToAll's within bfloat16 rounding of the expert outputs.

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
        packed_shape: (num_local_experts, rows per expert, hidden) of the packed layout.
        remote_rows: rows received from other ranks (for the combine byte counter).
    """

    inner: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    packed_shape: tuple[int, int, int]
    remote_rows: int


def choose_mode(mode: str, max_tokens_per_rank: int, low_latency_max_tokens: int) -> str:
    """"normal" or "low_latency" for a step whose largest rank has `max_tokens_per_rank` tokens.

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


def to_dispatch_result(
    recv_x: torch.Tensor, recv_count: torch.Tensor, top_k: int, handle: LowLatencyHandle
) -> DispatchResult:
    """The packed per-expert layout as the `DispatchResult` the local experts take.

    Args:
        recv_x: [E_local, R, H] bfloat16, rows of expert e valid below recv_count[e].
        recv_count: [E_local] int32 valid rows per local expert.
        top_k: the k of the MoE layer (columns of topk_ids / topk_weights).
        handle: the `LowLatencyHandle` for combine.

    Returns:
        hidden [E_local * R, H] (a view of recv_x), topk_ids [E_local * R, k] int32 (column 0:
        the local expert on valid rows, -1 elsewhere), topk_weights [E_local * R, k] float32
        (1.0 on valid rows, 0 elsewhere: `low_latency_combine` applies the routing weights).
    """
    experts, rows, hidden_size = recv_x.shape
    device = recv_x.device
    valid = torch.arange(rows, device=device)[None, :] < recv_count.to(device)[:, None]
    expert = torch.arange(experts, dtype=torch.int32, device=device)[:, None].expand(-1, rows)
    ids = torch.full((experts * rows, top_k), -1, dtype=torch.int32, device=device)
    ids[:, 0] = torch.where(valid, expert, -1).reshape(-1)
    weights = torch.zeros(experts * rows, top_k, dtype=torch.float32, device=device)
    weights[:, 0] = valid.reshape(-1).float()
    return DispatchResult(recv_x.reshape(experts * rows, hidden_size), ids, weights, handle)


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
        group, num_nvl_bytes, max(num_rdma_bytes, ll_bytes),
        low_latency_mode=True, num_qps_per_rank=max(1, num_experts // world),
    )
