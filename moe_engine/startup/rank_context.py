"""`RankContext`: what one rank of an expert-parallel group brings to its model and core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RankContext:
    """What a rank of an expert-parallel group brings to its EngineCore.

    Attributes:
        rank: this rank's index in [0, ep_size).
        ep_size: ranks in the group.
        local_experts: the global expert id of each local expert slot (DESIGN.md section 6).
        communicator: dispatch/combine across the group (`comm.TorchAllToAll` or another).
    """

    rank: int
    ep_size: int
    local_experts: list[int]
    communicator: Any
