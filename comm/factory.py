"""Pick the communicator for a process group and placement (DESIGN.md section 6)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from comm.base import Communicator
from comm.deepep import DeepEPCommunicator, deepep_unavailable_reason
from comm.noop import NoopCommunicator
from comm.placement import ExpertPlacement
from comm.torch_a2a import TorchAllToAll

#: Accepted values of `make_communicator(backend=...)`.
BACKENDS = ("auto", "noop", "torch", "deepep")


def make_communicator(
    group: dist.ProcessGroup | None,
    placement: ExpertPlacement,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    control_group: dist.ProcessGroup | None = None,
) -> Communicator:
    """The communicator for `placement` over `group`.

    "auto" picks, in order: `NoopCommunicator` for one rank with the contiguous placement
    (local ids = global ids); `DeepEPCommunicator` when `deep_ep` imports, the activations are
    bfloat16 on a CUDA device and the group runs on NCCL; else `TorchAllToAll`.

    Args:
        group: the expert-parallel process group (None: the default group; not needed for
            "noop").
        placement: the expert placement; its ep_size is the group size.
        backend: "auto", "noop", "torch" or "deepep".
        device: where the activations live (None: CUDA if the group's backend is NCCL).
        dtype: the activations' dtype; DeepEP is chosen automatically only for bfloat16.
        control_group: a gloo group over the same ranks for the per-step agreement of
            `begin_step` (None: `comm.step_sync.control_group_for` finds one).

    Raises:
        ValueError: an unknown backend; "noop" with more than one rank or a non-contiguous
            placement; "deepep" where DeepEP cannot run (the message says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown communicator backend {backend!r}; choose one of {BACKENDS}")
    single = placement.ep_size == 1 and placement.is_contiguous
    if backend == "noop" or (backend == "auto" and single):
        if not single:
            raise ValueError(
                "the noop communicator needs ep_size 1 and the contiguous placement, "
                f"got {placement}"
            )
        return NoopCommunicator()
    if backend == "deepep":
        reason = deepep_unavailable_reason()
        if reason is not None:
            raise ValueError(f"communicator backend 'deepep' cannot run here: {reason}")
        return DeepEPCommunicator(group, placement, control_group=control_group)
    if backend == "auto" and _deepep_fits(group, device, dtype):
        return DeepEPCommunicator(group, placement, control_group=control_group)
    return TorchAllToAll(group, placement, control_group=control_group)


def _deepep_fits(
    group: dist.ProcessGroup | None, device: torch.device | str | None, dtype: torch.dtype | None
) -> bool:
    nccl = dist.get_backend(group) == "nccl"
    on_cuda = torch.device(device).type == "cuda" if device is not None else nccl
    return nccl and on_cuda and dtype == torch.bfloat16 and deepep_unavailable_reason() is None
