"""The weight-update process group between a trainer and the engine's ranks.

Not the engine's own process group (the expert-parallel ranks keep theirs): a separate
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) over a `TCPStore` that the trainer hosts,
as SGLang's `init_weights_update_group` and vLLM's RLHF examples build a stateless group. The
trainer is rank 0 and the broadcast root; engine rank r of an expert-parallel engine is rank
rank_offset + r. Both sides build it as a `WeightGroup` (the trainer through `moe_engine.rl`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from moe_engine.weight_update.buckets import bucket_layout, pack
from moe_engine.weight_update.messages import (
    DEFAULT_BACKEND,
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    TensorMeta,
)

#: Backends a group may use.
BACKENDS = ("gloo", "nccl")


class WeightGroup:
    """One side's membership of a weight-update group.

    Args:
        master_address, master_port: the trainer's TCPStore (rank 0 hosts it).
        rank, world_size: this member's rank and the group's size.
        backend: "gloo" or "nccl"; group_name: keys the store (several groups may share it).
        timeout_s: for joining and for every collective (seconds).
        device: where the handshake flag lives (the CPU for gloo, the GPU for NCCL).

    Raises:
        ValueError: an unknown backend, a rank outside [0, world_size).
        RuntimeError / DistStoreError: the store or a peer did not answer within timeout_s.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = DEFAULT_BACKEND,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        device: torch.device | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size {world_size})")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = device or torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(f"moe_engine/{group_name}", self._store)
        if backend == "gloo":
            self.group: dist.ProcessGroup = dist.ProcessGroupGloo(
                prefixed, rank, world_size, timeout
            )
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        # every member has joined once one collective has gone through
        self.agree(False)

    def agree(self, refused: bool) -> bool:
        """Every member says whether it refuses the coming transfer; True when nobody does
        (an all-reduce MAX of one flag: the handshake before any bucket is sent)."""
        flag = torch.tensor([1 if refused else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([flag], options).wait()
        return int(flag.item()) == 0

    def broadcast(self, buf: torch.Tensor) -> None:
        """Broadcast `buf` from rank 0 (the trainer) into every member's `buf`, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([buf], options).wait()

    def send(self, metas: list[TensorMeta], tensors: list[torch.Tensor], bucket_bytes: int
             ) -> int:
        """The trainer's transfer: `tensors` (described by `metas`, in order) packed into the
        buckets both sides compute (`buckets.bucket_layout`) and broadcast one by one; returns
        how many buckets went."""
        layout = bucket_layout(metas, bucket_bytes)
        for bucket in layout:
            self.broadcast(pack(bucket, tensors))
        return len(layout)

    def close(self) -> None:
        """Leave the group (drop the process group and the store connection)."""
        self.group = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
