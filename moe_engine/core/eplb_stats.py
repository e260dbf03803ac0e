"""What runtime EPLB reports (`moe_engine.eplb.controller`): one rank's counters and the engine's.

Each rank's controller fills an `EplbStats` (its own bytes and seconds; the decisions and
balancedness, computed from the all-reduced load, are the same on every rank); the front end
gets them in `CoreStats.eplb` and `merge_eplb_stats` turns the ranks' into the engine's.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RebalanceRecord(msgspec.Struct, kw_only=True):
    """One rebalance, from the decision to the swap on every rank.

    Attributes:
        step: the engine step (counted from startup by the controller) whose decision started
            it; committed_step: the step at whose end the new placement was swapped in.
        experts_moved: expert weights this rank received (engine: summed over ranks).
        bytes_sent / bytes_received: expert weight bytes this rank sent / received (engine:
            summed over ranks).
        transfer_s: seconds this rank spent moving them (over `move_steps` steps); commit_s:
            seconds the swap took (engine: the slowest rank's, both).
        move_steps: steps the transfer was spread over.
        balancedness_before: the rank balancedness of the placement it replaced, predicted
            from the window's load (mean over MoE layers of mean / max pairs per rank);
            balancedness_after_predicted: the new placement's, on the same load;
            balancedness_after_measured: measured on the ranks' pairs of the window_steps
            steps after the swap, -1.0 until that window has passed.
    """

    step: int
    committed_step: int = -1
    experts_moved: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_s: float = 0.0
    commit_s: float = 0.0
    move_steps: int = 0
    balancedness_before: float = 0.0
    balancedness_after_predicted: float = 0.0
    balancedness_after_measured: float = -1.0


class EplbStats(msgspec.Struct, kw_only=True):
    """Runtime EPLB's counters (totals since startup unless noted).

    Attributes:
        num_rebalances: rebalances committed; num_decisions: decisions taken (one per
            --eplb-step-interval steps); moving: a transfer is under way now.
        experts_moved, bytes_sent, bytes_received: over all rebalances (engine: summed over
            ranks); transfer_s, commit_s: seconds over all rebalances (engine: the slowest
            rank's).
        balancedness: the rank balancedness measured over the last decision's window (the
            ranks' token-expert pairs, mean over MoE layers of mean / max), -1.0 before one;
            balancedness_predicted: the served placement's predicted one on that window.
        last_rebalance_step: the step of the last committed rebalance's decision, -1 before.
        rebalances: the last `MAX_RECORDS` rebalances, oldest first.
    """

    num_rebalances: int = 0
    num_decisions: int = 0
    moving: bool = False
    experts_moved: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_s: float = 0.0
    commit_s: float = 0.0
    balancedness: float = -1.0
    balancedness_predicted: float = -1.0
    last_rebalance_step: int = -1
    rebalances: list[RebalanceRecord] = []


#: Rebalances kept in `EplbStats.rebalances`.
MAX_RECORDS = 16


def _merged_moves(structs: list[Any]) -> dict[str, Any]:
    """The move counters of one thing seen by every rank (an `EplbStats` or a
    `RebalanceRecord`): experts and bytes summed, seconds the slowest rank's."""
    summed = {name: sum(getattr(s, name) for s in structs)
              for name in ("experts_moved", "bytes_sent", "bytes_received")}
    slowest = {name: max(getattr(s, name) for s in structs) for name in ("transfer_s", "commit_s")}
    return {**summed, **slowest}


def merge_eplb_stats(per_rank: list[EplbStats]) -> EplbStats:
    """The engine's EPLB stats from every rank's: experts and bytes summed, seconds the
    slowest rank's, the rest (identical on every rank) rank 0's."""
    width = min(len(s.rebalances) for s in per_rank)
    records = [
        msgspec.structs.replace(per_rank[0].rebalances[i],
                                **_merged_moves([s.rebalances[i] for s in per_rank]))
        for i in range(width)
    ]
    return msgspec.structs.replace(per_rank[0], **_merged_moves(per_rank), rebalances=records)
