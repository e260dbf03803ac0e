"""Runtime expert-parallel load balancing (EPLB): experts that move between ranks while serving.

`controller.EplbController` decides (from the routing load of a window of steps, summed over
the ranks) when and where the experts go (`policy`); `mover.ExpertMover` moves their weights
over the device group, a chunk per step, on a schedule every rank computes alike
(`schedule`), and swaps them in on every rank at once; `placement` builds the placement
served first, with the redundant slots filled.
"""

from moe_engine.eplb.mover import ExpertMover, MoveStats
from moe_engine.eplb.schedule import ExpertCopy, MoveSchedule, chunk_moves, plan_moves

__all__ = ["ExpertCopy", "ExpertMover", "MoveSchedule", "MoveStats", "chunk_moves", "plan_moves"]
