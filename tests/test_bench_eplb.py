"""bench/eplb.py's bookkeeping, without an engine: steps cut from output arrival times, the
rebalance window from polled stats, and rank balancedness of a placement under a load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from eplb import parse_args, rank_balancedness, rebalance_window, step_trace  # noqa: E402


def _arrivals(step_ends: list[float], per_step: int = 3) -> list[float]:
    """Outputs of one step arrive within 0.3 ms of its end."""
    return [end + 1e-4 * i for end in step_ends for i in range(per_step)]


def test_steps_are_cut_at_gaps_and_the_rebalance_step_found():
    # steps of 10 ms, one of 500 ms (the rebalance) ending at 0.55 s
    ends = [0.01 * i for i in range(1, 6)] + [0.55] + [0.55 + 0.01 * i for i in range(1, 5)]
    trace = step_trace(0.0, _arrivals(ends), window=(0.06, 0.52))
    assert trace["num_steps"] == len(ends)
    assert trace["median_step_s"] == pytest.approx(0.01, abs=1e-3)
    assert trace["max_step_s"] == pytest.approx(0.5, abs=1e-3)
    assert trace["max_step_at_s"] == pytest.approx(0.55, abs=1e-3)
    # the 500 ms step ends after the window closed: the first step after it still counts
    assert trace["rebalance_max_step_s"] == pytest.approx(0.5, abs=1e-3)
    assert trace["rebalance_at_s"] == pytest.approx(0.06)


def test_rebalance_window_brackets_the_first_move():
    polls = [(0.0, 0, False), (0.1, 0, False), (0.2, 0, True), (0.3, 1, False), (0.4, 1, False)]
    assert rebalance_window(polls) == (0.1, 0.3)
    assert rebalance_window([(0.0, 0, False), (0.1, 0, False)]) is None
    # committed between two polls without "moving" ever seen
    assert rebalance_window([(0.0, 0, False), (0.1, 1, False)]) == (0.0, 0.1)


def test_rank_balancedness_shares_an_expert_among_its_replicas():
    counts = [[6, 2, 1, 1]]  # one layer, 4 experts
    assert rank_balancedness(counts, [[0, 1], [2, 3]]) == pytest.approx(5 / 8)
    # expert 0 on both ranks: 3 + 1 + 1 against 3 + 2
    assert rank_balancedness(counts, [[0, 2, 3], [0, 1]]) == pytest.approx(1.0)
    assert rank_balancedness([[0, 0, 0, 0]], [[0, 1], [2, 3]]) == 1.0


def test_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--arms", "off,fast"])
    assert "fast" in capsys.readouterr().err
