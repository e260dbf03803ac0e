"""The EPLB decision and its driver on synthetic counts (no model, no processes).

`FakeMover` below is a minimal local stand-in for `moe_engine.eplb.mover.ExpertMover` (its
interface: begin / busy / step / commit -> MoveStats); it records the calls and finishes a
move after a set number of steps. The engine uses the real mover.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from comm import ExpertPlacement
from moe_engine.core.eplb_stats import EplbStats, merge_eplb_stats
from moe_engine.eplb.controller import EplbController
from moe_engine.eplb.policy import (
    MIN_GAIN,
    align_slots,
    decide,
    experts_to_move,
    predicted_rank_load,
    rank_balancedness,
)
from moe_engine.startup.config import EplbConfig

E, N, L = 8, 2, 3


def skewed_load(hot: tuple[int, ...] = (0, 1), scale: int = 50, seed: int = 0) -> np.ndarray:
    """[L, E] pairs: experts in `hot` get `scale` times the others' load."""
    rng = np.random.default_rng(seed)
    load = rng.integers(10, 20, size=(L, E))
    load[:, list(hot)] *= scale
    return load


# ------------------------------------------------------------------ policy


def test_balancedness_is_per_layer_mean_over_max_then_mean_over_layers() -> None:
    # vLLM#36304's example: a constant 2x skew is 0.75, not 1.0
    assert rank_balancedness(np.array([[100, 200], [100, 200]])) == pytest.approx(0.75)
    assert rank_balancedness(np.array([[100, 100], [0, 0]])) == 1.0  # idle layer left out
    assert rank_balancedness(np.zeros((2, 2))) == 1.0


def test_replicas_share_their_experts_load() -> None:
    load = np.array([[40, 0, 0, 0]])
    shared = predicted_rank_load(load, [[0, 1], [0, 2], [3, 0]])
    assert shared == pytest.approx(np.full((1, 3), 40 / 3))


def test_skewed_load_gets_a_better_placement_with_slots_per_rank_kept() -> None:
    current = ExpertPlacement(E, N, [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]])
    decision = decide(skewed_load(), current, threshold=0.95)
    assert decision.reason == "rebalance" and decision.placement is not None
    assert decision.balancedness_after >= decision.balancedness_before + MIN_GAIN
    assert decision.placement.num_local_experts == current.num_local_experts
    assert decision.experts_to_move == experts_to_move(current.slots, decision.placement.slots)
    # both hot experts end up replicated (the redundant slots go to the load)
    held = [sum(e in row for row in decision.placement.slots) for e in range(E)]
    assert held[0] == 2 and held[1] == 2


def test_no_move_when_balanced_idle_or_already_best() -> None:
    contiguous = ExpertPlacement.contiguous(E, N)
    even = np.full((L, E), 10)
    assert decide(even, contiguous, 0.95).reason == "balanced"
    assert decide(np.zeros((L, E)), contiguous, 1.0).reason == "no load"
    first = decide(skewed_load(), contiguous, 1.0)
    assert first.placement is not None
    again = decide(skewed_load(), first.placement, 1.0)
    assert again.placement is None and again.reason == "no better placement"


def test_threshold_below_balancedness_keeps_the_placement() -> None:
    contiguous = ExpertPlacement.contiguous(E, N)
    load = skewed_load()
    before = decide(load, contiguous, 1.0).balancedness_before
    assert decide(load, contiguous, before).reason == "balanced"
    assert decide(load, contiguous, before + 1e-6).reason == "rebalance"


def test_align_keeps_experts_in_place_and_renames_ranks() -> None:
    old = [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the same split with the ranks swapped and the slots shuffled: nothing moves
    assert align_slots(old, [[7, 6, 5, 4], [3, 2, 1, 0]]) == old
    aligned = align_slots(old, [[4, 5, 6, 0], [1, 2, 3, 7]])
    assert aligned == [[7, 1, 2, 3], [4, 5, 6, 0]]
    assert experts_to_move(old, aligned) == 2


def test_decision_is_deterministic() -> None:
    current = ExpertPlacement.contiguous(E, N)
    a = decide(skewed_load(seed=3), current, 1.0)
    b = decide(skewed_load(seed=3).copy(), ExpertPlacement.contiguous(E, N), 1.0)
    assert a == b


# ------------------------------------------------------------------ the controller


@dataclass
class MoveStats:
    experts_moved: int
    bytes_sent: int
    bytes_received: int
    transfer_s: float
    commit_s: float
    steps: int


class FakeMover:
    """A stand-in for ExpertMover: a move takes `chunks` calls of step()."""

    def __init__(self, chunks: int = 3) -> None:
        self.chunks, self.calls, self._left = chunks, [], None
        self.moves: list[tuple[ExpertPlacement, ExpertPlacement]] = []

    @property
    def busy(self) -> bool:
        return self._left is not None

    def begin(self, old: ExpertPlacement, new: ExpertPlacement) -> None:
        assert not self.busy
        self.calls.append("begin")
        self.moves.append((old, new))
        self._left = self.chunks

    def step(self) -> bool:
        assert self.busy
        self.calls.append("step")
        self._left -= 1
        return self._left == 0

    def commit(self) -> MoveStats:
        assert self._left == 0
        self.calls.append("commit")
        self._left = None
        old, new = self.moves[-1]
        return MoveStats(experts_to_move(old.slots, new.slots), 1000, 1000, 0.5, 0.1,
                         self.chunks)


def _counts(load: np.ndarray, steps: int) -> torch.Tensor:
    return torch.tensor(load // steps, dtype=torch.int64)


def _rank_pairs(load: np.ndarray, placement: ExpertPlacement, steps: int) -> torch.Tensor:
    return torch.tensor(predicted_rank_load(load // steps, placement.slots).round(),
                        dtype=torch.int64)


def _one_rank(config: EplbConfig, mover: FakeMover, placement: ExpertPlacement,
              committed: list) -> EplbController:
    return EplbController(config, placement, mover, L, all_reduce=lambda t, op: None,
                          on_commit=committed.append)


def test_interval_begin_steps_commit_and_stats() -> None:
    config = EplbConfig(enabled=True, window_steps=4, step_interval=5,
                        balancedness_threshold=1.0)
    mover, committed = FakeMover(chunks=3), []
    start = ExpertPlacement.contiguous(E, N)
    ctl = _one_rank(config, mover, start, committed)
    load = skewed_load()
    for step in range(1, 5):
        ctl.after_step(_counts(load, 4), _rank_pairs(load, ctl.placement, 4))
        assert mover.calls == [] and not ctl.moving, step
    ctl.after_step(_counts(load, 4), _rank_pairs(load, ctl.placement, 4))  # step 5: decide
    assert mover.calls == ["begin"] and ctl.moving and ctl.stats.moving
    for _ in range(2):
        ctl.after_step(_counts(load, 4), None)
    assert mover.calls == ["begin", "step", "step"] and ctl.placement == start
    ctl.after_step(_counts(load, 4), None)  # step 8: the third chunk, then the commit
    assert mover.calls == ["begin", "step", "step", "step", "commit"]
    new = mover.moves[0][1]
    assert ctl.placement == new and committed == [new] and not ctl.moving
    s = ctl.stats
    assert (s.num_rebalances, s.num_decisions, s.last_rebalance_step) == (1, 1, 5)
    record = s.rebalances[0]
    assert (record.step, record.committed_step, record.move_steps) == (5, 8, 3)
    assert record.experts_moved == experts_to_move(start.slots, new.slots) > 0
    assert record.balancedness_after_predicted > record.balancedness_before
    assert record.balancedness_after_measured == -1.0
    # window_steps (4) steps after the commit the new placement's balancedness is measured
    for _ in range(4):
        ctl.after_step(_counts(load, 4), _rank_pairs(load, ctl.placement, 4))
    assert record.balancedness_after_measured == pytest.approx(
        rank_balancedness(predicted_rank_load(load // 4 * 4, new.slots)), abs=0.01)
    assert record.balancedness_after_measured > record.balancedness_before
    # step 15: the same load again: no better placement, no second move
    for _ in range(3):
        ctl.after_step(_counts(load, 4), _rank_pairs(load, ctl.placement, 4))
    assert ctl.stats.num_decisions == 3 and mover.calls.count("begin") == 1


def test_settle_finishes_a_move_at_once() -> None:
    config = EplbConfig(enabled=True, window_steps=2, step_interval=2,
                        balancedness_threshold=1.0)
    mover, committed = FakeMover(chunks=5), []
    ctl = _one_rank(config, mover, ExpertPlacement.contiguous(E, N), committed)
    for _ in range(2):
        ctl.after_step(_counts(skewed_load(), 2), None)
    assert ctl.moving
    ctl.settle()
    assert not ctl.moving and mover.calls[-1] == "commit" and len(committed) == 1


def _run_ranks(local_loads: list[np.ndarray], config: EplbConfig, steps: int,
               perturb: bool = False) -> list[EplbController | BaseException]:
    """One controller per rank in threads, all-reducing through a barrier (a gloo stand-in)."""
    # no abort on a failure (aborting races a peer still leaving its wait): a timeout instead
    barrier = threading.Barrier(len(local_loads), timeout=20)
    slots: list[torch.Tensor | None] = [None] * len(local_loads)

    def make_all_reduce(rank: int):
        def all_reduce(t: torch.Tensor, op: str) -> None:
            slots[rank] = t.clone()
            barrier.wait()
            stacked = torch.stack(slots)  # type: ignore[arg-type]
            result = stacked.sum(0) if op == "sum" else stacked.amax(0)
            barrier.wait()
            if perturb and result.dim() == 2 and rank == 1:
                result[:, :E] = result[:, :E].flip(-1)  # rank 1 sees other data
            t.copy_(result)
        return all_reduce

    results: list = [None] * len(local_loads)

    def run(rank: int) -> None:
        ctl = EplbController(config, ExpertPlacement.contiguous(E, N), FakeMover(2), L,
                             all_reduce=make_all_reduce(rank), rank=rank)
        try:
            for _ in range(steps):
                ctl.after_step(torch.tensor(local_loads[rank]), None)
            results[rank] = ctl
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(local_loads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_ranks_with_different_local_load_decide_the_same() -> None:
    config = EplbConfig(enabled=True, window_steps=3, step_interval=3,
                        balancedness_threshold=1.0)
    # rank 0 routes mostly to expert 0, rank 1 to expert 1: only the sum has both hot
    a, b = skewed_load((0,), seed=1), skewed_load((1,), seed=2)
    ranks = _run_ranks([a, b], config, steps=6)
    assert all(isinstance(r, EplbController) for r in ranks), ranks
    assert ranks[0].placement == ranks[1].placement != ExpertPlacement.contiguous(E, N)
    alone = decide((a + b) * 3, ExpertPlacement.contiguous(E, N), 1.0)
    assert ranks[0].placement == alone.placement


def test_ranks_that_plan_differently_follow_rank_0(caplog) -> None:
    config = EplbConfig(enabled=True, window_steps=3, step_interval=3,
                        balancedness_threshold=1.0)
    a, b = skewed_load((0,), seed=1), skewed_load((1,), seed=2)
    with caplog.at_level("WARNING", logger="moe_engine.eplb.controller"):
        ranks = _run_ranks([a, b], config, steps=6, perturb=True)
    assert all(isinstance(r, EplbController) for r in ranks), ranks
    # rank 1 saw other data and planned otherwise, but both serve rank 0's plan
    expected = decide((a + b) * 3, ExpertPlacement.contiguous(E, N), 1.0).placement
    assert ranks[0].placement == ranks[1].placement == expected
    assert ranks[1].mover.moves[0][1] == expected
    assert "rank 1 planned" in caplog.text and "following rank 0" in caplog.text
    assert ranks[0].stats.rebalances[0].balancedness_before == (
        ranks[1].stats.rebalances[0].balancedness_before)


def test_merge_sums_bytes_and_takes_the_slowest_seconds() -> None:
    config = EplbConfig(enabled=True, window_steps=2, step_interval=2,
                        balancedness_threshold=1.0)
    ctl = _one_rank(config, FakeMover(chunks=1), ExpertPlacement.contiguous(E, N), [])
    for _ in range(3):
        ctl.after_step(_counts(skewed_load(), 2), None)
    one = ctl.snapshot()
    other = EplbStats(**{**{f: getattr(one, f) for f in one.__struct_fields__},
                         "bytes_sent": 7, "transfer_s": 9.0})
    merged = merge_eplb_stats([one, other])
    assert merged.num_rebalances == 1 and merged.bytes_sent == one.bytes_sent + 7
    assert merged.transfer_s == 9.0 and merged.rebalances[0].step == one.rebalances[0].step
