"""The communicator on DeepEP's normal-mode (high-throughput) kernels, for CUDA machines.

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
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comm.base import DispatchResult
from comm.placement import ExpertPlacement
from comm.stats import CommCounts, CommStats


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
    """DeepEP's own dispatch handle plus what the stats need at combine time."""

    inner: Any
    num_tokens: int
    remote_rows: int


class DeepEPCommunicator:
    """The `comm.base.Communicator` on `deep_ep.Buffer` (normal mode, intranode or internode).

    Args:
        group: the expert-parallel process group, NCCL over CUDA devices (None: the default).
        placement: where the experts live; `placement.ep_size` must equal the group size.
        buffer: an existing `deep_ep.Buffer` (or an object with its `get_dispatch_layout`,
            `dispatch` and `combine` methods). None: one is allocated at the first dispatch,
            sized by DeepEP's own hints for that hidden size (a collective: every rank reaches
            its first dispatch together, as the lockstep loop guarantees).

    Raises:
        ValueError: the placement's ep_size differs from the group size.
        ImportError: `deep_ep` does not import and no buffer was given.

    Activations must be bfloat16 (DeepEP's normal kernels move bf16 or FP8 rows); T = 0 on a
    rank is passed to DeepEP as an empty batch.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        placement: ExpertPlacement,
        buffer: Any = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if placement.ep_size != self.world_size:
            raise ValueError(
                f"placement ep_size {placement.ep_size} does not match the process group "
                f"size {self.world_size}"
            )
        self.placement = placement
        self.buffer = buffer
        self.stats = CommStats()
        try:
            deep_ep = importlib.import_module("deep_ep")
        except ImportError:
            if buffer is None:
                raise
            deep_ep = None  # a stand-in buffer (tests) follows the int64 index convention
        # DeepEP >= 1.2 exports the index dtype it was built with; older builds take int64.
        self._idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Same contract as `TorchAllToAll.dispatch` (rows ordered by source rank, then token).

        Args:
            hidden: [T, H] bfloat16 on the CUDA device; topk_ids: [T, k] int32 global ids;
            topk_weights: [T, k] float32.

        Raises:
            TypeError: hidden is not bfloat16.
        """
        if hidden.dtype != torch.bfloat16:
            raise TypeError(
                f"DeepEP dispatch moves bfloat16 activations, got {hidden.dtype}; "
                "use TorchAllToAll (backend 'torch') for other dtypes"
            )
        buffer = self._buffer_for(hidden)
        dest_rank, local_slot = self.placement.route(topk_ids, self.rank)
        slots = self.placement.num_local_experts
        physical = (dest_rank * slots + local_slot).to(self._idx_dtype)
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
        remote_pairs = (dest_rank != self.rank).sum().view(1)
        host = torch.cat([per_rank.long(), remote_pairs]).tolist()
        remote_rows = recv_x.shape[0] - host[self.rank]
        self._record_dispatch(hidden, topk_ids.shape[1], host, recv_x.shape[0])
        handle = DeepEPHandle(inner, hidden.shape[0], remote_rows)
        return DispatchResult(recv_x, recv_ids, recv_weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        """Same contract as `TorchAllToAll.combine`; expert_out is sent as bfloat16.

        Returns:
            [T, H] bfloat16 (DeepEP adds the partial sums in float32 and rounds once).
        """
        combined, _, _ = self.buffer.combine(expert_out.to(torch.bfloat16), handle.inner)
        self.stats.record_combine(handle.remote_rows * expert_out.shape[1] * 2)
        return combined

    def _buffer_for(self, hidden: torch.Tensor) -> Any:
        if self.buffer is None:
            self.buffer = _allocate_buffer(self.group, hidden.shape[1] * 2)
        return self.buffer

    def _record_dispatch(
        self, hidden: torch.Tensor, top_k: int, host: list[int], received: int
    ) -> None:
        per_rank = host[: self.world_size]
        remote_sent = sum(per_rank) - per_rank[self.rank]
        hidden_bytes = hidden.shape[1] * hidden.element_size()
        idx_bytes = torch.empty(0, dtype=self._idx_dtype).element_size()
        self.stats.record_dispatch(
            CommCounts(
                dispatches=1,
                tokens_in=hidden.shape[0],
                tokens_sent_per_rank=per_rank,
                tokens_received=received,
                remote_pairs=host[self.world_size],
                # DeepEP's own channel metadata is not visible here: rows + ids + weights.
                dispatch_bytes_sent=remote_sent * (hidden_bytes + top_k * (idx_bytes + 4)),
                min_dispatch_bytes=remote_sent * hidden_bytes,
            )
        )


def _allocate_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Any:
    """A `deep_ep.Buffer` sized as DeepEP's README does: the larger of the dispatch and
    combine configs' NVLink and RDMA size hints for `hidden_bytes` per token."""
    deep_ep = importlib.import_module("deep_ep")
    world = group.size()
    num_nvl_bytes, num_rdma_bytes = 0, 0
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    for config in configs:
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, world))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, world))
    return deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
