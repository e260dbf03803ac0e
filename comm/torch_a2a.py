"""Expert-parallel dispatch and combine over `torch.distributed.all_to_all_single`.

Works on any torch backend with all-to-all: gloo (CPU tensors) and NCCL (CUDA tensors). The
layout follows DeepEP's normal mode (github.com/deepseek-ai/DeepEP, `Buffer.dispatch`): every
token goes at most once to each rank that holds one of its experts, the received rows are
ordered by source rank and then by source token index, and each carries its k local expert
ids (-1 for slots of other ranks) and weights; combine sends the weighted partial sums back
and adds them up on the source rank.

One dispatch is two collectives: the per-rank token counts, then one payload in which each
row packs [k int32 local ids | k float32 weights | hidden bytes | padding to 16 bytes]; so
ids and weights need no collective of their own, and the payload is plain bytes whatever the
hidden dtype (gloo has no all-to-all for some dtypes, e.g. int16). One combine is one
collective (the split sizes are known from dispatch).

Device tensors: every buffer is allocated on the input's device, and the counts exchange runs
on the device too; `all_to_all_single` takes its split sizes as host lists, so each dispatch
makes exactly one small device-to-host copy (2 x ep_size + 1 integers: the send and receive
counts and the remote-pair count for the stats), and combine none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.base import DispatchResult
from comm.placement import ExpertPlacement
from comm.stats import CommCounts, CommStats

#: Payload rows are padded to a multiple of this many bytes, so every field can be viewed in
#: its own dtype in place.
ROW_ALIGN_BYTES = 16


@dataclass(frozen=True)
class A2AHandle:
    """What `TorchAllToAll.combine` needs from its dispatch.

    Attributes:
        send_token: [S] int64, the source token of each row sent, grouped by destination rank.
        send_splits: rows sent to each rank (len N); recv_splits: rows received from each rank.
        num_tokens: T, the tokens handed to dispatch.
    """

    send_token: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class TorchAllToAll:
    """The `comm.base.Communicator` on `all_to_all_single` with split sizes.

    Args:
        group: the expert-parallel process group (None: the default group). Its timeout bounds
            every collective: a rank that stops answering raises instead of hanging.
        placement: where the experts live; `placement.ep_size` must equal the group size.

    Raises:
        ValueError: the placement's ep_size differs from the group size.

    Every rank of the group must call dispatch and combine the same number of times and in the
    same order, including ranks with no tokens (T = 0).
    """

    def __init__(self, group: dist.ProcessGroup | None, placement: ExpertPlacement) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if placement.ep_size != self.world_size:
            raise ValueError(
                f"placement ep_size {placement.ep_size} does not match the process group "
                f"size {self.world_size}"
            )
        self.placement = placement
        self.stats = CommStats()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Send each token to the ranks of its experts, once per rank.

        Args:
            hidden: [T, H] activations, any dtype (T may be 0).
            topk_ids: [T, k] int32 global expert ids in [0, num_experts).
            topk_weights: [T, k] float32 routing weights.

        Returns:
            DispatchResult with hidden [N, H] (hidden's dtype, received rows ordered by source
            rank then source token), topk_ids [N, k] int32 local slot ids of this rank (-1 for
            slots on other ranks), topk_weights [N, k] float32 (0 where the id is -1), and an
            `A2AHandle` for `combine`.
        """
        num_tokens, top_k = topk_ids.shape
        dest_rank, local_slot = self.placement.route(topk_ids, self.rank)
        in_rank = torch.zeros(num_tokens, self.world_size, dtype=torch.bool, device=hidden.device)
        in_rank.scatter_(1, dest_rank, True)
        send_rank, send_token = in_rank.t().nonzero(as_tuple=True)
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        remote_pairs = (dest_rank != self.rank).sum().view(1)
        host = torch.cat([send_counts, recv_counts, remote_pairs]).tolist()
        send_splits = host[: self.world_size]
        recv_splits = host[self.world_size : 2 * self.world_size]

        match = dest_rank[send_token] == send_rank[:, None]
        ids = torch.where(match, local_slot[send_token], -1)
        weights = torch.where(match, topk_weights[send_token].float(), 0.0)
        payload = _pack(hidden[send_token], ids, weights)
        received = payload.new_empty(sum(recv_splits), payload.shape[1])
        dist.all_to_all_single(received, payload, recv_splits, send_splits, group=self.group)
        recv_hidden, recv_ids, recv_weights = _unpack(
            received, top_k, hidden.shape[1], hidden.dtype
        )

        self._record_dispatch(num_tokens, hidden, payload.shape[1], host)
        handle = A2AHandle(send_token, send_splits, recv_splits, num_tokens)
        return DispatchResult(recv_hidden, recv_ids, recv_weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: A2AHandle) -> torch.Tensor:
        """Send the partial sums back and add them up per source token.

        Args:
            expert_out: [N, H] weighted partial sums of the rows `dispatch` returned, same
                order; any dtype (bf16 partial sums are added in float32, then rounded once).
            handle: the `A2AHandle` of that dispatch.

        Returns:
            [T, H] in expert_out's dtype and the original token order; a token's partial sums
            are added in destination-rank order, so the result is deterministic.

        Raises:
            ValueError: expert_out does not have the N rows that dispatch delivered.
        """
        rows = sum(handle.recv_splits)
        if expert_out.dim() != 2 or expert_out.shape[0] != rows:
            raise ValueError(
                f"combine expects expert_out [{rows}, H] (the rows dispatch delivered), "
                f"got {tuple(expert_out.shape)}"
            )
        dtype, hidden_size = expert_out.dtype, expert_out.shape[1]
        send = expert_out.contiguous().view(torch.uint8)
        back = send.new_empty(handle.send_token.numel(), send.shape[1])
        dist.all_to_all_single(back, send, handle.send_splits, handle.recv_splits, group=self.group)
        back = back.view(dtype)
        acc_dtype = torch.float32 if expert_out.element_size() < 4 else dtype
        out = torch.zeros(handle.num_tokens, hidden_size, dtype=acc_dtype, device=back.device)
        start = 0
        for count in handle.send_splits:  # tokens are unique within one rank's rows
            if count:
                rank_rows = slice(start, start + count)
                out.index_add_(0, handle.send_token[rank_rows], back[rank_rows].to(acc_dtype))
            start += count
        remote_rows = rows - handle.recv_splits[self.rank]
        self.stats.record_combine(remote_rows * send.shape[1])
        return out.to(dtype)

    def _record_dispatch(
        self, num_tokens: int, hidden: torch.Tensor, row_bytes: int, host: list[int]
    ) -> None:
        world, rank = self.world_size, self.rank
        send_splits, recv_splits = host[:world], host[world : 2 * world]
        remote_sent = sum(send_splits) - send_splits[rank]
        hidden_bytes = hidden.shape[1] * hidden.element_size()
        self.stats.record_dispatch(
            CommCounts(
                dispatches=1,
                tokens_in=num_tokens,
                tokens_sent_per_rank=send_splits,
                tokens_received=sum(recv_splits),
                remote_pairs=host[2 * world],
                dispatch_bytes_sent=remote_sent * row_bytes,
                min_dispatch_bytes=remote_sent * hidden_bytes,
            )
        )


def _row_layout(top_k: int, hidden_bytes: int) -> tuple[int, int]:
    """(offset of the hidden bytes, row bytes) of one packed dispatch row."""
    offset = 8 * top_k
    row_bytes = -(-(offset + hidden_bytes) // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    return offset, row_bytes


def _pack(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[S, H] rows + [S, k] ids + [S, k] float32 weights -> [S, row_bytes] uint8."""
    rows, top_k = ids.shape
    hidden_bytes = hidden.shape[1] * hidden.element_size()
    offset, row_bytes = _row_layout(top_k, hidden_bytes)
    payload = torch.empty(rows, row_bytes, dtype=torch.uint8, device=hidden.device)
    payload[:, : 4 * top_k].view(torch.int32).copy_(ids)
    payload[:, 4 * top_k : offset].view(torch.float32).copy_(weights)
    payload[:, offset : offset + hidden_bytes].view(hidden.dtype).copy_(hidden)
    payload[:, offset + hidden_bytes :].zero_()
    return payload


def _unpack(
    payload: torch.Tensor, top_k: int, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_pack`: contiguous hidden [N, H] dtype, ids [N, k] int32, weights fp32."""
    hidden_bytes = hidden_size * torch.empty(0, dtype=dtype).element_size()
    offset = 8 * top_k
    ids = payload[:, : 4 * top_k].view(torch.int32).contiguous()
    weights = payload[:, 4 * top_k : offset].view(torch.float32).contiguous()
    hidden = payload[:, offset : offset + hidden_bytes].view(dtype).contiguous()
    return hidden, ids, weights
