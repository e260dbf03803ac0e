"""Predicted imbalance: per-rank loads of recorded routing under a placement, and replay.

A placement's predicted load of rank r in layer l is the sum over r's slots of
load[l, e] / replicas[e] (the engine shares an expert's pairs evenly among its replicas,
`ExpertPlacement.route`); the imbalance is max / mean over ranks (`imbalance_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_engine.skew.placement import Placement, PlacementError, contiguous_slots, share_matrix


def rank_loads(counts: np.ndarray, placement: Placement, moe_layers: list[int]) -> np.ndarray:
    """Predicted load per rank: [..., L, E] counts -> [..., L, N] float64 (replicas share evenly).

    Raises:
        PlacementError: E differs from the placement's, or an invalid placement.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.shape[-1] != placement.num_experts:
        raise PlacementError(
            f"the load has {counts.shape[-1]} experts, the placement {placement.num_experts}"
        )
    out = np.empty((*counts.shape[:-1], placement.ep_size), dtype=np.float64)
    for i, layer in enumerate(moe_layers):
        matrix = share_matrix(placement.slots_for(int(layer)), placement.num_experts)
        out[..., i, :] = counts[..., i, :] @ matrix
    return out


def max_over_mean(load: np.ndarray) -> np.ndarray:
    """max / mean over the last axis; 0 where the mean is 0 (`imbalance_ratio` convention)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=-1)
    peak = load.max(axis=-1)
    return np.divide(peak, mean, out=np.zeros_like(mean), where=mean > 0)


def mean_over_max(load: np.ndarray) -> np.ndarray:
    """mean / max over the last axis; 0 where the max is 0 (`balancedness` convention)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=-1)
    peak = load.max(axis=-1)
    return np.divide(mean, peak, out=np.zeros_like(mean), where=peak > 0)


@dataclass
class ReplayResult:
    """Predicted rank loads of a trace under two placements.

    Attributes:
        moe_layers: [L] decoder-layer indices.
        rank_load_before / rank_load_after: [L, N] float64 token-expert pairs per rank over the
            whole trace.
        imbalance_before / imbalance_after: [L] max / mean of those.
        step_imbalance_before / step_imbalance_after: [L] mean over trace rows of each row's
            max / mean (rows where the layer ran nothing are left out): the per-step view.
    """

    moe_layers: list[int]
    rank_load_before: np.ndarray
    rank_load_after: np.ndarray
    imbalance_before: np.ndarray
    imbalance_after: np.ndarray
    step_imbalance_before: np.ndarray
    step_imbalance_after: np.ndarray

    def to_json(self) -> dict[str, Any]:
        """Per-layer numbers and their means over layers, as plain JSON types."""
        return dict(
            layers=[
                dict(
                    layer=int(layer),
                    rank_load_before=self.rank_load_before[i].tolist(),
                    rank_load_after=self.rank_load_after[i].tolist(),
                    imbalance_before=float(self.imbalance_before[i]),
                    imbalance_after=float(self.imbalance_after[i]),
                    step_imbalance_before=float(self.step_imbalance_before[i]),
                    step_imbalance_after=float(self.step_imbalance_after[i]),
                )
                for i, layer in enumerate(self.moe_layers)
            ],
            mean_imbalance_before=float(self.imbalance_before.mean()),
            mean_imbalance_after=float(self.imbalance_after.mean()),
            mean_step_imbalance_before=float(self.step_imbalance_before.mean()),
            mean_step_imbalance_after=float(self.step_imbalance_after.mean()),
        )


def step_imbalance(per_row_rank_load: np.ndarray) -> np.ndarray:
    """[S, L, N] -> [L]: mean over rows with load of each row's max / mean."""
    ratio = max_over_mean(per_row_rank_load)  # [S, L]
    ran = per_row_rank_load.sum(axis=-1) > 0
    n = ran.sum(axis=0)
    return np.divide((ratio * ran).sum(axis=0), n, out=np.zeros(ratio.shape[1]), where=n > 0)


def replay(
    counts: np.ndarray,
    moe_layers: list[int],
    after: Placement,
    before: Placement | None = None,
) -> ReplayResult:
    """Replay recorded routing through two placements.

    Args:
        counts: [S, L, E] (or [L, E]) token-expert pairs per row, layer and expert.
        moe_layers: the L decoder-layer indices.
        after: the placement to evaluate; before: the baseline (default: contiguous on
            after.ep_size ranks).

    Raises:
        PlacementError: shapes or placements that do not fit.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim == 2:
        counts = counts[None]
    if before is None:
        before = Placement(after.num_experts, contiguous_slots(after.num_experts, after.ep_size))
    rows_before = rank_loads(counts, before, moe_layers)
    rows_after = rank_loads(counts, after, moe_layers)
    total_before, total_after = rows_before.sum(axis=0), rows_after.sum(axis=0)
    return ReplayResult(
        moe_layers=[int(x) for x in moe_layers],
        rank_load_before=total_before,
        rank_load_after=total_after,
        imbalance_before=max_over_mean(total_before),
        imbalance_after=max_over_mean(total_after),
        step_imbalance_before=step_imbalance(rows_before),
        step_imbalance_after=step_imbalance(rows_after),
    )
