"""Trace files (round trip, aggregation, validation errors) and the recorder's per-step view."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.skew.trace import (
    FORMAT_VERSION,
    ExpertTrace,
    TraceFormatError,
    TraceWriter,
    read_trace,
    write_trace,
)
from moe_engine.skew.zipf import ZipfRouter, zipf_probs, zipf_trace


def _random_steps(rng: np.random.Generator, steps: int, layers: int, experts: int, ranks: int):
    counts = rng.integers(0, 50, size=(steps, layers, experts))
    rank_tokens = rng.integers(0, 30, size=(steps, layers, ranks))
    times = rng.uniform(0.01, 0.2, size=steps)
    tokens = rng.integers(1, 100, size=steps)
    return counts, rank_tokens, times, tokens


@pytest.mark.parametrize("aggregate", [1, 3])
def test_writer_round_trip_with_aggregation(tmp_path, aggregate):
    rng = np.random.default_rng()
    counts, rank_tokens, times, tokens = _random_steps(rng, 7, 3, 8, 2)
    path = tmp_path / "t.npz"
    meta = dict(model="m", top_k=2, placement=None)
    with TraceWriter(path, [1, 3, 5], 8, ep_size=2, meta=meta, aggregate_steps=aggregate) as w:
        for i in range(7):
            # torch input for some steps: the engine hands device tensors
            c = torch.from_numpy(counts[i]) if i % 2 else counts[i]
            w.add_step(c, times[i], int(tokens[i]), rank_tokens=rank_tokens[i])
    trace = read_trace(path)
    rows = -(-7 // aggregate)
    assert trace.counts.shape == (rows, 3, 8) and trace.counts.dtype == np.int32
    for r in range(rows):
        sl = slice(r * aggregate, (r + 1) * aggregate)
        np.testing.assert_array_equal(trace.counts[r], counts[sl].sum(axis=0))
        np.testing.assert_array_equal(trace.rank_tokens[r], rank_tokens[sl].sum(axis=0))
        assert trace.step_time_s[r] == pytest.approx(times[sl].sum())
        assert trace.num_tokens[r] == tokens[sl].sum()
        assert trace.num_steps[r] == len(times[sl])
    assert trace.moe_layers.tolist() == [1, 3, 5]
    assert trace.meta["model"] == "m" and trace.meta["num_experts"] == 8
    assert trace.meta["ep_size"] == 2 and trace.meta["aggregate_steps"] == aggregate
    np.testing.assert_array_equal(trace.total_counts(), counts.sum(axis=0))
    # plain numpy reads it without pickle
    with np.load(path, allow_pickle=False) as raw:
        assert int(raw["format_version"]) == FORMAT_VERSION
        assert json.loads(str(raw["meta"]))["top_k"] == 2


def test_writer_rejects_bad_shapes_and_use_after_close(tmp_path):
    w = TraceWriter(tmp_path / "t.npz", [0, 1], 4, ep_size=2)
    with pytest.raises(ValueError, match=r"counts has shape \(2, 5\), expected \(2, 4\)"):
        w.add_step(np.zeros((2, 5), np.int32), 0.1, 1)
    w.add_step(np.ones((2, 4), np.int32), 0.1, 1)
    with pytest.raises(ValueError, match="rank_tokens"):
        w.add_step(np.ones((2, 4), np.int32), 0.1, 1, rank_tokens=np.ones((2, 2)))
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.add_step(np.ones((2, 4), np.int32), 0.1, 1)
    assert read_trace(tmp_path / "t.npz").rank_tokens is None


def _save_raw(path, **arrays):
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def _valid_arrays():
    return dict(
        format_version=np.asarray(1),
        moe_layers=np.array([0, 2]),
        counts=np.zeros((3, 2, 4), np.int32),
        step_time_s=np.zeros(3),
        num_tokens=np.zeros(3, np.int64),
        num_steps=np.ones(3, np.int64),
        meta=np.asarray(json.dumps({"num_experts": 4})),
    )


def test_reader_errors_name_the_problem(tmp_path):
    path = tmp_path / "x.npz"
    with pytest.raises(TraceFormatError, match="does not exist"):
        read_trace(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(TraceFormatError, match="not an NPZ"):
        read_trace(path)

    arrays = _valid_arrays()
    _save_raw(path, **arrays)
    assert read_trace(path).num_rows == 3

    _save_raw(path, **{**arrays, "format_version": np.asarray(2)})
    with pytest.raises(TraceFormatError, match="format_version 2.*version 1 only"):
        read_trace(path)
    _save_raw(path, **{k: v for k, v in arrays.items() if k != "format_version"})
    with pytest.raises(TraceFormatError, match="no format_version"):
        read_trace(path)
    _save_raw(path, **{k: v for k, v in arrays.items() if k != "step_time_s"})
    with pytest.raises(TraceFormatError, match=r"lacks required field\(s\) \['step_time_s'\]"):
        read_trace(path)
    _save_raw(path, **{**arrays, "step_time_s": np.zeros(2)})
    with pytest.raises(TraceFormatError, match=r"step_time_s has shape \(2,\), expected \(3,\)"):
        read_trace(path)
    _save_raw(path, **{**arrays, "moe_layers": np.array([2, 0])})
    with pytest.raises(TraceFormatError, match="moe_layers must ascend"):
        read_trace(path)
    _save_raw(path, **{**arrays, "meta": np.asarray(json.dumps({"num_experts": 8}))})
    with pytest.raises(TraceFormatError, match="num_experts is 8 but counts has 4"):
        read_trace(path)
    _save_raw(path, **{**arrays, "rank_tokens": np.zeros((3, 1, 2), np.int32)})
    with pytest.raises(TraceFormatError, match="rank_tokens has shape"):
        read_trace(path)


def test_write_trace_is_atomic_and_validates(tmp_path):
    bad = ExpertTrace(
        moe_layers=np.array([0]),
        counts=np.zeros((2, 1, 4), np.int32),
        step_time_s=np.zeros(3),
        num_tokens=np.zeros(2, np.int64),
        num_steps=np.ones(2, np.int64),
    )
    with pytest.raises(TraceFormatError):
        write_trace(tmp_path / "t.npz", bad)
    assert list(tmp_path.iterdir()) == []


def test_zipf_probabilities_and_topk_ids():
    p = zipf_probs(4, 1.0)
    expected = np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (1 + 1 / 2 + 1 / 3 + 1 / 4)
    np.testing.assert_allclose(p.numpy(), expected)
    np.testing.assert_allclose(zipf_probs(5, 0.0).numpy(), np.full(5, 0.2))
    router = ZipfRouter(num_experts=16, top_k=4, s=1.2, num_layers=3, seed=7)
    ids = router.topk_ids(500, layer=1)
    assert ids.shape == (500, 4) and ids.dtype == torch.int32
    assert ((ids >= 0) & (ids < 16)).all()
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts per token
    counts = torch.bincount(ids.reshape(-1).long(), minlength=16)
    assert int(counts.argmax()) == int(router.hot_order[1, 0])
    # same seed, same draws; permutations differ per layer unless shared
    again = ZipfRouter(num_experts=16, top_k=4, s=1.2, num_layers=3, seed=7)
    assert torch.equal(again.topk_ids(500, layer=1), ids)
    assert not torch.equal(router.hot_order[0], router.hot_order[1])
    shared = ZipfRouter(num_experts=16, top_k=4, s=1.2, num_layers=3, seed=7, shared_hot=True)
    assert torch.equal(shared.hot_order[0], shared.hot_order[2])
    with pytest.raises(ValueError, match="top_k"):
        ZipfRouter(num_experts=4, top_k=5, s=1.0)


def test_zipf_trace_shape_and_totals():
    trace, router = zipf_trace(5, 2, 16, 4, 1.2, tokens_per_step=32, seed=1)
    trace.validate()
    assert trace.counts.shape == (5, 2, 16)
    assert (trace.counts.sum(axis=2) == 32 * 4).all()
    assert trace.meta["zipf_s"] == 1.2


def test_recorder_step_counts_window_and_rank_tokens():
    rec = ExpertLoadRecorder([1, 3], num_experts=6, ep_size=2, window_steps=2)
    steps = []
    for _ in range(3):
        expected = torch.zeros(2, 6, dtype=torch.int64)
        for row, layer in enumerate([1, 3]):
            ids = torch.randint(0, 6, (int(torch.randint(1, 20, ())), 2), dtype=torch.int32)
            rec.record(layer, ids)
            expected[row] += torch.bincount(ids.reshape(-1).long(), minlength=6)
            rec.record_rank_tokens(layer, torch.tensor([row + 1, 2]))
        step = rec.take_step_counts()
        assert torch.equal(step, expected)
        assert torch.equal(rec.take_step_rank_tokens(), torch.tensor([[1, 2], [2, 2]]))
        steps.append(expected)
    assert rec.num_steps == 3
    assert torch.equal(rec.snapshot(), sum(steps))
    assert torch.equal(rec.window_counts(), steps[1] + steps[2])  # the last 2 steps
    assert torch.equal(rec.take_step_counts(), torch.zeros(2, 6, dtype=torch.int64))
    rec.reset()
    assert rec.snapshot().sum() == 0 and rec.window_counts().sum() == 0 and rec.num_steps == 0
    with pytest.raises(ValueError, match="window_steps"):
        ExpertLoadRecorder([0], 4, window_steps=0)
