"""CUDA graphs for decode (moe_engine/runner/cuda_graphs.py): the startup decision and its log line,
and the graph path itself run on this CPU.

On a CPU the capture step is the `EagerReplayCapture` stand-in (its replay re-runs the forward
on the static buffers), with `--kernel-backend triton` under the Triton interpreter: so the
padding to captured sizes (3 requests -> 4, 5 -> 8), the static buffers, the scratch block, the
masked expert-load counts and the eager fallback of mixed steps are all the real code; only
the graph itself is not. Oracles: transformers' greedy ids, and the same engine with graphs off
(ids and expert-load counts equal). The `gpu` test captures real graphs on CUDA.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fixtures import hf_greedy

from kernels.plan import KernelPlan
from moe_engine import LLM, SamplingParams
from moe_engine.cli.serve import build_parser, engine_config_from_args
from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.errors import StartupError
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.kv_cache.spec import FULL_ATTENTION, MLA_ATTENTION, SLIDING_ATTENTION
from moe_engine.runner.cuda_graphs import EagerReplayCapture, capture_sizes, graphs_off_reason
from moe_engine.startup.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

HAS_CUDA = torch.cuda.is_available()

# 5 requests, max_num_seqs 8 and a 16-token budget: prefill chunks beside decodes (mixed steps,
# eager), decode-only steps of 5 (pad to 8), 4, 3 (pad to 4), 2 and 1 requests; a KV pool of
# 16-token blocks too small for all five (`NUM_BLOCKS`): a preemption (its recompute is a mixed
# step again).
PROMPT_LENS = [2, 3, 6, 9, 14]
MAX_TOKENS = [12, 10, 8, 6, 5]
#: Qwen3: up to 5 x 2 blocks in one group; gpt-oss: two groups, admission counts the window.
NUM_BLOCKS = {"qwen3_ckpt": 5, "gpt_oss_ckpt": 10}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine(
    ckpt, capture=None, device: str = "cpu", num_blocks: int = 5, **device_kw
) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=32),
        cache=CacheConfig(num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
        kernel_backend="triton",
        device=DeviceConfig(device, **device_kw),
    )
    return build_engine_core(config, graph_capture=capture)


def _generate(engine: EngineCore) -> tuple[list[list[int]], list[tuple[list[int], bool]]]:
    """Greedy ids per prompt, and per step (tokens per scheduled request, replayed a graph)."""
    steps: list[tuple[list[int], bool]] = []
    runner, execute = engine.runner, engine.runner.execute

    def traced(out, kv):
        graphs = runner.decode_graphs
        before = sum(graphs.num_replays.values()) if graphs else 0
        result = execute(out, kv)
        after = sum(graphs.num_replays.values()) if graphs else 0
        steps.append(([s.num_tokens for s in out.scheduled], after > before))
        if after > before:  # padding rows: scratch slots, no keys, null-block tables
            b, n = len(out.scheduled), next(n for n in graphs.sizes if n >= len(out.scheduled))
            for g in range(len(runner.kv_groups)):
                slots = graphs.static[f"slot_mapping.{g}"][b:n]
                assert (slots // runner.block_size == runner.scratch_block).all()
                width = graphs.width
                assert not graphs.static[f"block_tables.{g}"][b * width : n * width].any()
            assert not graphs.static["seq_lens"][b:n].any()
            assert graphs.static["row_mask"][:n].tolist() == [1] * b + [0] * (n - b)
        if runner.scratch_block is not None:  # never handed to a request
            for s in out.scheduled:
                for g in range(len(runner.kv_groups)):
                    assert runner.scratch_block not in kv.block_table(s.request.request_id, g)
        return result

    runner.execute = traced
    for i, (prompt, n) in enumerate(zip(_prompts(), MAX_TOKENS, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPT_LENS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(PROMPT_LENS))], steps


def _caches(engine: EngineCore) -> list[torch.Tensor]:
    out = []
    for cache in engine.runner.kv_caches:
        out.extend([cache] if isinstance(cache, torch.Tensor) else cache)
    return out


@pytest.mark.parametrize("ckpt_name", ["qwen3_ckpt", "gpt_oss_ckpt"])
def test_graph_path_matches_eager_and_transformers(ckpt_name, request, caplog) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    expected = [hf_greedy(ckpt, [p], n)[0] for p, n in zip(_prompts(), MAX_TOKENS, strict=True)]
    # --enforce-eager with the same capture step: what a user compares on a GPU
    with caplog.at_level(logging.INFO, logger="moe_engine.core.build"):
        eager = _engine(ckpt, EagerReplayCapture(), num_blocks=NUM_BLOCKS[ckpt_name],
                        enforce_eager=True)  # fmt: skip
    assert "CUDA graphs: off (--enforce-eager)" in caplog.text
    assert eager.runner.decode_graphs is None and eager.runner.scratch_block is None
    eager_ids, _ = _generate(eager)
    with caplog.at_level(logging.INFO, logger="moe_engine.core.build"):
        engine = _engine(ckpt, EagerReplayCapture(), num_blocks=NUM_BLOCKS[ckpt_name])
    assert "CUDA graphs: captured decode batch sizes [1, 2, 4, 8] in" in caplog.text
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    input_ids = graphs.buffers.reserve("input_ids", 8).data_ptr()
    got, steps = _generate(engine)
    assert got == expected and eager_ids == expected

    # Decode-only steps replayed (3 -> 4, 5 -> 8); steps with a prefill chunk ran eagerly.
    assert all(replayed == all(n == 1 for n in tokens) for tokens, replayed in steps), steps
    assert {3, 5} <= {len(t) for t, replayed in steps if replayed}, steps
    assert graphs.num_replays[8] > 0 and graphs.num_replays[4] > 0, graphs.num_replays
    assert any(not replayed and 1 in tokens for tokens, replayed in steps), steps  # mixed
    assert engine.get_stats().num_preemptions > 0
    assert graphs.buffers.reserve("input_ids", 8).data_ptr() == input_ids  # static

    # Padding counts nothing: the expert load equals the eager run's, step for step in total.
    assert engine.get_expert_load().counts == eager.get_expert_load().counts
    assert engine.expert_load.snapshot().sum() == eager.expert_load.snapshot().sum() > 0

    # The scratch block is beyond the pool (and took the padding rows' writes, checked per
    # step above); the null block stays all-zero.
    num_blocks = engine.plan.num_blocks
    assert engine.runner.scratch_block == num_blocks + 1 == engine.kv.pool.num_blocks + 1
    for cache in _caches(engine):
        assert cache.shape[0] == num_blocks + 2
        assert not cache[0].any()
    stats = engine.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total  # nothing leaked


def test_capture_sizes_are_powers_of_two_up_to_the_cap() -> None:
    assert capture_sizes(256, 8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(1024, 8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(8, 2048) == [1, 2, 4, 8]
    assert capture_sizes(6, 2048) == [1, 2, 4, 6]
    assert capture_sizes(64, 16) == [1, 2, 4, 8, 16]
    assert capture_sizes(1, 16) == [1]


def test_off_reasons() -> None:
    triton = KernelPlan.uniform("triton", "cuda")
    on = dict(enforce_eager=False, kernels=triton, kv_kinds=[FULL_ATTENTION], quant_method="none",
              ep_size=1)  # fmt: skip
    assert graphs_off_reason("cuda", **on) is None
    assert graphs_off_reason("cuda", **{**on, "kv_kinds": [MLA_ATTENTION]}) is None
    assert graphs_off_reason("cuda", **{**on, "enforce_eager": True}) == "--enforce-eager"
    assert graphs_off_reason("cpu", **on) == "cpu"
    assert graphs_off_reason("cpu", **on, capture_devices=("cpu", "cuda")) is None
    assert graphs_off_reason("cuda", **{**on, "ep_size": 2}) == (
        "ep_size 2: TorchAllToAll reads split sizes on the host"
    )
    torch_plan = KernelPlan.uniform("torch", "cuda")
    kinds = [SLIDING_ATTENTION, FULL_ATTENTION]
    assert graphs_off_reason("cuda", **{**on, "kernels": torch_plan, "kv_kinds": kinds}) == (
        "attention_decode=torch, fused_moe=torch"
    )
    mla = {**on, "kernels": torch_plan, "kv_kinds": [MLA_ATTENTION], "quant_method": "int4"}
    assert graphs_off_reason("cuda", **mla) == "mla_decode=torch, fused_moe_int4=torch"


def test_enforce_eager_flag_and_offline_api(qwen3_ckpt, caplog) -> None:
    args = build_parser().parse_args(["--enforce-eager"])
    assert engine_config_from_args(args, str(qwen3_ckpt)).device.enforce_eager is True
    args = build_parser().parse_args([])
    assert engine_config_from_args(args, str(qwen3_ckpt)).device.enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be a bool, got 'yes'"):
        DeviceConfig(enforce_eager="yes")
    with caplog.at_level(logging.INFO, logger="moe_engine.core.build"):
        llm = LLM(model=str(qwen3_ckpt), device="cpu", enforce_eager=True, max_model_len=64)
    assert "CUDA graphs: off (--enforce-eager)" in caplog.text
    assert llm.engine.runner.decode_graphs is None


class _FailingCapture(EagerReplayCapture):
    def __call__(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_stops_startup_naming_the_size_and_the_flag(qwen3_ckpt) -> None:
    with pytest.raises(StartupError, match=r"CUDA graph capture failed at decode batch size 8: "
                       r"operation not permitted .*; pass --enforce-eager"):  # fmt: skip
        _engine(qwen3_ckpt, _FailingCapture())


def test_row_mask_weighs_the_counts() -> None:
    recorder = ExpertLoadRecorder([0], num_experts=4)
    mask = torch.tensor([1, 1, 0, 0, 0], dtype=torch.int64)
    recorder.set_row_mask(mask)
    recorder.record(0, torch.tensor([[0, 1], [1, 2], [3, 3]], dtype=torch.int32))
    assert recorder.counts[0].tolist() == [1, 2, 1, 0]
    mask[2] = 1  # refilled in place: the next record sees it
    recorder.record(0, torch.tensor([[0, 1], [1, 2], [3, 2]], dtype=torch.int32))
    assert recorder.counts[0].tolist() == [2, 4, 3, 1]
    with pytest.raises(ValueError, match="6 token rows, but the row mask has 5"):
        recorder.record(0, torch.zeros(6, 2, dtype=torch.int32))
    recorder.set_row_mask(None)
    recorder.record(0, torch.tensor([[3, 3]], dtype=torch.int32))
    assert recorder.counts[0].tolist() == [2, 4, 3, 3]
    with pytest.raises(ValueError, match="row mask must be \\[P\\] int64"):
        recorder.set_row_mask(torch.ones(3, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_graphs_capture_and_match_eager(qwen3_ckpt, caplog) -> None:
    """Real `torch.cuda.CUDAGraph` capture: greedy ids equal to the eager engine's
    (`--enforce-eager`) and to transformers, expert-load counts equal, graphs replayed."""
    expected = [hf_greedy(qwen3_ckpt, [p], n)[0] for p, n in zip(_prompts(), MAX_TOKENS,
                                                                   strict=True)]  # fmt: skip
    eager = _engine(qwen3_ckpt, device="cuda", enforce_eager=True)
    eager_ids, _ = _generate(eager)
    with caplog.at_level(logging.INFO, logger="moe_engine.core.build"):
        engine = _engine(qwen3_ckpt, device="cuda")
    assert "CUDA graphs: captured decode batch sizes [1, 2, 4, 8] in" in caplog.text
    assert "MiB" in caplog.text
    got, steps = _generate(engine)
    assert got == eager_ids == expected
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays[8] > 0 and graphs.num_replays[4] > 0
    assert engine.get_expert_load().counts == eager.get_expert_load().counts
    for cache in _caches(engine):
        assert not cache[0].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_startup_sizes_the_graph_pool_and_compiles_first(qwen3_ckpt, caplog) -> None:
    """KV cache sized by --gpu-memory-utilization: the plan holds the decode graphs' pool
    (estimated before the KV cache), the capture took no more than that, the Triton warm-up
    ran before it, and greedy ids equal --enforce-eager's (whose plan has no pool)."""

    def engine(**kw):
        config = EngineConfig(
            model=ModelConfig(model=str(qwen3_ckpt), max_model_len=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
            kernel_backend="triton", device=DeviceConfig("cuda", gpu_memory_utilization=0.3, **kw),
        )  # fmt: skip
        return build_engine_core(config)

    with caplog.at_level(logging.INFO):
        graphs = engine()
    assert graphs.plan.graph_pool_bytes > 0
    assert "(estimated: a decode step of 8 requests)" in graphs.plan.describe()
    assert "Triton warm-up: compiled" in caplog.text
    assert "of the" in caplog.text and "the plan left for them" in caplog.text
    eager = engine(enforce_eager=True)
    assert eager.plan.graph_pool_bytes == 0 and "(off: --enforce-eager)" in eager.plan.describe()
    got, _ = _generate(graphs)
    assert got == _generate(eager)[0]
