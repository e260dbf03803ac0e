"""The communicator on DeepEP's kernels, for CUDA machines: normal (high-throughput) kernels
for prefill-sized steps, low-latency kernels for decode-sized ones (`comm.deepep_ll`).

DeepEP (github.com/deepseek-ai/DeepEP, the V1 `deep_ep.Buffer` API, documented in its README /
docs/legacy.md and `deep_ep/buffer.py`): `get_dispatch_layout(topk_idx, num_experts)` counts the
tokens per rank and per expert, `dispatch(x, ...)` sends every token once to each rank holding
one of its experts and returns the received rows with `recv_topk_idx` already made local (ids
in [0, num_local_experts), -1 for experts of other ranks), and `combine(x, handle)` adds the
rows sent back ("reduce without weights"), which is our contract: expert_out rows are already
weighted partial sums.

DeepEP assumes the contiguous layout (expert e on rank e // num_local_experts). Other
placements, replicas included, are handed to it as "physical" expert ids
`rank * slots_per_rank + slot` after `ExpertPlacement.route` has chosen each pair's replica.
`deep_ep` is imported only when a buffer is built, never at module import.

Which kernel a dispatch uses is decided from a number every rank shares (`deepep_ll.
choose_mode`): the largest token count over the ranks. The engine calls `begin_step` once per
step (`ModelRunner`), which agrees on it with one host-side all-reduce on a gloo group
(`comm.step_sync`); only without it does each dispatch all-reduce on the device and read the
result back. The counters stay on the device (`comm.stats.device_counts`): in steady state a
low-latency dispatch and combine make no host sync. (DeepEP's normal kernels wait on the host
for the received count inside `Buffer.dispatch` themselves.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comm import deepep_ll
from comm.base import DispatchResult
from comm.deepep_ll import LOW_LATENCY_MAX_TOKENS, LowLatencyHandle
from comm.placement import ExpertPlacement
from comm.stats import CommCounts, CommStats, device_counts
from comm.step_sync import control_group_for, max_tokens_over_ranks


def deepep_unavailable_reason() -> str | None:
    """None when DeepEP can run here; otherwise why not (for logs and test skips)."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as error:  # ImportError, or a missing CUDA library under it
        return f"deep_ep does not import ({type(error).__name__}: {error})"
    if not hasattr(deep_ep, "Buffer"):
        return "deep_ep has no Buffer (the normal-mode dispatch/combine API)"
    if not torch.cuda.is_available():
        return "DeepEP needs CUDA devices and none is available"
    return None


@dataclass(frozen=True)
class DeepEPHandle:
    """DeepEP's own dispatch handle plus what the stats need at combine time (remote_rows:
    a 1-element int64 device tensor, rows received from other ranks)."""

    inner: Any
    num_tokens: int
    remote_rows: torch.Tensor


class DeepEPCommunicator:
    """The `comm.base.Communicator` on `deep_ep.Buffer` (intranode or internode).

    Args:
        group: the expert-parallel process group, NCCL over CUDA devices (None: the default).
        placement: where the experts live; `placement.ep_size` must equal the group size.
        buffer: an existing `deep_ep.Buffer` (or an object with its `get_dispatch_layout`,
            `dispatch` and `combine` methods). None: one is allocated at the first dispatch,
            sized by DeepEP's own hints for that hidden size (a collective: every rank reaches
            its first dispatch together, as the lockstep loop guarantees).
        mode: "auto" (normal kernels above `low_latency_max_tokens` tokens on the largest rank,
            low-latency at or below), "normal" or "low_latency" (always).
        low_latency_max_tokens: the low-latency kernels' token bound per rank
            (num_max_dispatch_tokens_per_rank, the buffer is sized for it) and the threshold.
        control_group: a gloo group over the same ranks for `begin_step` (None:
            `comm.step_sync.control_group_for`).

    Raises:
        ValueError: the placement's ep_size differs from the group size; an unknown mode.
        ImportError: `deep_ep` does not import and no buffer was given.

    Activations must be bfloat16 (DeepEP's normal kernels move bf16 or FP8 rows); T = 0 on a
    rank is passed to DeepEP as an empty batch.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        placement: ExpertPlacement,
        buffer: Any = None,
        *,
        mode: str = "auto",
        low_latency_max_tokens: int = LOW_LATENCY_MAX_TOKENS,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        deepep_ll.choose_mode(mode, 0, low_latency_max_tokens)  # validates the mode
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if placement.ep_size != self.world_size:
            raise ValueError(
                f"placement ep_size {placement.ep_size} does not match the process group "
                f"size {self.world_size}"
            )
        self.placement = placement
        self.control_group = control_group_for(self.group, control_group)
        self.buffer = buffer
        self.mode, self.low_latency_max_tokens = mode, low_latency_max_tokens
        self.stats = CommStats()
        #: The kernel of the latest dispatch: "normal" or "low_latency" (None before any).
        self.last_mode: str | None = None
        self._step_max_tokens: int | None = None
        try:
            deep_ep = importlib.import_module("deep_ep")
        except ImportError:
            if buffer is None:
                raise
            deep_ep = None  # a stand-in buffer (tests) follows the int64 index convention
        # DeepEP >= 1.2 exports the index dtype it was built with; older builds take int64.
        self._idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def begin_step(self, num_tokens: int | None) -> None:
        """Announce this rank's tokens in the coming step (T of each of its dispatches). The
        ranks agree on the largest with one host-side all-reduce (`comm.step_sync`), which
        fixes the kernel of the step's dispatches and sizes the low-latency experts' rows:
        no per-dispatch all-reduce or host read. Every rank calls it; None: decide per
        dispatch again (no collective).

        Raises:
            ValueError: num_tokens is negative.
        """
        if num_tokens is None:
            self._step_max_tokens = None
            return
        if num_tokens < 0:
            raise ValueError(f"begin_step: num_tokens must be >= 0, got {num_tokens}")
        self._step_max_tokens = max_tokens_over_ranks(num_tokens, self.group, self.control_group)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from the next dispatch on (every rank, between the same two
        steps). DeepEP sees physical ids `rank * slots_per_rank + slot` (normal and
        low-latency kernels alike), so a placement with the same slots per rank keeps the
        buffer, which is sized for ep_size x slots_per_rank experts.

        Raises:
            ValueError: another ep_size, num_experts or slots per rank than the serving one.
        """
        self.placement.check_swap(placement)
        self.placement = placement

    def profile_token_counts(self, max_tokens: int) -> set[int]:
        """The low-latency kernels' largest step, when it is below `max_tokens` (steps above
        it take the normal kernels): its receive buffer [E_local, R, H] and expert rows are
        allocated only by low-latency steps."""
        ll = self.low_latency_max_tokens
        return {ll} if self.mode != "normal" and ll < max_tokens else set()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Same contract as `TorchAllToAll.dispatch`; the rows' layout depends on the kernel.

        Normal kernels: rows ordered by source rank, then token, one per (token, rank).
        Low-latency kernels: one row per (token, local expert) pair with ONE id column,
        compacted to a fixed `deepep_ll.max_pairs` rows (`deepep_ll.to_dispatch_result`; rows
        with id -1 carry nothing).

        Args:
            hidden: [T, H] bfloat16 on the CUDA device; topk_ids: [T, k] int32 global ids;
            topk_weights: [T, k] float32.

        Raises:
            TypeError: hidden is not bfloat16.
            ValueError: mode "low_latency" with more than `low_latency_max_tokens` tokens; more
                tokens than `begin_step` announced.
        """
        if hidden.dtype != torch.bfloat16:
            raise TypeError(
                f"DeepEP dispatch moves bfloat16 activations, got {hidden.dtype}; "
                "use TorchAllToAll (backend 'torch') for other dtypes"
            )
        num_tokens, largest = hidden.shape[0], self._step_max_tokens
        if largest is not None and num_tokens > largest:
            raise ValueError(
                f"begin_step said at most {largest} tokens per rank, this rank has {num_tokens}"
            )
        pairs_bound = largest  # the low-latency rows are sized for it: the agreed step max
        if largest is None:
            largest = (
                deepep_ll.max_tokens_over_ranks(num_tokens, self.group, hidden.device)
                if self.mode == "auto"
                else num_tokens  # a forced mode needs no agreement for the kernel choice
            )
            pairs_bound = largest if self.mode == "auto" else self.low_latency_max_tokens
        mode = deepep_ll.choose_mode(self.mode, largest, self.low_latency_max_tokens)
        buffer = self._buffer_for(hidden)
        dest_rank, local_slot = self.placement.route(topk_ids, self.rank)
        slots = self.placement.num_local_experts
        physical = torch.where(local_slot >= 0, dest_rank * slots + local_slot, -1)
        physical = physical.to(self._idx_dtype)  # -1: no expert (DeepEP skips it)
        if mode == "low_latency":
            if self.last_mode == "normal":  # DeepEP: clean the low-latency buffer after normal use
                buffer.clean_low_latency_buffer(
                    self.low_latency_max_tokens, hidden.shape[1], self.world_size * slots
                )
            self.last_mode = mode
            return self._dispatch_low_latency(
                buffer, hidden, topk_weights, dest_rank, physical, pairs_bound
            )
        self.last_mode = mode
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            physical, self.world_size * slots
        )
        recv_x, recv_idx, recv_weights, _, inner, _ = buffer.dispatch(
            hidden,
            topk_idx=physical,
            topk_weights=topk_weights.float(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        recv_ids = recv_idx.to(torch.int32)
        recv_weights = torch.where(recv_ids >= 0, recv_weights.float(), 0.0)
        per_rank = per_rank.to(hidden.device).long()
        remote_rows = recv_x.shape[0] - per_rank[self.rank]
        self._record_dispatch(hidden, topk_ids.shape[1], per_rank, dest_rank, recv_x.shape[0])
        handle = DeepEPHandle(inner, hidden.shape[0], remote_rows)
        return DispatchResult(recv_x, recv_ids, recv_weights, handle)

    def combine(
        self, expert_out: torch.Tensor, handle: DeepEPHandle | LowLatencyHandle
    ) -> torch.Tensor:
        """Same contract as `TorchAllToAll.combine`; expert_out is sent as bfloat16.

        Returns:
            [T, H] bfloat16 (DeepEP adds the partial sums in float32 and rounds once; the
            low-latency kernel also applies the routing weights there).
        """
        if isinstance(handle, LowLatencyHandle):
            packed = deepep_ll.scatter_to_packed(expert_out, handle)
            combined, _, _ = self.buffer.low_latency_combine(
                packed, handle.topk_idx, handle.topk_weights, handle.inner
            )
        else:
            combined, _, _ = self.buffer.combine(expert_out.to(torch.bfloat16), handle.inner)
        self.stats.record_combine(handle.remote_rows * expert_out.shape[1] * 2)
        return combined

    def _dispatch_low_latency(
        self,
        buffer: Any,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        dest_rank: torch.Tensor,
        physical: torch.Tensor,
        largest: int,
    ) -> DispatchResult:
        """One row per (token, expert) pair through `low_latency_dispatch` (bf16 transport),
        handed to the experts compacted to `deepep_ll.max_pairs` rows of one id each (for the
        step's largest token count `largest`). No host sync: the counters stay on the device.
        """
        slots = self.placement.num_local_experts
        num_experts = self.world_size * slots
        recv_x, recv_count, inner, _, _ = buffer.low_latency_dispatch(
            hidden, physical, self.low_latency_max_tokens, num_experts, use_fp8=False
        )
        world, device = self.world_size, dest_rank.device
        flat_rank = dest_rank.reshape(-1)
        pairs = torch.zeros(world, dtype=torch.int64, device=device)
        pairs.scatter_add_(0, flat_rank, torch.ones_like(flat_rank))
        in_rank = torch.zeros(dest_rank.shape[0], world, dtype=torch.bool, device=device)
        in_rank.scatter_(1, dest_rank, True)
        in_rank[:, self.rank] = False
        received = recv_count.to(device).long().sum()
        remote_sent = pairs.sum() - pairs[self.rank]
        hidden_bytes = hidden.shape[1] * hidden.element_size()
        counts = device_counts(
            pairs,  # rows: one per (token, expert) pair
            tokens_received=received,
            remote_pairs=remote_sent,
            dispatch_bytes_sent=remote_sent * hidden_bytes,
            min_dispatch_bytes=in_rank.sum() * hidden_bytes,
        )
        self.stats.record_dispatch(CommCounts(dispatches=1, tokens_in=hidden.shape[0]), counts)
        experts, rows, _ = recv_x.shape
        bound = deepep_ll.max_pairs(world, largest, physical.shape[1], slots)
        packed_row = deepep_ll.compact_pairs(
            recv_count.to(device), rows, min(bound, experts * rows)
        )
        handle = LowLatencyHandle(
            inner, physical, topk_weights.float(), recv_x, packed_row, received - pairs[self.rank]
        )
        return deepep_ll.to_dispatch_result(recv_x, recv_count.to(device), packed_row, handle)

    def _buffer_for(self, hidden: torch.Tensor) -> Any:
        if self.buffer is None:
            experts = self.world_size * self.placement.num_local_experts
            low_latency = None if self.mode == "normal" else self.low_latency_max_tokens
            self.buffer = deepep_ll.allocate_buffer(
                self.group, hidden.shape[1], experts, low_latency
            )
        return self.buffer

    def _record_dispatch(
        self,
        hidden: torch.Tensor,
        top_k: int,
        per_rank: torch.Tensor,
        dest_rank: torch.Tensor,
        received: int,
    ) -> None:
        """The normal kernels' counters, kept on the device (per_rank: [N] int64 tokens sent
        to each rank; received: rows DeepEP delivered)."""
        remote_sent = per_rank.sum() - per_rank[self.rank]
        hidden_bytes = hidden.shape[1] * hidden.element_size()
        idx_bytes = torch.empty(0, dtype=self._idx_dtype).element_size()
        counts = device_counts(
            per_rank,
            remote_pairs=(dest_rank != self.rank).sum(),
            # DeepEP's own channel metadata is not visible here: rows + ids + weights.
            dispatch_bytes_sent=remote_sent * (hidden_bytes + top_k * (idx_bytes + 4)),
            min_dispatch_bytes=remote_sent * hidden_bytes,
        )
        host = CommCounts(dispatches=1, tokens_in=hidden.shape[0], tokens_received=received)
        self.stats.record_dispatch(host, counts)
