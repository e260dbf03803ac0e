"""Runtime EPLB end to end at --ep-size 2: a rebalance while requests stream.

The checkpoint is the tiny Qwen3-MoE with its routers skewed here (a minimal skew of this
module's own): gate rows of experts 0 and 1 scaled up 20x, the others' down to 1/20, so most
tokens pick expert 0 or 1 (both on rank 0 in the starting placement
[[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]], 2 redundant slots). With --eplb-step-interval 6,
--eplb-window-steps 6 and threshold 1.0, the first decision moves a replica of a hot expert
to rank 1 while 4 greedy streams run; the test checks the stats, GetModelInfo's live
placement, `moe-skew report --server`'s view of it (and its line on EPLB), the
moe_engine_eplb_* metrics, and that the greedy tokens equal the same model's at ep 1 (the moved
weights serve exactly).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_helpers import ServerThread, greedy_streams, stats
from safetensors.torch import load_file, save_file

from moe_engine import LLM, SamplingParams
from moe_engine.cli.skew import load_from_server, served_placement
from moe_engine.cli.skew import main as skew_main
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    EplbConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

HOT = (0, 1)
PROMPT_LENS = [5, 9, 14, 7]
MAX_NEW = 40
START = [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]]


@pytest.fixture(scope="module")
def skewed_ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`qwen3_ckpt` with every router's hot rows scaled up and the others down."""
    out = tmp_path_factory.mktemp("eplb_skewed") / "ckpt"
    shutil.copytree(qwen3_ckpt, out)
    path = out / "model.safetensors"
    weights = load_file(path)
    gates = [k for k in weights if k.endswith("mlp.gate.weight")]
    assert gates, sorted(weights)[:10]
    for name in gates:
        gate = weights[name].clone()
        scale = torch.full((gate.shape[0], 1), 1 / 20)
        scale[list(HOT)] = 20.0
        weights[name] = (gate * scale).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def served(skewed_ckpt: Path):
    """A 2-rank EPLB server: greedy outputs of 4 streams, stats seen while they streamed and
    after, GetModelInfo, the skew CLI's view and the metrics text."""
    config = EngineConfig(
        model=ModelConfig(model=str(skewed_ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=2, collective_timeout_s=60),
        eplb=EplbConfig(enabled=True, window_steps=6, step_interval=6,
                        num_redundant_experts=2, balancedness_threshold=1.0,
                        move_mib_per_step=0.02),  # ~20 KB a step: a move takes several
    )
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        first_info = handle.server.engine.model_info
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            seen_mid_stream: list[pb.ServerStats] = []
            done = threading.Event()

            def watch() -> None:
                while not done.is_set():
                    s = stats(stub)
                    if s.num_running and s.eplb.num_rebalances:
                        seen_mid_stream.append(s)
                        return
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            got = greedy_streams(stub, _prompts(), [MAX_NEW] * len(PROMPT_LENS))
            done.set()
            watcher.join(10)
            after = stats(stub)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
        skew_info, _ = load_from_server(handle.address, timeout=30)
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            assert skew_main(["report", "--server", handle.address]) == 0
        metrics = handle.run(_metrics_text(handle.server))
    finally:
        handle.close()
    return dict(first_info=first_info, got=got, mid=seen_mid_stream, after=after, info=info,
                skew_info=skew_info, report=report.getvalue(), metrics=metrics)


async def _metrics_text(server) -> str:
    server.metrics.update_from_stats(await server.engine.get_stats())
    return server.metrics.render()[0].decode()


def test_starts_with_the_redundant_placement(served) -> None:
    assert served["first_info"].experts_per_rank == START
    assert served["first_info"].eplb_enabled


def test_rebalance_happens_while_requests_stream(served) -> None:
    assert served["mid"], "no rebalance was committed while requests were running"
    s = served["after"].eplb
    assert s.num_rebalances >= 1 and s.num_decisions >= s.num_rebalances
    first = s.rebalances[0]
    assert first.step == 6 and first.committed_step >= first.step + 1
    assert first.experts_moved > 0 and first.bytes_sent > 0
    assert first.bytes_received == first.bytes_sent  # summed over both ranks
    assert first.move_steps > 1 and first.transfer_seconds >= 0 and first.commit_seconds > 0
    assert first.balancedness_after_predicted > first.balancedness_before
    # measured over the 6 steps after the swap (the streams run 40 steps): better than before
    assert first.balancedness_after_measured > first.balancedness_before, first
    assert s.last_rebalance_step == s.rebalances[-1].step and not s.moving


def test_model_info_and_skew_report_show_the_live_placement(served) -> None:
    info = served["info"]
    live = [list(r.experts) for r in info.experts_per_rank]
    assert live != START and info.eplb_rebalances == served["after"].eplb.num_rebalances
    assert sorted({e for rank in live for e in rank}) == list(range(8))
    assert [len(rank) for rank in live] == [5, 5]
    # a hot expert now has a replica on each rank
    assert any(all(e in rank for rank in live) for e in HOT), live
    skew = served["skew_info"]
    assert served_placement(skew, 8, "server").slots == live
    assert skew["eplb_rebalances"] == info.eplb_rebalances
    assert "placement, served by the server" in served["report"], served["report"]
    assert f"moved {info.eplb_rebalances} times since startup" in served["report"]
    assert f"live placement: r0 {list(live[0])}; r1 {list(live[1])}" in served["report"]


def test_eplb_metrics(served) -> None:
    text = served["metrics"]
    n = served["after"].eplb.num_rebalances
    assert f"moe_engine_eplb_rebalances_total {float(n)}" in text, text
    assert 'moe_engine_eplb_balancedness{when="after_measured"}' in text
    assert 'moe_engine_eplb_seconds_total{phase="commit"}' in text
    decisions = served["after"].eplb.num_decisions
    assert f"moe_engine_eplb_decisions_total {float(decisions)}" in text


def test_greedy_tokens_equal_ep1(served, skewed_ckpt: Path) -> None:
    llm = LLM(model=str(skewed_ckpt), max_model_len=128)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert served["got"] == expected
