"""Per-group routing load: the recorder's and the trace's group layout, `moe-skew report`'s
per-group table on a 256-expert, 8-group synthetic trace (DeepSeek-V3's shape), a live server
with --n-group, and the refusals."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from moe_engine.cli.skew import main
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.skew.groups import GroupLoad, group_load
from moe_engine.skew.report import LoadData, build_report
from moe_engine.skew.trace import TraceFormatError, read_trace, write_trace
from moe_engine.skew.zipf import zipf_trace


def test_group_load_on_a_hand_made_layer():
    pairs = np.array([5, 1, 0, 0, 2, 2, 6, 0])  # 4 groups of 2: 6, 0, 4, 6
    assert group_load(pairs, 4).tolist() == [6, 0, 4, 6]
    load = GroupLoad.of(pairs, 4)
    assert load.hottest_group == 0  # g0 and g3 tie: the lower id
    assert load.hottest_share == pytest.approx(6 / 16)
    assert load.imbalance == pytest.approx(6 / 4) and load.balancedness == pytest.approx(4 / 6)
    idle = GroupLoad.of(np.zeros(8, dtype=np.int64), 2)
    assert (idle.imbalance, idle.balancedness, idle.hottest_share) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"n_group \(3\) .* divide .* \(8\)"):
        group_load(pairs, 3)


def test_recorder_carries_the_group_layout_and_counts_per_group():
    recorder = ExpertLoadRecorder([1, 3], num_experts=16, n_group=4)
    g = torch.Generator().manual_seed(0)
    for layer in (1, 3):
        recorder.record(layer, torch.randint(0, 16, (10, 3), generator=g, dtype=torch.int32))
    counts = recorder.snapshot()
    by_group = recorder.group_counts(counts)
    expected = torch.stack([torch.bincount(torch.arange(16) // 4, weights=row).long()
                            for row in counts])
    assert torch.equal(by_group, expected) and by_group.sum().item() == 2 * 10 * 3
    assert recorder.layout_meta() == {"n_group": 4}
    assert ExpertLoadRecorder([0], 16).layout_meta() == {}
    with pytest.raises(ValueError, match="n_group"):
        ExpertLoadRecorder([0], 16, n_group=5)


@pytest.fixture
def grouped_trace(tmp_path):
    """A Zipf (s = 1.2) trace of 256 experts in 8 groups, top-8, ep 8, three MoE layers."""
    trace, _ = zipf_trace(20, 3, 256, 8, 1.2, tokens_per_step=32, seed=11, ep_size=8, n_group=8)
    path = tmp_path / "grouped.npz"
    write_trace(path, trace)
    return path


def test_report_shows_per_group_load_per_layer(grouped_trace, capsys):
    trace = read_trace(grouped_trace)
    assert trace.meta["n_group"] == 8
    report = build_report(LoadData.from_trace(trace))
    total = trace.total_counts()
    for i, row in enumerate(report.layers):
        per_group = [int(total[i, g * 32 : (g + 1) * 32].sum()) for g in range(8)]
        assert row.groups.pairs == per_group and sum(per_group) == row.tokens
        assert row.groups.hottest_group == int(np.argmax(per_group))
        assert row.groups.imbalance == pytest.approx(max(per_group) / np.mean(per_group))
    assert report.summary["n_group"] == 8
    assert main(["report", str(grouped_trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["groups"]["pairs"] for r in out["layers"]] == [r.groups.pairs for r in report.layers]
    assert main(["report", str(grouped_trace)]) == 0
    text = capsys.readouterr().out
    assert "token-expert pairs per expert group per MoE layer" in text
    assert "group max/mean" in text and "g7" in text
    first = report.layers[0].groups
    assert f"g{first.hottest_group} ({100 * first.hottest_share:.1f}%)" in text
    assert "8 groups of 32 experts" in text


def test_n_group_flag_overrides_and_is_checked(grouped_trace, capsys):
    assert main(["report", str(grouped_trace), "--json", "--n-group", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(len(r["groups"]["pairs"]) == 4 for r in out["layers"])
    assert main(["report", str(grouped_trace), "--n-group", "3"]) == 1
    assert "n_group (3)" in capsys.readouterr().err


def test_a_trace_without_groups_has_no_group_table(tmp_path, capsys):
    trace, _ = zipf_trace(5, 2, 64, 4, 1.0)
    path = tmp_path / "plain.npz"
    write_trace(path, trace)
    assert main(["report", str(path)]) == 0
    assert "per expert group" not in capsys.readouterr().out
    assert build_report(LoadData.from_trace(trace)).layers[0].groups is None


def test_a_trace_whose_n_group_does_not_divide_the_experts_is_refused(tmp_path):
    trace, _ = zipf_trace(2, 1, 64, 4, 1.0)
    trace.meta["n_group"] = 6
    with pytest.raises(TraceFormatError, match="n_group"):
        write_trace(tmp_path / "bad.npz", trace)


class _Servicer(pb_grpc.MoeEngineServicer):
    def __init__(self, counts: list[list[int]]) -> None:
        self.counts = counts

    def GetModelInfo(self, request, context):  # noqa: N802
        return pb.ModelInfo(model="fake", ep_size=1, num_experts=len(self.counts[0]))

    def GetExpertLoad(self, request, context):  # noqa: N802
        layers = [pb.LayerExpertLoad(layer=i, tokens_per_expert=c)
                  for i, c in enumerate(self.counts)]
        return pb.ExpertLoad(layers=layers, ep_size=1)


def test_live_server_report_with_n_group(capsys):
    counts = np.random.default_rng(0).integers(0, 30, size=(2, 16)).tolist()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_MoeEngineServicer_to_server(_Servicer(counts), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["report", "--server", f"127.0.0.1:{port}", "--n-group", "4", "--json"]) == 0
    finally:
        server.stop(None)
    out = json.loads(capsys.readouterr().out)
    expected = [np.asarray(c).reshape(4, 4).sum(axis=1).tolist() for c in counts]
    assert [r["groups"]["pairs"] for r in out["layers"]] == expected
