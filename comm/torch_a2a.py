"""Expert-parallel dispatch and combine over `torch.distributed.all_to_all_single`.

Works on any torch backend with all-to-all: gloo (CPU tensors) and NCCL (CUDA tensors). The
layout follows DeepEP's normal mode (github.com/deepseek-ai/DeepEP, `Buffer.dispatch`): every
token goes at most once to each rank that holds one of its experts, the received rows are
ordered by source rank and then by source token index, and each carries its k local expert
ids (-1 for slots of other ranks) and weights; combine sends the weighted partial sums back
and adds them up on the source rank. Rows are packed as `comm.rows` describes.

Two layouts, chosen per dispatch from shapes only, the same on every rank (`choose_layout`):

- **variable splits**: the per-rank token counts go first (a device all-to-all), are read back
  to the host (one device-to-host copy of 2 x ep_size + 1 integers) and become the split sizes
  of the payload's all-to-all: the fewest bytes, but one host sync per dispatch. Combine
  reuses the split sizes (no sync).
- **fixed capacity** (`comm.fixed_a2a`): blocks of `capacity` rows to every rank, capacity =
  the step's largest token count over the ranks; no count is exchanged and nothing is read
  back, so a step of them can be captured in a CUDA graph; costs padding.

`begin_step(num_tokens)` (once per step, every rank) agrees on that largest count
(`comm.step_sync`); without it only the variable splits are possible. In "auto" mode the fixed
capacity is taken on devices where a host read stalls the launch queue (CUDA) and while a
dispatch buffer stays within `FIXED_CAPACITY_MAX_BYTES`; CPU (gloo) keeps the variable splits,
where reading counts costs nothing and padding costs copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.base import DispatchResult
from comm.fixed_a2a import FixedHandle, fixed_combine, fixed_dispatch
from comm.placement import ExpertPlacement
from comm.rows import pack_rows, row_layout, unpack_rows
from comm.stats import CommCounts, CommStats
from comm.step_sync import control_group_for, max_tokens_over_ranks

#: `TorchAllToAll(mode=...)` values.
LAYOUT_MODES = ("auto", "variable", "fixed")
#: "auto" takes the fixed capacity while one rank's dispatch payload (ep_size x capacity
#: packed rows) is at most this many bytes. 16 MiB keeps the padding's extra wire bytes per
#: layer small beside what it saves (a host round trip per dispatch): DeepSeek-V3 (H 7168) on
#: 8 ranks takes it up to 145 tokens per rank (its low-latency decode sizes; at 256 the padding
#: would add 27 MiB per layer), Qwen3-30B-A3B (H 2048) on 8 ranks up to 504 tokens per rank.
#: Measured bytes at these shapes: `bench/ep_layouts.py`, docs/expert_parallel.md.
FIXED_CAPACITY_MAX_BYTES = 16 << 20


def choose_layout(
    mode: str, capacity: int | None, world_size: int, row_bytes: int, device: torch.device
) -> str:
    """The layout of one dispatch, "fixed" or "variable": a function of shapes only, so every
    rank takes the same one.

    Args:
        mode: "auto", "variable" or "fixed" (the latter still needs a capacity).
        capacity: the step's largest token count over the ranks (`begin_step`), or None.
        world_size: ranks. row_bytes: bytes of one packed row (`comm.rows.row_layout`).
        device: where the activations live.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in LAYOUT_MODES:
        raise ValueError(f"all-to-all layout mode must be one of {LAYOUT_MODES}, got {mode!r}")
    if capacity is None or mode == "variable":
        return "variable"
    if mode == "fixed":
        return "fixed"
    fits = world_size * capacity * row_bytes <= FIXED_CAPACITY_MAX_BYTES
    return "fixed" if device.type == "cuda" and fits else "variable"


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
        mode: the layout, "auto" (see the module doc), "variable" or "fixed" (fixed whenever
            `begin_step` gave a capacity).
        control_group: a gloo group over the same ranks for `begin_step`'s agreement (None:
            `comm.step_sync.control_group_for`).

    Raises:
        ValueError: the placement's ep_size differs from the group size; an unknown mode.

    Every rank of the group must call begin_step, dispatch and combine the same number of
    times and in the same order, including ranks with no tokens (T = 0).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        placement: ExpertPlacement,
        *,
        mode: str = "auto",
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        choose_layout(mode, None, 1, 1, torch.device("cpu"))  # validates the mode
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if placement.ep_size != self.world_size:
            raise ValueError(
                f"placement ep_size {placement.ep_size} does not match the process group "
                f"size {self.world_size}"
            )
        self.placement = placement
        self.mode = mode
        self.control_group = control_group_for(group, control_group)
        self._gloo = dist.get_backend(group) == "gloo"  # CPU tensors: "auto" stays variable
        self.stats = CommStats()
        #: The largest token count over the ranks in this step (`begin_step`), or None.
        self.step_max_tokens: int | None = None
        #: The layout of the latest dispatch: "variable" or "fixed" (None before any).
        self.last_layout: str | None = None

    def begin_step(self, num_tokens: int | None) -> None:
        """Announce this rank's tokens in the coming step (T of each of its dispatches); the
        ranks agree on the largest, which sizes the fixed-capacity blocks. One host-side
        all-reduce per step (`comm.step_sync`), none where the fixed capacity cannot be chosen
        (mode "variable", or "auto" on a gloo group: CPU tensors). None forgets the step
        (variable splits only, no collective).

        Raises:
            ValueError: num_tokens is negative.
        """
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"begin_step: num_tokens must be >= 0, got {num_tokens}")
        may_fix = self.mode == "fixed" or (self.mode == "auto" and not self._gloo)
        if num_tokens is None or not may_fix:
            self.step_max_tokens = None
            return
        self.step_max_tokens = max_tokens_over_ranks(num_tokens, self.group, self.control_group)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from the next dispatch on (every rank, between the same two
        steps). Its replicas are chosen as `ExpertPlacement.route` does: deterministic and
        balanced.

        Raises:
            ValueError: another ep_size, num_experts or slots per rank than the serving one.
        """
        self.placement.check_swap(placement)
        self.placement = placement

    def profile_token_counts(self, max_tokens: int) -> set[int]:
        """None: below a step that takes the variable splits, a fixed-capacity step's buffers
        (at most `FIXED_CAPACITY_MAX_BYTES` per payload) are no larger than the variable
        splits' at the larger step, for which the profile run runs anyway."""
        return set()

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
            `A2AHandle` for `combine`. The fixed-capacity layout delivers the same rows with
            padding rows (ids all -1, weights 0) after each source rank's block: N = ep_size x
            capacity, and a `FixedHandle`.

        Raises:
            ValueError: more tokens than `begin_step` announced for the step.
        """
        num_tokens, top_k = topk_ids.shape
        capacity = self.step_max_tokens
        if capacity is not None and num_tokens > capacity:
            raise ValueError(
                f"begin_step agreed on at most {capacity} tokens per rank, this rank has "
                f"{num_tokens}"
            )
        dest_rank, local_slot = self.placement.route(topk_ids, self.rank)
        _, row_bytes = row_layout(top_k, hidden.shape[1] * hidden.element_size())
        layout = choose_layout(self.mode, capacity, self.world_size, row_bytes, hidden.device)
        self.last_layout = layout
        if layout == "fixed":
            assert capacity is not None  # choose_layout returns "fixed" only with one
            sent, device_part = fixed_dispatch(
                self.group,
                self.rank,
                self.world_size,
                capacity,
                hidden,
                dest_rank,
                local_slot,
                topk_weights,
            )
            host_part = CommCounts(
                dispatches=1,
                tokens_in=num_tokens,
                dispatch_bytes_sent=(self.world_size - 1) * capacity * row_bytes,
            )
            self.stats.record_dispatch(host_part, device_part)
            return sent
        in_rank = torch.zeros(num_tokens, self.world_size, dtype=torch.bool, device=hidden.device)
        in_rank.scatter_(1, dest_rank, True)
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        remote_pairs = (dest_rank != self.rank).sum().view(1)
        host = torch.cat([send_counts, recv_counts, remote_pairs]).tolist()
        send_splits = host[: self.world_size]
        recv_splits = host[self.world_size : 2 * self.world_size]
        # sized from the counts already on the host: no second sync (nonzero would wait)
        pairs = torch.nonzero_static(in_rank.t(), size=sum(send_splits))
        send_rank, send_token = pairs[:, 0], pairs[:, 1]

        match = dest_rank[send_token] == send_rank[:, None]
        ids = torch.where(match, local_slot[send_token], -1)
        weights = torch.where(match, topk_weights[send_token].float(), 0.0)
        payload = pack_rows(hidden[send_token], ids, weights)
        received = payload.new_empty(sum(recv_splits), payload.shape[1])
        dist.all_to_all_single(received, payload, recv_splits, send_splits, group=self.group)
        recv_hidden, recv_ids, recv_weights = unpack_rows(
            received, top_k, hidden.shape[1], hidden.dtype
        )

        self._record_dispatch(num_tokens, hidden, payload.shape[1], host)
        handle = A2AHandle(send_token, send_splits, recv_splits, num_tokens)
        return DispatchResult(recv_hidden, recv_ids, recv_weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: A2AHandle | FixedHandle) -> torch.Tensor:
        """Send the partial sums back and add them up per source token.

        Args:
            expert_out: [N, H] weighted partial sums of the rows `dispatch` returned, same
                order; any dtype (bf16 partial sums are added in float32, then rounded once).
            handle: the `A2AHandle` or `FixedHandle` of that dispatch.

        Returns:
            [T, H] in expert_out's dtype and the original token order; a token's partial sums
            are added in destination-rank order, so the result is deterministic.

        Raises:
            ValueError: expert_out does not have the N rows that dispatch delivered.
        """
        if isinstance(handle, FixedHandle):
            return self._combine_fixed(expert_out, handle)
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

    def _combine_fixed(self, expert_out: torch.Tensor, handle: FixedHandle) -> torch.Tensor:
        rows = self.world_size * handle.capacity
        if expert_out.dim() != 2 or expert_out.shape[0] != rows:
            raise ValueError(
                f"combine expects expert_out [{rows}, H] (the rows dispatch delivered), "
                f"got {tuple(expert_out.shape)}"
            )
        out = fixed_combine(self.group, expert_out, handle)
        row_bytes = expert_out.shape[1] * expert_out.element_size()
        self.stats.record_combine((self.world_size - 1) * handle.capacity * row_bytes)
        return out

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
