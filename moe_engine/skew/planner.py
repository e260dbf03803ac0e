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
4. **Never worse than the baseline.** On a nearly balanced load, replicate-and-pack can leave
   the ranks *less* even than the layout already served (it packs by a proxy, the squared
   norm, and a replica on the busiest rank only adds to it). `plan` therefore scores
   candidates on the objective `moe-skew plan` prints, the mean over layers of the whole-trace
   rank max / mean (and, given per-row counts, never lets the per-row view get worse either).
   Replicate-and-pack with all R redundant experts is taken when it beats the baseline (the
   trace's placement, else contiguous) on both. Otherwise the best of replicate-and-pack with
   R - N, R - 2N, ..., 0 redundant experts (each only when it beats the baseline) and the
   baseline with replicas added one per rank at a time, each round kept only when it lowers
   the objective; when nothing beats the baseline it comes back unchanged
   (`PlanChoice.improved` is False).

Placement files and their validation live in `moe_engine.skew.placement`, the replay of a
trace through a placement (step 3) in `moe_engine.skew.imbalance`. The engine uses one
placement for every MoE layer: replicas are chosen on the load summed over layers, packing
looks at every layer.
`per_layer=True` additionally plans each layer on its own load (stored under the placement
file's `"layers"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_engine.skew.imbalance import max_over_mean, step_imbalance
from moe_engine.skew.placement import (
    Placement,
    PlacementError,
    Slots,
    contiguous_slots,
    share_matrix,
)


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


def _mean_imbalance(load: np.ndarray, matrix: np.ndarray) -> float:
    """Mean over layers of max / mean of the rank loads `load @ matrix` ([L, E] @ [E, N])."""
    return float(max_over_mean(load @ matrix).mean())


def _mean_step_imbalance(rows: np.ndarray, matrix: np.ndarray) -> float:
    """Mean over layers of `step_imbalance` of `rows @ matrix` ([S, L, E] @ [E, N])."""
    return float(step_imbalance(rows @ matrix).mean())


@dataclass
class PlanChoice:
    """What `plan` chose for one slot table (the shared one or one layer's).

    Attributes:
        slots: the chosen N lists of expert ids.
        kind: "replicate-and-pack" (steps 1-2), "baseline" (the baseline unchanged) or
            "baseline+replicas" (the baseline with replicas added where they lower the
            objective).
        improved: whether the objective is lower than the baseline's.
        num_redundant_requested: R asked for; num_redundant: replicas the slots hold beyond
            one per expert (<= max(R, the baseline's)).
        imbalance_before / imbalance_after: the objective (mean over layers of the whole-load
            rank max / mean) of the baseline and of `slots`.
        step_imbalance_before / step_imbalance_after: the same of the per-row view (mean over
            layers of the mean over rows of max / mean), None without per-row counts.
    """

    slots: Slots
    kind: str
    improved: bool
    num_redundant_requested: int
    num_redundant: int
    imbalance_before: float
    imbalance_after: float
    step_imbalance_before: float | None = None
    step_imbalance_after: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["slots"] = [list(map(int, s)) for s in self.slots]
        return out


#: Relative margin below which two objective values count as equal (float noise).
_EPS = 1e-12


def _baseline_with_replicas(
    load: np.ndarray,
    rows: np.ndarray | None,
    baseline: Slots,
    num_redundant: int,
) -> Slots:
    """The baseline plus replicas in rounds of one per rank (ranks keep equal slot counts), at
    most `num_redundant` replicas in all counting the baseline's own; each slot of a round
    takes the (rank, expert) pair that lowers the objective most, and a round is kept only if
    it lowers the mean whole-load rank max / mean (and does not raise the per-row one).

    Args:
        load: [L, E] float64; rows: [S, L, E] float64 or None; baseline: N lists of experts.
    """
    num_experts = load.shape[1]
    ep_size = len(baseline)
    slots = [list(s) for s in baseline]
    layer_mean = load.sum(axis=1) / ep_size  # [L]
    ran = layer_mean > 0
    if not ran.any() or ep_size == 1:
        return slots
    while sum(len(s) for s in slots) - num_experts + ep_size <= num_redundant:
        matrix = share_matrix(slots, num_experts)
        before = _mean_imbalance(load, matrix)
        step_before = None if rows is None else _mean_step_imbalance(rows, matrix)
        trial = [list(s) for s in slots]
        for _ in range(ep_size):
            holders = np.zeros((num_experts, ep_size), dtype=bool)
            for r, rank_slots in enumerate(trial):
                holders[rank_slots, r] = True
            copies = holders.sum(axis=1)  # [E]
            rank_load = load @ share_matrix(trial, num_experts)  # [L, N]
            # expert e gains a replica: its holders each give up load/(c(c+1)), the new one
            # takes load/(c+1); the layer means are unchanged
            give = load / (copies * (copies + 1))  # [L, E]
            take = load / (copies + 1)  # [L, E]
            after = rank_load[None] - give.T[:, :, None] * holders[:, None, :]  # [E, L, N]
            # the largest and second largest rank load of each (e, l): the peak without rank r
            top2 = np.sort(after, axis=2)[:, :, -2:]  # ep_size >= 2 here
            top_rank = after.argmax(axis=2)  # [E, L]
            best: tuple[float, int, int] | None = None
            for r in range(ep_size):
                if len(trial[r]) > len(slots[r]):
                    continue  # this rank already took its replica this round
                others = np.where(top_rank == r, top2[:, :, 0], top2[:, :, 1])  # [E, L]
                peak = np.maximum(others, after[:, :, r] + take.T)  # [E, L]
                score = (peak[:, ran] / layer_mean[ran]).mean(axis=1)  # [E]
                score[holders[:, r]] = np.inf
                e = int(np.argmin(score))
                if np.isfinite(score[e]) and (best is None or score[e] < best[0]):
                    best = (float(score[e]), r, e)
            if best is None:
                return slots  # some rank holds every expert already
            trial[best[1]].append(best[2])
        matrix = share_matrix(trial, num_experts)
        if _mean_imbalance(load, matrix) >= before * (1 - _EPS):
            break
        if rows is not None and _mean_step_imbalance(rows, matrix) > step_before * (1 + _EPS):
            break
        slots = trial
    return slots


def plan(
    load: np.ndarray,
    ep_size: int,
    num_redundant: int,
    baseline: Slots | None = None,
    rows: np.ndarray | None = None,
) -> PlanChoice:
    """One slot table that is never predicted worse than `baseline` (module docstring, step 4).

    Args:
        load: [L, E] (or [E]) tokens per (layer and) expert, e.g. a trace's summed counts.
        ep_size: N ranks; num_redundant: R extra replicas at most; (E + R) % N must be 0.
        baseline: the layout served now (default: contiguous; when N does not divide E there
            is none and replicate-and-pack is returned as is).
        rows: optional [S, L, E] per-row counts (a trace's); then the per-row (per-step) mean
            imbalance may not get worse either.

    Returns:
        The choice: replicate-and-pack with R redundant experts when it beats the baseline on
        both views; else the candidate with the lowest objective among replicate-and-pack with
        R - N, R - 2N, ... redundant experts (each only if it beats the baseline on both views)
        and the baseline with replicas where they help; ties go to the baseline side.

    Raises:
        PlacementError: see `replica_counts` and `pack_replicas`; a baseline with another
            number of experts or ranks.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 1:
        load = load[None]
    if rows is not None:
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim == 2:
            rows = rows[None]
        if rows.shape[1:] != load.shape:
            raise PlacementError(f"rows have shape {rows.shape}, the load {load.shape}")
    num_experts = load.shape[1]
    greedy = plan_slots(load, ep_size, num_redundant)  # raises on an impossible request
    if baseline is not None:
        baseline = [list(map(int, s)) for s in baseline]
    else:
        try:
            baseline = contiguous_slots(num_experts, ep_size)
        except PlacementError:
            baseline = None
    if baseline is None:
        return PlanChoice(
            greedy, "replicate-and-pack", True, num_redundant, num_redundant,
            float("nan"), _mean_imbalance(load, share_matrix(greedy, num_experts)),
        )
    if len(baseline) != ep_size:
        raise PlacementError(f"the baseline has {len(baseline)} ranks, the plan {ep_size}")
    base_matrix = share_matrix(baseline, num_experts)
    base = _mean_imbalance(load, base_matrix)
    base_step = None if rows is None else _mean_step_imbalance(rows, base_matrix)

    def scored(slots: Slots, kind: str) -> PlanChoice:
        matrix = share_matrix(slots, num_experts)
        return PlanChoice(
            slots=[sorted(s) if kind == "replicate-and-pack" else list(s) for s in slots],
            kind=kind,
            improved=False,
            num_redundant_requested=num_redundant,
            num_redundant=sum(len(s) for s in slots) - num_experts,
            imbalance_before=base,
            imbalance_after=_mean_imbalance(load, matrix),
            step_imbalance_before=base_step,
            step_imbalance_after=None if rows is None else _mean_step_imbalance(rows, matrix),
        )

    def beats_baseline(choice: PlanChoice) -> bool:
        step_ok = rows is None or choice.step_imbalance_after <= base_step * (1 + _EPS)
        return choice.imbalance_after < base * (1 - _EPS) and step_ok

    full = scored(greedy, "replicate-and-pack")
    if beats_baseline(full):
        full.improved = True
        return full
    kept = scored(_baseline_with_replicas(load, rows, baseline, num_redundant), "baseline")
    if kept.slots != baseline:
        kept.kind = "baseline+replicas"
    candidates = [kept]
    for r in range(num_redundant - ep_size, -1, -ep_size):
        choice = scored(plan_slots(load, ep_size, r), "replicate-and-pack")
        if beats_baseline(choice):
            candidates.append(choice)
    best = min(candidates, key=lambda c: c.imbalance_after)  # first (baseline side) on ties
    best.improved = best.imbalance_after < base * (1 - _EPS)
    return best


@dataclass
class PlanResult:
    """`plan_placement_result`'s answer: the placement and what was chosen, and why.

    Attributes:
        placement: the planned placement (shared slots, plus per-layer ones when asked).
        shared: the choice for the shared slots (what moe-serve serves).
        layers: the choice per decoder layer (empty unless per_layer).
    """

    placement: Placement
    shared: PlanChoice
    layers: dict[int, PlanChoice] = field(default_factory=dict)


def plan_placement_result(
    loads: np.ndarray,
    ep_size: int,
    num_redundant: int,
    moe_layers: list[int] | None = None,
    per_layer: bool = False,
    baseline: Placement | None = None,
    rows: np.ndarray | None = None,
) -> PlanResult:
    """Plan a placement from per-layer loads, never predicted worse than `baseline` (`plan`).

    Args:
        loads: [L, E] tokens per MoE layer and expert (e.g. a trace's summed counts).
        ep_size: N ranks; num_redundant: R extra replicas at most; (E + R) % N must be 0.
        moe_layers: decoder-layer indices of the L rows (keys of `layers`); default 0..L-1.
        per_layer: also plan every layer on its own load (against the baseline's slots for
            that layer).
        baseline: the placement served now (default contiguous); its shared slots are the
            baseline of the shared plan.
        rows: optional [S, L, E] per-row counts; see `plan`.

    Raises:
        PlacementError: see `replica_counts`, `pack_replicas` and `plan`.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 1:
        loads = loads[None]
    if rows is not None:
        rows = np.asarray(rows, dtype=np.float64)
    layers = list(range(len(loads))) if moe_layers is None else list(moe_layers)
    if baseline is not None and baseline.num_experts != loads.shape[1]:
        raise PlacementError(
            f"the baseline has {baseline.num_experts} experts, the load {loads.shape[1]}"
        )
    shared = plan(
        loads, ep_size, num_redundant, None if baseline is None else baseline.slots, rows
    )
    result = PlanResult(Placement(loads.shape[1], shared.slots), shared)
    if per_layer:
        for i, layer in enumerate(layers):
            result.layers[int(layer)] = plan(
                loads[i : i + 1],
                ep_size,
                num_redundant,
                None if baseline is None else baseline.slots_for(int(layer)),
                None if rows is None else rows[:, i : i + 1],
            )
        result.placement.layers = {k: v.slots for k, v in result.layers.items()}
    return result


def plan_placement(
    loads: np.ndarray,
    ep_size: int,
    num_redundant: int,
    moe_layers: list[int] | None = None,
    per_layer: bool = False,
    baseline: Placement | None = None,
    rows: np.ndarray | None = None,
) -> Placement:
    """The placement of `plan_placement_result` (same arguments and errors)."""
    return plan_placement_result(
        loads, ep_size, num_redundant, moe_layers, per_layer, baseline, rows
    ).placement
