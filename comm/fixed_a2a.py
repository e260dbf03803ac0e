"""Fixed-capacity dispatch and combine: one `all_to_all_single` with equal splits each way.

Every rank sends every rank a block of `capacity` packed rows (`comm.rows`), whatever the
routing: [N, capacity, row_bytes] out, [N, capacity, row_bytes] in, with `capacity` the largest
token count of any rank in this step (`TorchAllToAll.begin_step`), a bound because a token goes
at most once to each rank. A block's first rows are the tokens for that rank in token order,
the rest padding whose ids are all -1 (the experts skip them, as they skip other ranks' slots).
So no count crosses the group and nothing is read back to the host: every shape follows from
(N, capacity, k, H), the step can be captured in a CUDA graph, and the received rows are the
variable-split path's rows with padding between the source ranks' blocks. Combine sends the
[N * capacity, H] partial sums back the same way and adds them per source token in
destination-rank order, the variable-split path's order, so both give bit-identical outputs.

Cost against the variable splits (`bench/ep_layouts.py` measures it at real shapes; figures
in docs/expert_parallel.md): the wire carries (N - 1) x capacity rows per rank and direction
instead of the rows that have a token, and the received buffer has N x capacity rows instead
of the rows received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.base import DispatchResult
from comm.rows import pack_rows, unpack_rows
from comm.stats import device_counts


@dataclass(frozen=True)
class FixedHandle:
    """What `fixed_combine` needs from its dispatch.

    Attributes:
        in_rank: [T, N] bool, token t was sent to rank r.
        position: [T, N] int64, the row of token t in the block sent to rank r (valid where
            in_rank; clamped into [0, capacity) elsewhere).
        capacity: rows per block.
        num_tokens: T.
    """

    in_rank: torch.Tensor
    position: torch.Tensor
    capacity: int
    num_tokens: int


def fixed_dispatch(
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    capacity: int,
    hidden: torch.Tensor,
    dest_rank: torch.Tensor,
    local_slot: torch.Tensor,
    topk_weights: torch.Tensor,
) -> tuple[DispatchResult, torch.Tensor]:
    """Send each token once to each rank of its experts, in blocks of `capacity` rows.

    Args:
        group, rank, world_size: the expert-parallel group (N = world_size).
        capacity: rows per block, at least T on every rank (the step's largest T).
        hidden: [T, H] activations, any dtype. topk_weights: [T, k] float32.
        dest_rank: [T, k] int64 and local_slot: [T, k] int32 (`ExpertPlacement.route`).

    Returns:
        (DispatchResult with hidden [N * capacity, H], topk_ids [N * capacity, k] int32 (-1
        on padding and on slots of other ranks), topk_weights [N * capacity, k] float32 and a
        `FixedHandle`; the `comm.stats.device_counts` vector of this dispatch).
    """
    num_tokens, top_k = dest_rank.shape
    device = hidden.device
    in_rank = torch.zeros(num_tokens, world_size, dtype=torch.bool, device=device)
    in_rank.scatter_(1, dest_rank, True)
    position = (in_rank.cumsum(0) - 1).clamp(0, max(capacity - 1, 0))
    dump = world_size * capacity  # a row past the blocks for the (token, rank) pairs not sent
    ranks = torch.arange(world_size, device=device)
    target = torch.where(in_rank, ranks * capacity + position, dump)
    slot_token = torch.full((dump + 1,), num_tokens, dtype=torch.int64, device=device)
    tokens = torch.arange(num_tokens, device=device)[:, None].expand(-1, world_size)
    slot_token.scatter_(0, target.reshape(-1), tokens.reshape(-1))
    slot_token = slot_token[:dump]
    if num_tokens == 0:  # gather from one zero row that no rank claims
        hidden = hidden.new_zeros(1, hidden.shape[1])
        dest_rank = torch.full((1, top_k), -1, dtype=torch.int64, device=device)
        local_slot = torch.zeros(1, top_k, dtype=torch.int32, device=device)
        topk_weights = torch.zeros(1, top_k, dtype=torch.float32, device=device)
    source = slot_token.clamp(max=hidden.shape[0] - 1)
    block_rank = ranks[:, None].expand(-1, capacity).reshape(-1)
    match = (dest_rank[source] == block_rank[:, None]) & (slot_token < num_tokens)[:, None]
    ids = torch.where(match, local_slot[source], -1)
    weights = torch.where(match, topk_weights[source].float(), 0.0)
    payload = pack_rows(hidden[source], ids, weights)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    recv_hidden, recv_ids, recv_weights = unpack_rows(
        received, top_k, hidden.shape[1], hidden.dtype
    )
    sent = in_rank.sum(0)
    hidden_bytes = hidden.shape[1] * hidden.element_size()
    counts = device_counts(
        sent,
        tokens_received=(recv_ids >= 0).any(1).sum(),
        remote_pairs=(dest_rank[:num_tokens] != rank).sum(),
        min_dispatch_bytes=(sent.sum() - sent[rank]) * hidden_bytes,
    )
    handle = FixedHandle(in_rank, position, capacity, num_tokens)
    return DispatchResult(recv_hidden, recv_ids, recv_weights, handle), counts


def fixed_combine(
    group: dist.ProcessGroup | None, expert_out: torch.Tensor, handle: FixedHandle
) -> torch.Tensor:
    """Send the [N * capacity, H] partial sums back and add them per source token.

    Returns:
        [T, H] in expert_out's dtype (bf16/fp16 partial sums added in float32, rounded once),
        summed in destination-rank order.
    """
    dtype, hidden_size = expert_out.dtype, expert_out.shape[1]
    send = expert_out.contiguous().view(torch.uint8)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, send, group=group)
    back = back.view(dtype)
    acc_dtype = torch.float32 if expert_out.element_size() < 4 else dtype
    out = torch.zeros(handle.num_tokens, hidden_size, dtype=acc_dtype, device=back.device)
    if handle.num_tokens == 0:
        return out.to(dtype)
    capacity = handle.capacity
    for r in range(handle.in_rank.shape[1]):  # rank order: the variable-split path's sums
        rows = back[r * capacity : (r + 1) * capacity][handle.position[:, r]]
        out += torch.where(handle.in_rank[:, r, None], rows.to(acc_dtype), 0.0)
    return out.to(dtype)
