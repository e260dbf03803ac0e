"""Imbalance formulas, replicate-and-pack placement, and replay against independent arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from comm.placement import ExpertPlacement
from moe_engine.instrumentation import balancedness, imbalance_ratio
from moe_engine.skew.imbalance import max_over_mean, mean_over_max, rank_loads, replay
from moe_engine.skew.placement import Placement, PlacementError, contiguous_slots
from moe_engine.skew.planner import (
    _make_room,
    pack_replicas,
    plan,
    plan_placement,
    plan_placement_result,
    plan_slots,
    replica_counts,
)
from moe_engine.skew.report import LoadData, build_report
from moe_engine.skew.zipf import ZipfRouter, zipf_trace


def test_imbalance_formulas_by_hand():
    table = np.array([[4, 4, 4, 4], [10, 0, 0, 2], [0, 0, 0, 0], [1, 2, 3, 6]])
    assert max_over_mean(table).tolist() == [1.0, 10 / 3, 0.0, 6 / 3]
    assert mean_over_max(table).tolist() == [1.0, 0.3, 0.0, 0.5]
    # the engine's torch versions agree
    assert imbalance_ratio(torch.from_numpy(table)).tolist() == max_over_mean(table).tolist()
    assert balancedness(torch.from_numpy(table)).tolist() == mean_over_max(table).tolist()


def test_rank_view_by_hand():
    # 4 experts on 2 ranks; experts 0 and 2 replicated on both ranks
    placement = Placement(4, [[0, 1, 2], [0, 3, 2]])
    with pytest.raises(PlacementError, match="the load has 5 experts, the placement 4"):
        rank_loads(np.zeros((1, 5)), placement, [0])
    counts = np.array([[8, 3, 2, 1]])
    # rank 0: 8/2 + 3 + 2/2 = 8; rank 1: 8/2 + 1 + 2/2 = 6
    assert rank_loads(counts, placement, [0]).tolist() == [[8.0, 6.0]]
    report = build_report(LoadData([0], counts[None], ep_size=2, placement=placement))
    row = report.layers[0]
    assert row.rank_imbalance == pytest.approx(8 / 7)
    assert row.rank_balancedness == pytest.approx(7 / 8)
    assert row.expert_imbalance == pytest.approx(8 / 3.5)
    assert row.straggler_rank == 0 and row.straggler_share == pytest.approx(8 / 14)
    assert row.hottest == [(0, 8 / 14), (1, 3 / 14), (2, 2 / 14)]


def test_time_lost_estimate_by_hand():
    # two rows, one layer, contiguous on 2 ranks (experts 0,1 | 2,3)
    counts = np.array([[[6, 0, 2, 0]], [[1, 1, 1, 1]]])
    data = LoadData(
        [5], counts, ep_size=2, step_time_s=np.array([0.3, 0.1]), num_steps=np.array([2, 2])
    )
    report = build_report(data, moe_time_share=0.4)
    # mean step 0.1 s; row balancedness 4/6 and 1 -> mean 5/6; lost = 0.1 * 0.4 / 1 * (1/6)
    assert report.layers[0].step_rank_balancedness == pytest.approx(5 / 6)
    assert report.layers[0].lost_s_per_step == pytest.approx(0.1 * 0.4 / 6)
    assert report.summary["lost_fraction_of_step"] == pytest.approx(0.4 / 6)
    assert report.summary["moe_time_share_source"] == "given"
    no_times = build_report(LoadData([5], counts, ep_size=2))
    assert no_times.layers[0].lost_s_per_step is None


def test_replica_counts_by_hand():
    assert replica_counts(np.array([10, 6, 3, 1]), 2, 2).tolist() == [2, 2, 1, 1]
    # expert 0 capped at 2 replicas (2 ranks); ties go to the lower id
    assert replica_counts(np.array([10, 1, 1, 1]), 3, 2).tolist() == [2, 2, 2, 1]
    assert replica_counts(np.array([5, 4]), 0, 4).tolist() == [1, 1]
    with pytest.raises(PlacementError, match="cannot be placed"):
        replica_counts(np.array([1, 1]), 3, 2)


def test_pack_by_hand():
    # shares: e0 5, 5; e1 3, 3; e2 3; e3 1 -> r0 {0,1,2} = 11, r1 {0,1,3} = 9
    slots = pack_replicas(np.array([10, 6, 3, 1]), np.array([2, 2, 1, 1]), 2)
    assert slots == [[0, 1, 2], [0, 1, 3]]
    with pytest.raises(PlacementError, match="multiple of ep_size"):
        pack_replicas(np.ones(3), np.ones(3, dtype=np.int64), 2)


def test_make_room_moves_an_expert_instead_of_doubling_one():
    slots = [[4], [1, 2], [3, 0]]  # only rank 0 has room, and it holds expert 4 already
    loads = np.array([[1.0, 2.0, 2.0]])  # [L, N]
    share = np.ones((1, 5))  # [L, E]
    rank = _make_room(slots, loads, share, 4, 0)
    assert rank in (1, 2) and len(slots[rank]) == 1 and len(slots[0]) == 2
    slots[rank].append(4)
    ExpertPlacement(5, 3, slots)  # valid: no expert twice on a rank, all present
    assert loads.tolist() == ([[2.0, 1.0, 2.0]] if rank == 1 else [[2.0, 2.0, 1.0]])


def test_random_plans_are_valid_engine_placements():
    rng = np.random.default_rng()
    for _ in range(100):
        n = int(rng.integers(1, 6))
        e = n * int(rng.integers(1, 6))
        r = n * int(rng.integers(0, 3))
        if r > e * (n - 1):
            continue
        load = rng.pareto(1.0, size=e) * rng.integers(0, 2, size=e)
        slots = plan_placement(load, n, r).slots
        placement = ExpertPlacement(e, n, slots)  # raises on any invalid table
        used = sum(len(s) for s in slots) - e  # at most r; fewer when more do not help
        assert 0 <= used <= r and placement.num_local_experts == (e + used) // n
        if load.sum() > 0:
            before = _independent_rank_imbalance(dict(slots=contiguous_slots(e, n)), load[None])
            after = _independent_rank_imbalance(dict(slots=slots), load[None])
            assert after[0] <= before[0] + 1e-12


def _by_hand(load: list[float], slots: list[list[int]]) -> float:
    return _independent_rank_imbalance(dict(slots=slots), np.array([load]))[0]


def test_plan_is_never_worse_than_the_baseline_by_hand():
    # contiguous ep 2 is already even (36 | 36); replicate-and-pack with 2 replicas is not
    load = [8, 8, 8, 12, 10, 8, 10, 8]
    greedy = plan_slots(np.array(load), 2, 2)
    assert _by_hand(load, greedy) == pytest.approx(37 / 36)  # what the old planner returned
    choice = plan(np.array(load), 2, 2)
    assert (choice.kind, choice.improved, choice.num_redundant) == ("baseline", False, 0)
    assert choice.slots == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert choice.imbalance_before == choice.imbalance_after == 1.0
    # contiguous 15 | 18 (1.0909); replicate-and-pack ties it (18 | 15), but one replica of
    # expert 2 on rank 0 and one of expert 1 on rank 1 even it out: 16.5 | 16.5
    load = [9, 6, 9, 9]
    assert _by_hand(load, plan_slots(np.array(load), 2, 2)) == pytest.approx(18 / 16.5)
    choice = plan(np.array(load), 2, 2)
    assert (choice.kind, choice.improved, choice.num_redundant) == ("baseline+replicas", True, 2)
    assert choice.slots == [[0, 1, 2], [2, 3, 1]]  # the baseline's slots stay where they were
    assert _by_hand(load, choice.slots) == choice.imbalance_after == 1.0
    # a skewed load: replicate-and-pack with every replica, as before
    load = [11, 4, 2, 4]
    choice = plan(np.array(load), 2, 2)
    assert (choice.kind, choice.improved, choice.num_redundant) == ("replicate-and-pack", True, 2)
    assert choice.slots == plan_slots(np.array(load), 2, 2)
    assert choice.imbalance_after == pytest.approx(_by_hand(load, choice.slots))
    assert choice.imbalance_after < choice.imbalance_before == 15 / 10.5
    # the baseline is the one given (the trace's placement), not contiguous: against
    # contiguous (20 | 2) the replicated plan (11 | 11) would win; against [[0, 2], [1, 3]]
    # (11 | 11 already) it does not, and the given layout is kept
    load = [10, 10, 1, 1]
    given = Placement(4, [[0, 2], [1, 3]])
    result = plan_placement_result(np.array([load]), 2, 2, baseline=given)
    assert (result.shared.kind, result.shared.improved) == ("baseline", False)
    assert result.placement.slots == given.slots
    assert plan_placement_result(np.array([load]), 2, 2).shared.kind == "replicate-and-pack"


def test_nearly_balanced_traces_never_get_worse():
    """Uniform routing (Zipf s = 0): the old planner made ~1 in 10 of these worse."""
    for _ in range(10):
        trace, _ = zipf_trace(20, 4, 16, 2, 0.0, tokens_per_step=64,
                              seed=int(np.random.randint(1e6)))
        layers = trace.moe_layers.tolist()
        totals = trace.total_counts()
        result = plan_placement_result(totals, 2, 4, layers, per_layer=True, rows=trace.counts)
        obj = result.placement.to_json()
        before = np.mean(_independent_rank_imbalance(dict(slots=contiguous_slots(16, 2)), totals))
        after = np.mean(_independent_rank_imbalance(obj, totals))
        assert after <= before + 1e-12
        assert result.shared.imbalance_after == pytest.approx(after)
        assert result.shared.imbalance_before == pytest.approx(before)
        replayed = replay(trace.counts, layers, Placement(16, result.placement.slots))
        assert replayed.step_imbalance_after.mean() <= replayed.step_imbalance_before.mean() + 1e-12
        for i, layer in enumerate(layers):  # each per-layer plan against its own layer
            row = totals[i : i + 1]
            mine = _independent_rank_imbalance(dict(slots=result.placement.layers[layer]), row)
            base = _independent_rank_imbalance(dict(slots=contiguous_slots(16, 2)), row)
            assert mine[0] <= base[0] + 1e-12
        ExpertPlacement.from_dict(obj)


def _independent_rank_imbalance(placement_json: dict, counts: np.ndarray) -> list[float]:
    """max/mean of rank loads per layer, by loops over the JSON slots (no planner code)."""
    slots = placement_json["slots"]
    copies: dict[int, int] = {}
    for rank in slots:
        for expert in rank:
            copies[expert] = copies.get(expert, 0) + 1
    out = []
    for layer_counts in counts:
        loads = [sum(layer_counts[e] / copies[e] for e in rank) for rank in slots]
        out.append(max(loads) / (sum(loads) / len(loads)))
    return out


def test_zipf_plan_lowers_predicted_rank_imbalance(tmp_path):
    trace, _ = zipf_trace(40, 4, 64, 8, 1.2, tokens_per_step=64, seed=int(np.random.randint(1e6)))
    layers = trace.moe_layers.tolist()
    placement = plan_placement(trace.total_counts(), 4, 8, layers)
    path = tmp_path / "placement.json"
    placement.save(path)
    obj = json.loads(path.read_text())
    assert set(obj) == {"version", "num_experts", "ep_size", "slots"}
    engine_view = ExpertPlacement.load(path)
    assert engine_view.ep_size == 4 and engine_view.num_local_experts == 18
    result = replay(trace.counts, layers, placement)
    totals = trace.total_counts()
    np.testing.assert_allclose(result.imbalance_after, _independent_rank_imbalance(obj, totals))
    contiguous = dict(slots=contiguous_slots(64, 4))
    np.testing.assert_allclose(
        result.imbalance_before, _independent_rank_imbalance(contiguous, totals)
    )
    # one shared placement for layers with different hot experts: every layer improves
    assert (result.imbalance_after < result.imbalance_before).all()
    assert result.imbalance_after.mean() < 1.1 < result.imbalance_before.mean()
    assert result.step_imbalance_after.mean() < result.step_imbalance_before.mean()
    # packing on the summed load only (one "layer") levels the sum, not each layer
    summed_only = replay(trace.counts, layers, plan_placement(totals.sum(axis=0), 4, 8))
    assert summed_only.imbalance_after.mean() > result.imbalance_after.mean()
    # planned per layer: every layer improves, to near balance
    per_layer = plan_placement(totals, 4, 8, layers, per_layer=True)
    per_result = replay(trace.counts, layers, per_layer)
    assert (per_result.imbalance_after < per_result.imbalance_before).all()
    assert (per_result.imbalance_after < 1.05).all()
    assert Placement.from_json(per_layer.to_json()).layers.keys() == set(layers)
    ExpertPlacement.from_dict(per_layer.to_json())  # the engine still reads "slots"


def test_shared_hot_experts_every_layer_improves():
    trace, _ = zipf_trace(30, 3, 64, 8, 1.2, seed=int(np.random.randint(1e6)), shared_hot=True)
    layers = trace.moe_layers.tolist()
    result = replay(trace.counts, layers, plan_placement(trace.total_counts(), 4, 8, layers))
    assert (result.imbalance_after < result.imbalance_before).all()
    assert result.imbalance_after.max() < 1.1


def test_engine_routing_matches_the_replay_prediction():
    """Route Zipf tokens through ExpertPlacement.route from 4 source ranks: pairs per
    destination rank equal the planner's even-share prediction up to per-source rounding."""
    router = ZipfRouter(num_experts=64, top_k=8, s=1.2, seed=int(np.random.randint(1e6)))
    ids = [router.topk_ids(300) for _ in range(4)]  # one batch per source rank
    counts = sum(torch.bincount(x.reshape(-1).long(), minlength=64) for x in ids).numpy()
    placement = plan_placement(counts, 4, 8)
    engine = ExpertPlacement(64, 4, placement.slots)
    measured = np.zeros(4)
    for src, batch in enumerate(ids):
        dest, _ = engine.route(batch, src_rank=src)
        measured += np.bincount(dest.reshape(-1).numpy(), minlength=4)
    predicted = rank_loads(counts[None], placement, [0])[0]
    replicated = [e for e in range(64) if len(engine.replicas(e)) > 1]
    # each source splits an expert's pairs within one of even: |error| <= sources * replicated
    assert np.abs(measured - predicted).max() <= 4 * len(replicated)
    assert measured.sum() == counts.sum()


def test_placement_file_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(PlacementError, match="cannot read placement"):
        Placement.load(path)
    path.write_text(json.dumps(dict(version=2, num_experts=2, ep_size=1, slots=[[0, 1]])))
    with pytest.raises(PlacementError, match="unsupported version 2"):
        Placement.load(path)
    path.write_text(json.dumps(dict(version=1, num_experts=3, ep_size=2, slots=[[0, 0], [1, 2]])))
    with pytest.raises(PlacementError, match="more than once"):
        Placement.load(path)
    ok = dict(version=1, num_experts=2, ep_size=2, slots=[[0], [1]], layers={"x": [[0], [1]]})
    path.write_text(json.dumps(ok))
    with pytest.raises(PlacementError, match="not a layer index"):
        Placement.load(path)
