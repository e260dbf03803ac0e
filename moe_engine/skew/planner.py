"""Expert placement planning: replicate hot experts, pack the replicas onto EP ranks, replay.

The approach is the one of DeepSeek's EPLB (github.com/deepseek-ai/EPLB, "global" policy;
DeepSeek-V3 technical report, section 3.4 "redundant experts"), written anew here:

1. **Replicate.** With R redundant slots, give one more replica, R times, to the expert whose
   load per replica (load / replicas) is largest: this minimises the largest per-replica load.
   The engine shares an expert's pairs evenly among its replicas (`ExpertPlacement.route`:
   round-robin per source rank, counts within one of each other), so each replica carries
   load / replicas. No expert gets more replicas than there are ranks.
2. **Pack.** The E + R replicas go onto N ranks with (E + R) / N slots each: replicas sorted by
   load, heaviest first, each to the least-loaded rank that has a free slot and does not hold
   the same expert yet (longest-processing-time-first greedy with a cardinality limit). One
   placement serves all layers, whose hot experts differ, so "least loaded" is taken over the
   vector of per-layer loads (least growth of its squared norm, see `pack_replicas`): packing
   on the summed load alone levels the sum but can leave single layers worse than before.
3. **Replay.** A placement's predicted load of rank r in layer l is
   sum over r's slots of load[l, e] / replicas[e]; the imbalance is max / mean over ranks.

Placement files are what `comm.placement.ExpertPlacement` reads (and validates here):
`{"version": 1, "num_experts": E, "ep_size": N, "slots": [[expert ids of rank 0], ...]}`.
The engine uses one placement for every MoE layer (what `moe-serve --expert-placement`
serves): replicas are chosen on the load summed over layers, packing looks at every layer.
`per_layer=True` additionally plans each layer on its own load and stores those under
`"layers": {"<decoder layer>": slots}`: a what-if for per-layer placement (DeepSeek's EPLB
plans per layer). `ExpertPlacement` ignores that key, so the engine still serves `"slots"`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comm.placement import PLACEMENT_VERSION, ExpertPlacement

Slots = list[list[int]]


class PlacementError(ValueError):
    """An impossible plan request or an invalid placement file."""


def contiguous_slots(num_experts: int, ep_size: int) -> Slots:
    """The default placement (DESIGN.md section 6): rank r holds experts [r * E/N, (r+1) * E/N).

    Raises:
        PlacementError: N does not divide E, or a size < 1.
    """
    try:
        default = ExpertPlacement.contiguous(num_experts, ep_size)
    except ValueError as exc:
        raise PlacementError(str(exc)) from exc
    return [list(row) for row in default.slots]


def replica_counts(load: np.ndarray, num_redundant: int, max_replicas: int) -> np.ndarray:
    """Replicas per expert after adding `num_redundant`, greedily to the largest load / replicas.

    Args:
        load: [E] tokens (or any nonnegative weight) per expert.
        num_redundant: R >= 0 extra replicas.
        max_replicas: the most replicas one expert may have (the number of ranks).

    Returns:
        [E] int64, each >= 1, summing to E + R. Ties go to the lowest expert id.

    Raises:
        PlacementError: R < 0, or R more than E * (max_replicas - 1).
    """
    load = np.asarray(load, dtype=np.float64)
    num_experts = load.shape[0]
    if num_redundant < 0:
        raise PlacementError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if num_redundant > num_experts * (max_replicas - 1):
        raise PlacementError(
            f"{num_redundant} redundant experts cannot be placed: with {max_replicas} rank(s) an "
            f"expert has at most {max_replicas} replicas ({num_experts * (max_replicas - 1)} "
            "redundant at most)"
        )
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_redundant):
        per_replica = np.where(counts < max_replicas, load / counts, -np.inf)
        counts[int(np.argmax(per_replica))] += 1
    return counts


def pack_replicas(load: np.ndarray, replicas: np.ndarray, ep_size: int) -> Slots:
    """Assign every replica to a rank, (E + R) / N slots per rank, balancing every layer's load.

    Each layer's loads are first scaled to sum to 1 (every layer counts the same); a replica of
    expert e then carries the vector s_e = load[:, e] / replicas[e] over the L layers. Replicas
    go heaviest first (by the sum of s_e) to the rank with a free slot and without e whose
    per-layer loads grow least in squared norm, |x_r + s_e|^2 - |x_r|^2 (ties: lowest rank).
    With one layer that is the least-loaded rank (EPLB's balanced packing); with several it
    keeps each layer level, not only their sum.

    Args:
        load: [L, E] (or [E]) tokens per expert; replicas: [E] int replicas per expert, each
            <= ep_size.
        ep_size: N ranks.

    Returns:
        slots: N lists of expert ids, each sorted ascending; expert e appears replicas[e]
        times in all, at most once per rank.

    Raises:
        PlacementError: E + R not divisible by N.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 1:
        load = load[None]
    replicas = np.asarray(replicas, dtype=np.int64)
    total = int(replicas.sum())
    if total % ep_size:
        raise PlacementError(
            f"experts + redundant experts ({total}) must be a multiple of ep_size ({ep_size}) "
            "so that every rank holds the same number of slots"
        )
    per_rank = total // ep_size
    layer_total = load.sum(axis=1, keepdims=True)
    norm = np.divide(load, layer_total, out=np.zeros_like(load), where=layer_total > 0)
    share = norm / replicas  # [L, E]
    items = np.repeat(np.arange(load.shape[1]), replicas)
    # heaviest first; ties by expert id (stable sort keeps np.repeat's ascending order)
    items = items[np.argsort(-share.sum(axis=0)[items], kind="stable")]
    slots: Slots = [[] for _ in range(ep_size)]
    rank_load = np.zeros((load.shape[0], ep_size), dtype=np.float64)  # [L, N]
    for e in items.tolist():
        free = [r for r in range(ep_size) if len(slots[r]) < per_rank]
        allowed = [r for r in free if e not in slots[r]] or free
        growth = 2 * share[:, e] @ rank_load + share[:, e] @ share[:, e]  # [N]
        r = min(allowed, key=lambda q: (growth[q], q))
        if e in slots[r]:  # every rank with room holds e already: trade a slot
            r = _make_room(slots, rank_load, share, e, r)
        slots[r].append(e)
        rank_load[:, r] += share[:, e]
    return [sorted(s) for s in slots]


def _make_room(slots: Slots, rank_load: np.ndarray, share: np.ndarray, e: int, r: int) -> int:
    """Rank `r` (the only one with free slots) already holds `e`: move one of another rank's
    experts f (f not on r, and that rank not holding e) to r, freeing that slot for e.
    Returns the rank that now takes e. Such a move exists when replicas[e] <= N: some full rank
    q lacks e, and q holds more distinct experts than r, so one of them is not on r.

    Args:
        rank_load: [L, N] loads so far (updated); share: [L, E] load of one replica.
    """
    for q in sorted(range(len(slots)), key=lambda q: rank_load[:, q].sum()):
        if q == r or e in slots[q]:
            continue
        for f in slots[q]:
            if f not in slots[r]:
                slots[q].remove(f)
                rank_load[:, q] -= share[:, f]
                slots[r].append(f)
                rank_load[:, r] += share[:, f]
                return q
    raise AssertionError(f"no rank can take another replica of expert {e}")  # see above


def plan_slots(load: np.ndarray, ep_size: int, num_redundant: int) -> Slots:
    """Replicate (on the load summed over layers, each layer scaled to sum 1) then pack.

    Args:
        load: [L, E] or [E] tokens per (layer and) expert.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 1:
        load = load[None]
    layer_total = load.sum(axis=1, keepdims=True)
    norm = np.divide(load, layer_total, out=np.zeros_like(load), where=layer_total > 0)
    replicas = replica_counts(norm.sum(axis=0), num_redundant, ep_size)
    return pack_replicas(load, replicas, ep_size)


def share_matrix(slots: Slots, num_experts: int) -> np.ndarray:
    """[E, N] float64: the fraction of expert e's tokens that rank r processes.

    M[e, r] = (replicas of e on r) / (replicas of e); rank loads are `load @ M`.

    Raises:
        PlacementError: an expert id out of range, or an expert with no slot.
    """
    matrix = np.zeros((num_experts, len(slots)), dtype=np.float64)
    for r, rank_slots in enumerate(slots):
        for e in rank_slots:
            if not 0 <= e < num_experts:
                raise PlacementError(f"expert id {e} on rank {r} is outside [0, {num_experts})")
            matrix[e, r] += 1
    replicas = matrix.sum(axis=1, keepdims=True)
    if (replicas == 0).any():
        missing = np.flatnonzero(replicas[:, 0] == 0).tolist()
        raise PlacementError(f"experts {missing} have no slot on any rank")
    return matrix / replicas


@dataclass
class Placement:
    """A placement of E experts (with replicas) on N ranks.

    Attributes:
        num_experts: E.
        slots: N lists of global expert ids (rank r's local experts in order).
        layers: optional per-MoE-layer slots, keyed by decoder-layer index.
    """

    num_experts: int
    slots: Slots
    layers: dict[int, Slots] = field(default_factory=dict)

    @property
    def ep_size(self) -> int:
        return len(self.slots)

    @property
    def num_redundant(self) -> int:
        return sum(len(s) for s in self.slots) - self.num_experts

    def slots_for(self, layer: int) -> Slots:
        """The slots that decoder layer `layer` uses (its own, else the shared ones)."""
        return self.layers.get(layer, self.slots)

    def to_json(self) -> dict[str, Any]:
        """The placement-file object (module docstring)."""
        obj: dict[str, Any] = dict(
            version=PLACEMENT_VERSION,
            num_experts=self.num_experts,
            ep_size=self.ep_size,
            slots=[list(map(int, s)) for s in self.slots],
        )
        if self.layers:
            obj["layers"] = {str(k): [list(map(int, s)) for s in v] for k, v in self.layers.items()}
        return obj

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the placement file (JSON, one line per rank's slots for readability)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, obj: Any, source: str = "placement") -> Placement:
        """Parse and check a placement-file object; the shared slots (and each layer's) are
        validated by the engine's loader, `comm.placement.ExpertPlacement.from_dict`.

        Raises:
            PlacementError: not an object, a missing key, another version, or invalid slots
                (uneven ranks, unknown or missing experts, an expert twice on one rank); the
                message starts with `source`.
        """
        if not isinstance(obj, dict):
            raise PlacementError(f"{source}: must be a JSON object, got {type(obj).__name__}")
        try:
            shared = ExpertPlacement.from_dict(obj, source=source)
        except (ValueError, TypeError) as exc:
            raise PlacementError(str(exc)) from exc
        num_experts, ep_size = shared.num_experts, shared.ep_size
        layers_obj = obj.get("layers") or {}
        if not isinstance(layers_obj, dict):
            raise PlacementError(f"{source}: layers must be an object {{decoder layer: slots}}")
        layers = {}
        for key, value in layers_obj.items():
            try:
                layer = int(key)
            except ValueError as exc:
                raise PlacementError(f"{source}: layers key {key!r} is not a layer index") from exc
            layers[layer] = _check_slots(value, num_experts, ep_size, f"{source}: layers[{key}]")
        return cls(num_experts, [list(row) for row in shared.slots], layers)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        """Read a placement file.

        Raises:
            PlacementError: unreadable, not JSON, or invalid (see `from_json`).
        """
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlacementError(f"cannot read placement file {str(path)!r}: {exc}") from exc
        return cls.from_json(obj, source=str(path))


def _check_slots(value: Any, num_experts: int, ep_size: int, where: str) -> Slots:
    """Validate one slot table with the engine's own loader (`comm.placement.ExpertPlacement`)."""
    if not isinstance(value, list):
        raise PlacementError(f"{where} must be a list of per-rank lists of expert ids")
    try:
        checked = ExpertPlacement(num_experts, ep_size, value)
    except (ValueError, TypeError) as exc:
        raise PlacementError(f"{where}: {exc}") from exc
    return [list(row) for row in checked.slots]


def plan_placement(
    loads: np.ndarray,
    ep_size: int,
    num_redundant: int,
    moe_layers: list[int] | None = None,
    per_layer: bool = False,
) -> Placement:
    """Plan a placement from per-layer loads.

    Args:
        loads: [L, E] tokens per MoE layer and expert (e.g. a trace's summed counts).
        ep_size: N ranks; num_redundant: R extra replicas; (E + R) % N must be 0.
        moe_layers: decoder-layer indices of the L rows (keys of `layers`); default 0..L-1.
        per_layer: also plan every layer on its own load.

    Raises:
        PlacementError: see `replica_counts` and `pack_replicas`.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 1:
        loads = loads[None]
    layers = list(range(len(loads))) if moe_layers is None else list(moe_layers)
    placement = Placement(loads.shape[1], plan_slots(loads, ep_size, num_redundant))
    if per_layer:
        placement.layers = {
            int(layer): plan_slots(row, ep_size, num_redundant)
            for layer, row in zip(layers, loads, strict=True)
        }
    return placement


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


def _step_mean(per_row_rank_load: np.ndarray) -> np.ndarray:
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
        step_imbalance_before=_step_mean(rows_before),
        step_imbalance_after=_step_mean(rows_after),
    )
