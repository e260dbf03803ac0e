"""Runtime EPLB: moving experts' weights between ranks while serving (`mover.ExpertMover`),
on a schedule every rank computes alike (`schedule`)."""

from moe_engine.eplb.mover import ExpertMover, MoveStats
from moe_engine.eplb.schedule import ExpertCopy, MoveSchedule, chunk_moves, plan_moves

__all__ = ["ExpertCopy", "ExpertMover", "MoveSchedule", "MoveStats", "chunk_moves", "plan_moves"]
