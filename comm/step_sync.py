"""The one per-step agreement of an expert-parallel group: the largest token count over ranks.

A communicator whose buffers or kernels depend on how many tokens the busiest rank has (the
fixed-capacity all-to-all of `comm.torch_a2a`, DeepEP's normal / low-latency choice) needs that
number on every rank, the same on all of them, before the step's first dispatch. `begin_step`
gets it once per step with `max_tokens_over_ranks`: an all-reduce (MAX) of one host integer on
a gloo group, which moves no device data and waits for no device work, so the step's dispatches
and combines need no collective and no host read of their own.

Which group carries it (`control_group_for`): the one given, else the expert-parallel group
itself when it is gloo, else the default group when it is gloo (the engine's default group
always is: `moe_engine.engine.rank_groups`); with none of those (an NCCL-only setup), the
all-reduce runs on the device group and its result is read back: one host sync per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def control_group_for(device_group: Any, control_group: Any = None) -> Any | None:
    """The gloo group `max_tokens_over_ranks` uses, or None when there is none.

    Args:
        device_group: the expert-parallel group (None: the default group).
        control_group: an explicit gloo group spanning the same ranks, or None.
    """
    if control_group is not None:
        return control_group
    for candidate in (device_group, None):
        if dist.get_backend(candidate) == "gloo":
            return candidate if candidate is not None else dist.group.WORLD
    return None


def max_tokens_over_ranks(num_tokens: int, device_group: Any, control_group: Any | None) -> int:
    """The largest `num_tokens` over the ranks (every rank must call it, in the same order).

    Args:
        num_tokens: this rank's tokens in the coming step (T of every dispatch of the step).
        device_group: the expert-parallel group; used only when `control_group` is None.
        control_group: a gloo group from `control_group_for`, or None.

    Returns:
        The same integer on every rank.
    """
    if control_group is not None:
        count = torch.tensor([num_tokens], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=control_group)
        return int(count[0])
    device = torch.device("cuda", torch.cuda.current_device())
    count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=device_group)
    return int(count.item())
