"""Typed front-end <-> core messages: round trips, loud failures, explicit proto mapping."""

from __future__ import annotations

import logging

import msgspec
import pytest
from fake_core import FakeEngineCore

from moe_engine.core import outputs as o
from moe_engine.core.eplb_stats import EplbStats, RebalanceRecord
from moe_engine.core.protocol import EngineCoreProtocol
from moe_engine.engine import messages as m
from moe_engine.engine.core_proc import refusal_of_frame
from moe_engine.engine.status import StartupStatus
from moe_engine.errors import ErrorCode, ParamError
from moe_engine.request import FinishReason
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.convert import model_info_to_proto, server_stats_to_proto
from moe_engine.server.metrics import StatsLogger
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.startup.config import EngineConfig, ModelConfig


def _core_stats(base: int, rank: int = 0) -> o.CoreStats:
    """CoreStats whose every number is distinct and non-zero (base + field index)."""
    numbers = {
        name: base + i
        for i, name in enumerate(o.CoreStats.__struct_fields__)
        if name not in ("kv_groups", "phase_seconds", "rank", _PER_POS, "paused",
                        "weight_version", "eplb")
    }
    group = o.KVCacheGroupStats(
        group=1, kind="sliding_attention", sliding_window=8, num_layers=2,
        kv_bytes_per_token=64, blocks_used=base,
    )
    return o.CoreStats(
        **numbers, kv_groups=[group], phase_seconds={"step": 0.5}, rank=rank,
        paused=bool(rank % 2), weight_version=f"v{base}",
        spec_decode_num_accepted_tokens_per_pos=[base, base + 1] + [base] * (rank % 2),
        eplb=_eplb_stats(base),
    )  # fmt: skip


def _eplb_stats(base: int) -> EplbStats:
    """EplbStats (and one RebalanceRecord) with every field set and non-zero."""
    record = RebalanceRecord(
        step=base, committed_step=base + 3, experts_moved=4, bytes_sent=base * 10,
        bytes_received=base * 10, transfer_s=0.25, commit_s=0.125, move_steps=3,
        balancedness_before=0.5, balancedness_after_predicted=0.9,
        balancedness_after_measured=0.875,
    )
    return EplbStats(
        num_rebalances=1, num_decisions=2, moving=True, experts_moved=4,
        bytes_sent=base * 10, bytes_received=base * 10, transfer_s=0.25 + base,
        commit_s=0.125, balancedness=0.875, balancedness_predicted=0.9,
        last_rebalance_step=base, rebalances=[record],
    )


_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def _model_info() -> o.ModelInfo:
    return o.ModelInfo(
        model="/m", architecture="A", dtype="float32", vocab_size=10, max_model_len=11,
        num_layers=12, num_experts=4, num_experts_per_tok=2, hidden_size=15, block_size=16,
        num_kv_blocks=17, max_num_seqs=18, max_num_batched_tokens=19, ep_size=2,
        has_tokenizer=True, weight_bytes_experts=21, weight_bytes_attention=22,
        weight_bytes_embeddings=23, weight_bytes_other=24, expert_weight_format="int4",
        expert_group_size=32, expert_checkpoint_format="compressed-tensors",
        expert_zero_points=True, experts_per_rank=[[0, 1], [2, 3]], rank_pids=[5, 6],
        device="cuda", kernel_backends={"fused_moe": "triton", "linear": "torch"},
        weight_version="step-7", eplb_enabled=True, eplb_rebalances=2,
    )


MESSAGES = [
    m.EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3, stop=["x"], seed=7), 1.5, 1),
    m.AbortRequests(["r1", "r2"]),
    m.GetStats(1),
    m.GetExpertLoad(2),
    m.GetModelInfo(3),
    m.Shutdown(),
    m.Heartbeat(12.5),
]
OUTPUTS = [
    m.StartupProgress("building native CPU kernels", "moe_cpu 1/4", 40.0),
    m.Ready(_model_info()),
    m.StartupFailed("StartupError", "no weights", "tb"),
    m.EngineCoreOutputs([
        o.EngineCoreOutput("r1", [5], "a", True, FinishReason.STOP, 3, 1, [(-0.5, {5: -0.5})]),
        o.EngineCoreOutput("r2", []),
    ]),
    m.AddError("r1", ErrorCode.OUT_OF_RANGE, "max_tokens", "max_tokens: too many"),
    m.Fatal("boom", "tb"),
    m.StatsReply(1, o.engine_stats([_core_stats(10), _core_stats(100, rank=1)])),
    m.ExpertLoadReply(2, o.ExpertLoad(
        moe_layers=[1], counts=[[1, 2]], window_counts=[[0, 1]], window_steps=1,
        imbalance_ratio=[1.3], balancedness=[0.75], rank_tokens=[[1, 2]],
    )),
    m.ModelInfoReply(3, _model_info()),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda x: type(x).__name__)
def test_inputs_round_trip(message) -> None:
    assert m.decode_input(m.encode(message)) == message


@pytest.mark.parametrize("message", OUTPUTS, ids=lambda x: type(x).__name__)
def test_outputs_round_trip(message) -> None:
    decoded = m.decode_output(m.encode(message))
    assert decoded == message and type(decoded) is type(message)


def test_a_missing_or_renamed_field_fails_loudly() -> None:
    stats = msgspec.to_builtins(_core_stats(1))
    stats["running"] = stats.pop("num_running")  # renamed on one side
    frame = m.encode(m.StatsReply(1, o.engine_stats([_core_stats(1)])))
    bad = msgspec.msgpack.encode(["stats_reply", 1, {"ep_size": 1, "total": stats, "ranks": []}])
    assert m.decode_output(frame).stats.total.num_running == 1
    with pytest.raises(msgspec.ValidationError, match="num_running"):
        m.decode_output(bad)
    with pytest.raises(msgspec.ValidationError):
        m.decode_input(msgspec.msgpack.encode(["no_such_kind", 1]))


def test_undecodable_add_is_refused_naming_its_field() -> None:
    frame = msgspec.msgpack.encode(["add", "r9", [1], {"max_tokens": "many"}, 0.0, 0])
    with pytest.raises(msgspec.ValidationError) as info:
        m.decode_input(frame)
    refusal = refusal_of_frame(frame, info.value)
    assert (refusal.request_id, refusal.code, refusal.field) == (
        "r9", ErrorCode.INVALID_ARGUMENT, "request",
    )
    # SamplingParams refusing a value at construction: its ParamError names the field
    exc = msgspec.ValidationError("top_k: must be an integer")
    exc.__cause__ = ParamError("top_k", "top_k: must be an integer, got 2.5")
    refusal = refusal_of_frame(frame, exc)
    assert (refusal.field, refusal.message) == ("top_k", "top_k: must be an integer, got 2.5")
    assert refusal_of_frame(m.encode(m.GetStats(1)), exc) is None  # not an add: no refusal


def test_every_server_stats_field_has_a_source() -> None:
    """A proto field the servicer does not fill (or a renamed source) stays at its default."""
    stats = o.engine_stats([_core_stats(10), _core_stats(100, rank=1)])
    proto = server_stats_to_proto(stats)
    for message in (proto, proto.ranks[1], proto.kv_groups[0], proto.eplb,
                    proto.eplb.rebalances[0]):
        filled = {f.name for f, _ in message.ListFields()}
        assert filled == set(message.DESCRIPTOR.fields_by_name), type(message).__name__
    assert proto.num_running == 10 + 100 and proto.ranks[1].num_running == 100
    assert proto.kv_groups[0].blocks_used == 110  # summed over ranks
    assert proto.tokens_dispatched == stats.total.tokens_in
    assert len(server_stats_to_proto(o.engine_stats([_core_stats(1)])).ranks) == 0  # ep 1
    # EPLB: bytes summed over the ranks, seconds the slowest rank's
    assert proto.eplb.bytes_sent == 1100 and proto.eplb.transfer_seconds == 100.25
    assert proto.eplb.rebalances[0].bytes_sent == 1100


def test_every_model_info_field_has_a_source() -> None:
    proto = model_info_to_proto(_model_info())
    assert {f.name for f, _ in proto.ListFields()} == set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
    assert [list(r.experts) for r in proto.experts_per_rank] == [[0, 1], [2, 3]]


def test_sum_stats_adds_every_counter() -> None:
    a, b = _core_stats(10), _core_stats(100, rank=1)
    total = o.sum_stats([a, b])
    assert total.rank == 0 and total.phase_seconds == {"step": 1.0}
    for name in ("num_running", "prompt_tokens_total", "tokens_received", "num_steps"):
        assert getattr(total, name) == getattr(a, name) + getattr(b, name)
    assert total.kv_cache_usage == total.kv_blocks_used / total.kv_blocks_total
    # drafts accepted per position: summed position by position, ranks may differ in length
    assert total.spec_decode_num_accepted_tokens_per_pos == [110, 112, 100]


def test_cores_provide_the_protocol() -> None:
    from moe_engine.core.engine_core import EngineCore

    fake = FakeEngineCore(EngineConfig(ModelConfig(model="/fake")))
    assert isinstance(fake, EngineCoreProtocol)
    methods = [
        name for name, value in vars(EngineCoreProtocol).items()
        if callable(value) and not name.startswith("_")
    ]
    assert "step" in methods and "get_stats" in methods
    assert all(callable(getattr(EngineCore, n, None)) for n in methods), methods
    assert isinstance(fake.get_stats(), o.CoreStats)
    assert isinstance(fake.model_info(), o.ModelInfo)


def test_startup_status_text() -> None:
    status = StartupStatus(phase_started=100.0, updated=100.0)
    status = status.advance("building native CPU kernels", "moe_cpu", 60.0, now=110.0)
    assert status.describe(now=135.0) == (
        "building native CPU kernels: moe_cpu (25 s elapsed, about 35 s left)"
    )
    later = status.advance("building native CPU kernels", "linear_cpu", 5.0, now=140.0)
    assert later.describe(now=150.0) == (
        "building native CPU kernels: linear_cpu (40 s elapsed, finishing)"
    )
    loading = later.advance("loading weights", "", None, now=160.0)
    assert loading.describe(now=163.0) == "loading weights (3 s elapsed)"


def test_stats_log_line_only_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    def sample(prompt: int, generated: int, running: int, used: int = 0) -> o.EngineStats:
        stats = msgspec.structs.replace(
            _core_stats(0), prompt_tokens_total=prompt, generation_tokens_total=generated,
            num_running=running, num_waiting=0, kv_blocks_total=200, kv_blocks_used=used,
            prefix_cache_queries=0, prefix_cache_hits=0,
        )
        return o.engine_stats([stats])

    stats_log = StatsLogger()
    with caplog.at_level(logging.INFO, logger="moe_engine.server.metrics"):
        assert stats_log.observe(sample(0, 0, 0), now=0.0) is None  # the baseline
        line = stats_log.observe(sample(120, 50, 2, used=5), now=10.0)
        assert stats_log.observe(sample(120, 50, 0), now=20.0) is None  # idle: quiet
        tail = stats_log.observe(sample(120, 70, 1, used=2), now=25.0)
    assert line == (
        "running: 2 reqs, waiting: 0 reqs, KV cache usage: 2.5%, prompt throughput: "
        "12.0 tokens/s, generation throughput: 5.0 tokens/s"
    )
    assert "generation throughput: 4.0 tokens/s" in tail
    assert [r.getMessage() for r in caplog.records] == [line, tail]
