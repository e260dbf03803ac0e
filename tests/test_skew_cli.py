"""`moe-skew report | plot | plan` in process, a live-server report over gRPC, and the gauges."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_helpers import ServerThread
from grpc_helpers import request as grpc_request
from prometheus_client import generate_latest

from comm.placement import ExpertPlacement
from moe_engine.cli.skew import main
from moe_engine.server.app import ServerOptions
from moe_engine.server.metrics import ServerMetrics
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.skew.trace import TraceWriter, write_trace
from moe_engine.skew.zipf import zipf_trace
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


@pytest.fixture
def biased_trace(tmp_path):
    """A Zipf (s = 1.2, 64 experts, top-8, ep 4) trace whose hot experts differ per layer."""
    trace, router = zipf_trace(
        30, 3, 64, 8, 1.2, tokens_per_step=64, seed=int(np.random.randint(1e6)), ep_size=4
    )
    trace.moe_layers = np.array([1, 3, 5])
    path = tmp_path / "trace.npz"
    write_trace(path, trace)
    return path, trace, router


#: How far a figure printed to 4 decimal places may be from the value it rounds.
PRINTED = 5e-5 + 1e-12

def test_report_names_the_hottest_experts(biased_trace, capsys):
    path, trace, router = biased_trace
    assert main(["report", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in out["layers"]] == [1, 3, 5]
    for i, row in enumerate(out["layers"]):
        totals = trace.counts[:, i].sum(axis=0)
        assert row["hottest"][0]["expert"] == int(router.hot_order[i, 0])
        assert row["hottest"][0]["share"] == pytest.approx(totals.max() / totals.sum())
        assert row["expert_imbalance"] == pytest.approx(totals.max() / totals.mean())
        ranks = totals.reshape(4, 16).sum(axis=1)  # contiguous placement on ep 4
        assert row["rank_imbalance"] == pytest.approx(ranks.max() / ranks.mean())
        assert row["straggler_rank"] == int(ranks.argmax())
        assert row["lost_s_per_step"] > 0
    assert out["summary"]["ep_size"] == 4 and out["summary"]["moe_time_share_source"] == "assumed"

    assert main(["report", str(path), "--top", "2", "--moe-time-share", "0.6"]) == 0
    text = capsys.readouterr().out
    for i, layer in enumerate([1, 3, 5]):
        line = next(ln for ln in text.splitlines() if ln.split()[:1] == [str(layer)])
        assert f"e{int(router.hot_order[i, 0])}:" in line
    assert "MoE share of step 0.60 (given)" in text


def rows_of(text: str, first: str = "mean") -> dict[str, list[float]]:
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and (cells[0].isdigit() or cells[0] == first):
            try:
                rows[cells[0]] = [float(c) for c in cells[1:]]
            except ValueError:
                continue
    return rows


def test_plan_prints_what_an_independent_replay_gives(biased_trace, tmp_path, capsys):
    path, trace, _ = biased_trace
    out_path = tmp_path / "placement.json"
    args = ["plan", str(path), "--ep-size", "4", "--num-redundant-experts", "8"]
    assert main([*args, "-o", str(out_path)]) == 0
    text = capsys.readouterr().out
    placement = json.loads(out_path.read_text())
    assert placement["version"] == 1 and placement["ep_size"] == 4
    assert placement["num_experts"] == 64 and len(placement["slots"]) == 4
    # independent recomputation: loops over the written slots and the trace's counts
    copies: dict[int, int] = {}
    for rank in placement["slots"]:
        for e in rank:
            copies[e] = copies.get(e, 0) + 1
    contiguous = [list(range(16 * r, 16 * (r + 1))) for r in range(4)]
    rows = rows_of(text)
    before_all, after_all = [], []
    for i, layer in enumerate([1, 3, 5]):
        totals = trace.counts[:, i].sum(axis=0)

        def imbalance(totals, slots, share):
            loads = [sum(totals[e] / share[e] for e in rank) for rank in slots]
            return max(loads) / (sum(loads) / len(loads))

        before = imbalance(totals, contiguous, {e: 1 for e in range(64)})
        after = imbalance(totals, placement["slots"], copies)
        before_all.append(before)
        after_all.append(after)
        # printed to 4 places: half a unit of the last, plus float slack (1.15625 prints as
        # 1.1562, 5.0000000000005e-05 away)
        assert rows[str(layer)][0] == pytest.approx(before, abs=PRINTED)
        assert rows[str(layer)][1] == pytest.approx(after, abs=PRINTED)
        assert after < before
    assert rows["mean"][0] == pytest.approx(np.mean(before_all), abs=PRINTED)
    assert rows["mean"][1] == pytest.approx(np.mean(after_all), abs=PRINTED)
    assert f"wrote {out_path}" in text

    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == placement  # deterministic
    got = [(r["imbalance_before"], r["imbalance_after"]) for r in out["replay"]["layers"]]
    np.testing.assert_allclose(got, list(zip(before_all, after_all, strict=True)))

    # --per-layer: the shared plan (what moe-serve serves) is unchanged; per-layer plans extra
    per_path = tmp_path / "per_layer.json"
    assert main([*args, "--per-layer", "--json", "-o", str(per_path)]) == 0
    per = json.loads(capsys.readouterr().out)
    assert per["placement"]["slots"] == placement["slots"]
    assert per["replay"] == out["replay"]
    assert sorted(json.loads(per_path.read_text())["layers"]) == ["1", "3", "5"]
    assert ExpertPlacement.load(per_path).slots == tuple(map(tuple, placement["slots"]))
    for row, shared in zip(per["replay_per_layer"]["layers"], after_all, strict=True):
        assert row["imbalance_after"] < row["imbalance_before"]
        assert row["imbalance_after"] <= shared + 1e-9 or row["imbalance_after"] < 1.01

    # the report under the new placement shows the predicted rank imbalance
    assert main(["report", str(path), "--placement", str(out_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose([r["rank_imbalance"] for r in report["layers"]], after_all)


def test_plan_is_never_worse_than_before_on_nearly_balanced_traces(tmp_path, capsys):
    # contiguous ep 2 is already even (36 | 36); replicate-and-pack with 2 replicas is not
    # (it would print 1.0000 -> 1.0278): the plan says so and keeps the contiguous layout
    path = tmp_path / "even.npz"
    with TraceWriter(path, [3], 8) as writer:
        writer.add_step(np.array([[8, 8, 8, 12, 10, 8, 10, 8]]), 0.01, 9)
    out_path = tmp_path / "placement.json"
    args = ["plan", str(path), "--ep-size", "2", "--num-redundant-experts", "2"]
    assert main([*args, "-o", str(out_path)]) == 0
    text = capsys.readouterr().out
    assert rows_of(text)["mean"] == [1.0, 1.0, 1.0, 1.0]
    assert "no plan with up to 2 redundant experts lowers the predicted imbalance" in text
    assert "keeping the contiguous placement unchanged" in text
    assert json.loads(out_path.read_text())["slots"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the columns are explained above the table and in --help
    assert "step max/mean columns: each trace row's (engine step's) max/mean" in text
    assert "the plan minimises their mean over layers" in text
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "step max/mean columns" in help_text and "never predicted worse" in help_text

    # fresh nearly balanced (uniform-routing) traces: neither printed mean ever gets worse
    kinds = set()
    for _ in range(6):
        trace, _ = zipf_trace(
            20, 4, 16, 2, 0.0, tokens_per_step=64, seed=int(np.random.randint(1e6)), ep_size=2
        )
        write_trace(path, trace)
        assert main([*args[:5], "4", "-o", str(out_path), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        replayed = out["replay"]
        assert replayed["mean_imbalance_after"] <= replayed["mean_imbalance_before"] + 1e-12
        assert (
            replayed["mean_step_imbalance_after"]
            <= replayed["mean_step_imbalance_before"] + 1e-12
        )
        plan = out["plan"]
        assert plan["imbalance_after"] == pytest.approx(replayed["mean_imbalance_after"])
        assert plan["improved"] == (
            replayed["mean_imbalance_after"] < replayed["mean_imbalance_before"]
        )
        placement = ExpertPlacement.load(out_path)  # the engine reads it
        assert placement.num_local_experts == 8 + plan["num_redundant"] // 2
        kinds.add(plan["kind"])
        assert main([*args[:5], "4"]) == 0
        mean = rows_of(capsys.readouterr().out)["mean"]
        assert mean[1] <= mean[0] and mean[3] <= mean[2]
    assert kinds <= {"replicate-and-pack", "baseline", "baseline+replicas"}


def test_report_uses_the_traced_placement_and_rank_tokens(tmp_path, capsys):
    slots = [[0, 1, 2], [0, 3, 2]]  # experts 0 and 2 on both ranks
    meta = dict(model="x", placement=dict(version=1, num_experts=4, ep_size=2, slots=slots))
    path = tmp_path / "t.npz"
    with TraceWriter(path, [0], 4, ep_size=2, meta=meta) as writer:
        for _ in range(3):
            writer.add_step(np.array([[8, 3, 2, 1]]), 0.01, 7, rank_tokens=np.array([[5, 3]]))
    assert main(["report", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["layers"][0]
    assert out["summary"]["placement"] == "explicit"
    assert row["rank_load"] == [24.0, 18.0]  # 3 x (8/2 + 3 + 2/2), 3 x (8/2 + 1 + 2/2)
    assert row["recv_imbalance"] == pytest.approx(15 / 12)
    assert main(["report", str(path)]) == 0
    assert "recv max/mean" in capsys.readouterr().out


def test_plot_writes_a_png(biased_trace, tmp_path, capsys):
    path, _, _ = biased_trace
    png = tmp_path / "skew.png"
    assert main(["plot", str(path), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {png}" in capsys.readouterr().out


def test_errors_and_exit_statuses(biased_trace, tmp_path, capsys):
    path, _, _ = biased_trace
    bad = tmp_path / "bad.npz"
    with open(bad, "wb") as f:
        np.savez_compressed(f, format_version=np.asarray(9))
    assert main(["report", str(bad)]) == 1
    assert "format_version 9" in capsys.readouterr().err
    assert main(["plan", str(path), "--ep-size", "4", "--num-redundant-experts", "3"]) == 1
    assert "multiple of ep_size" in capsys.readouterr().err
    assert main(["report", str(path), "--server", "127.0.0.1:1"]) == 2
    assert main(["report"]) == 2
    assert "exactly one of TRACE or --server" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(path), "--ep-size", "0", "--num-redundant-experts", "1"])
    assert exc.value.code == 2
    assert "--ep-size" in capsys.readouterr().err
    assert main(["report", "--server", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    assert "127.0.0.1:1: " in capsys.readouterr().err  # the server, then the status code
    for argv, flag in (
        (["report", "--server", "127.0.0.1"], "--server"),  # no port: gRPC would use 443
        (["report", "--server", "127.0.0.1:1", "--timeout", "-1"], "--timeout"),
        (["plot", "--server", "127.0.0.1:1", "--timeout", "0", "-o", "x.png"], "--timeout"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and len(err.strip().splitlines()) == 1, err


def test_contiguous_placement_in_the_trace_is_labelled_contiguous(tmp_path, capsys):
    counts = np.array([[9, 1, 4, 2], [3, 3, 1, 5]])
    for slots, label in (
        ([[0, 1], [2, 3]], "contiguous"),  # what moe-serve records for the default layout
        ([[1, 0], [3, 2]], "contiguous"),  # slot order within a rank does not matter
        ([[0, 2], [1, 3]], "explicit"),
    ):
        meta = dict(model="x", placement=dict(version=1, num_experts=4, ep_size=2, slots=slots))
        path = tmp_path / "t.npz"
        with TraceWriter(path, [0, 2], 4, ep_size=2, meta=meta) as writer:
            writer.add_step(counts, 0.01, 5)
        assert main(["report", str(path), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)["summary"]
        assert (summary["placement"], summary["placement_source"]) == (label, "trace")
        assert main(["report", str(path)]) == 0
        assert f"({label} placement, recorded in the trace)" in capsys.readouterr().out


class _LoadServicer(pb_grpc.MoeEngineServicer):
    """GetModelInfo / GetExpertLoad as moe-serve answers them: `slots` is the served
    experts_per_rank ([[]] when no rank context, as a single-rank server sends) and
    `rank_tokens` the measured tokens_per_rank per layer (None: not sent)."""

    def __init__(
        self,
        counts: list[list[int]],
        slots: list[list[int]] | None = None,
        rank_tokens: list[list[int]] | None = None,
    ) -> None:
        self.counts, self.slots, self.rank_tokens = counts, slots, rank_tokens

    def GetModelInfo(self, request, context):  # noqa: N802
        table = self.slots if self.slots is not None else [[]]
        return pb.ModelInfo(
            model="fake", ep_size=2, num_experts=len(self.counts[0]),
            experts_per_rank=[pb.RankExperts(experts=e) for e in table],
        )

    def GetExpertLoad(self, request, context):  # noqa: N802
        layers = []
        for i, c in enumerate(self.counts):
            entry = pb.LayerExpertLoad(layer=2 * i + 1, tokens_per_expert=c)
            if self.rank_tokens is not None:
                ranks = np.array(self.rank_tokens[i], dtype=np.float64)
                entry.tokens_per_rank.extend(self.rank_tokens[i])
                entry.rank_imbalance_ratio = ranks.max() / ranks.mean()
            layers.append(entry)
        return pb.ExpertLoad(layers=layers, ep_size=2)


@pytest.fixture
def fake_server():
    """start(servicer) -> "127.0.0.1:PORT"; every server is stopped at teardown."""
    servers = []

    def start(servicer: _LoadServicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_MoeEngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def test_report_from_a_server_uses_its_placement_and_measured_rank_load(
    fake_server, tmp_path, capsys
):
    rng = np.random.default_rng()
    counts = rng.integers(0, 50, size=(2, 4)).tolist()
    counts[0][0] += 100  # expert 0 hot in layer 1
    slots = [[0, 3, 1], [0, 2, 1]]  # experts 0 and 1 replicated: not the contiguous layout
    # the rank loads the placement predicts (replicas share evenly) ...
    predicted = [
        [c[0] / 2 + c[3] + c[1] / 2, c[0] / 2 + c[2] + c[1] / 2] for c in counts
    ]
    # ... and what the server measured (per-source rounding moves a few pairs)
    measured = [[int(a) + 1, sum(c) - int(a) - 1] for a, c in zip(
        (p[0] for p in predicted), counts, strict=True
    )]
    address = fake_server(_LoadServicer(counts, slots, measured))
    assert main(["report", "--server", address, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["placement"] == "explicit"
    assert out["summary"]["placement_source"] == "server"
    assert out["summary"]["rank_load_source"] == "measured"
    with grpc.insecure_channel(address) as channel:
        load = pb_grpc.MoeEngineStub(channel).GetExpertLoad(pb.GetExpertLoadRequest())
    for row, served, ranks in zip(out["layers"], load.layers, measured, strict=True):
        assert row["rank_imbalance"] == pytest.approx(served.rank_imbalance_ratio)
        assert row["rank_load"] == ranks
        assert row["straggler_rank"] == int(np.argmax(ranks))
    assert main(["report", "--server", address]) == 0
    text = capsys.readouterr().out
    assert "(explicit placement, served by the server)" in text
    assert "(measured by the server)" in text

    # no measured load sent: the served placement's prediction
    address = fake_server(_LoadServicer(counts, slots))
    assert main(["report", "--server", address, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["rank_load_source"] == "predicted"
    for row, ranks in zip(out["layers"], predicted, strict=True):
        assert row["rank_load"] == pytest.approx(ranks)
        assert row["rank_imbalance"] == pytest.approx(max(ranks) / (sum(ranks) / 2))

    # a what-if view is a prediction: another ep size (contiguous there), or --placement
    address = fake_server(_LoadServicer(counts, slots, measured))
    assert main(["report", "--server", address, "--ep-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["placement"] == "contiguous"
    assert out["summary"]["rank_load_source"] == "predicted"
    assert [r["rank_load"] for r in out["layers"]] == [[float(x) for x in c] for c in counts]
    file = tmp_path / "p.json"
    file.write_text(json.dumps(dict(version=1, num_experts=4, ep_size=2, slots=[[0, 1], [2, 3]])))
    assert main(["report", "--server", address, "--placement", str(file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["placement_source"] == "file"
    assert out["summary"]["rank_load_source"] == "predicted"
    for row, c in zip(out["layers"], counts, strict=True):
        assert row["rank_load"] == [c[0] + c[1], c[2] + c[3]]

    # a served table that is not a placement of the model's experts: exit 1, named
    address = fake_server(_LoadServicer(counts, [[0, 1], [1, 2]]))
    assert main(["report", "--server", address]) == 1
    assert "experts_per_rank" in capsys.readouterr().err


def test_report_from_a_live_server(capsys):
    counts = [[30, 2, 1, 7], [1, 1, 1, 9]]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_MoeEngineServicer_to_server(_LoadServicer(counts), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["report", "--server", f"127.0.0.1:{port}", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert main(["report", "--server", f"127.0.0.1:{port}"]) == 0
        text = capsys.readouterr().out
    finally:
        server.stop(None)
    assert out["summary"]["ep_size"] == 2 and out["summary"]["model"] == "fake"
    first, second = out["layers"]
    assert (first["layer"], second["layer"]) == (1, 3)
    assert first["hottest"][0] == dict(expert=0, share=0.75)
    assert first["rank_imbalance"] == pytest.approx(32 / 20)  # ranks {0,1}=32, {2,3}=8
    assert second["straggler_rank"] == 1 and first["lost_s_per_step"] is None
    assert "n/a (no step times in this source)" in text


def test_report_from_a_real_ep_server_equals_its_rank_imbalance(qwen3_ckpt, tmp_path, capsys):
    """moe-serve at ep 2 with a replicated, non-contiguous placement: the report's rank view
    is the served placement and its rank imbalance is the server's rank_imbalance_ratio."""
    slots = [[7, 0, 2, 4, 6], [1, 3, 5, 7, 0]]  # experts 0 and 7 on both ranks
    file = tmp_path / "placement.json"
    file.write_text(json.dumps(dict(version=1, num_experts=8, ep_size=2, slots=slots)))
    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48),
        parallel=ParallelConfig(ep_size=2, collective_timeout_s=60, expert_placement=str(file)),
    )
    rng = np.random.default_rng()
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            for _ in range(2):
                ids = rng.integers(3, 500, size=int(rng.integers(4, 20))).tolist()
                req = grpc_request(ids, max_tokens=4, temperature=0.0, ignore_eos=True)
                list(stub.Generate(req, timeout=120))
            load = stub.GetExpertLoad(pb.GetExpertLoadRequest())
        assert main(["report", "--server", handle.address, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
    finally:
        handle.close()
    assert out["summary"]["placement"] == "explicit"
    assert out["summary"]["placement_source"] == "server"
    assert out["summary"]["rank_load_source"] == "measured"
    assert [r["layer"] for r in out["layers"]] == [x.layer for x in load.layers]
    for row, served in zip(out["layers"], load.layers, strict=True):
        assert row["rank_imbalance"] == pytest.approx(served.rank_imbalance_ratio)
        assert row["rank_load"] == list(served.tokens_per_rank)
        # each rank processed its own experts' pairs and part of the replicated ones'
        counts = list(served.tokens_per_expert)
        assert sum(row["rank_load"]) == sum(counts) > 0
        for rank, rank_slots in enumerate(slots):
            own = sum(counts[e] for e in rank_slots if e not in (0, 7))
            assert own <= row["rank_load"][rank] <= own + counts[0] + counts[7]


def _load(layers, counts, window_counts=(), rank_tokens=None):
    """An ExpertLoad with the tables the gauges read (summaries left empty)."""
    from moe_engine.core.outputs import ExpertLoad

    return ExpertLoad(
        moe_layers=layers, counts=counts, window_counts=list(window_counts),
        window_steps=len(window_counts), imbalance_ratio=[], balancedness=[],
        rank_tokens=rank_tokens,
    )


def test_metrics_gauges_by_layer_and_rank():
    metrics = ServerMetrics()
    metrics.update_from_expert_load(
        _load([1, 3], [[4, 4, 4, 4], [10, 0, 0, 2]], rank_tokens=[[3, 1], [2, 2]])
    )
    text = generate_latest(metrics.registry).decode()

    def value(name: str, layer: int, by: str) -> float:
        key = f'{name}{{by="{by}",layer="{layer}"}} '
        line = next(ln for ln in text.splitlines() if ln.startswith(key))
        return float(line.split()[-1])

    assert value("moe_engine_imbalance_ratio", 1, "expert") == 1.0
    assert value("moe_engine_imbalance_ratio", 3, "expert") == pytest.approx(10 / 3)
    assert value("moe_engine_balancedness", 3, "expert") == pytest.approx(0.3)
    assert value("moe_engine_imbalance_ratio", 1, "rank") == pytest.approx(1.5)
    assert value("moe_engine_balancedness", 1, "rank") == pytest.approx(2 / 3)
    # a recent window, when the core sends one, wins over the totals since startup
    metrics.update_from_expert_load(
        _load([1, 3], [[4, 4, 4, 4]] * 2, window_counts=[[8, 0, 0, 0]] * 2)
    )
    text = generate_latest(metrics.registry).decode()
    assert value("moe_engine_imbalance_ratio", 1, "expert") == 4.0
