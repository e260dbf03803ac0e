"""--gpu-memory-utilization: the KV-cache arithmetic with an injected `DeviceMemory`, the
flag's validation, and a profile run that leaves no state behind (on this CPU)."""

from __future__ import annotations

import pytest
import torch

from moe_engine import LLM
from moe_engine.cli.serve import main as serve_main
from moe_engine.errors import StartupError
from moe_engine.models import checkpoint_shape
from moe_engine.startup.config import DeviceConfig
from moe_engine.startup.memory import (
    DeviceMemory,
    check_weights_fit,
    kv_plan_after_profile,
    size_kv_cache,
)
from moe_engine.startup.plan import make_plan

GiB = 1 << 30


@pytest.fixture(scope="module")
def plan(qwen3_ckpt):
    """The tiny Qwen3-MoE's plan at max_model_len 256 (a placeholder KV budget)."""
    shape = checkpoint_shape(qwen3_ckpt)
    return make_plan(
        shape, torch.float32, block_size=16, max_model_len=256, kv_cache_memory=1 << 20
    )


def test_blocks_are_what_the_budget_leaves(plan) -> None:
    memory = DeviceMemory(total=10 * GiB, free=9 * GiB, non_torch=GiB // 4)
    sizing = size_kv_cache(memory, 0.9, GiB, GiB // 2, plan, max_model_len=256)
    left = int(0.9 * 10 * GiB) - GiB - GiB // 2 - GiB // 4
    assert sizing.kv_cache_bytes == left
    assert sizing.num_blocks == left // plan.kv_bytes_per_block
    assert sizing.max_concurrent_tokens == sizing.num_blocks * 16
    text = sizing.describe()
    for term in (
        "10.00 GiB total",
        "gpu_memory_utilization 0.9",
        "weights 1.00 GiB",
        "activations peak 512.0 MiB",
        "non-torch 256.0 MiB",
        f"{sizing.num_blocks} blocks",
        "concurrent tokens",
    ):
        assert term in text, (term, text)


def test_weights_alone_too_big_name_the_bytes_and_the_flags() -> None:
    memory = DeviceMemory(total=8 * GiB, free=8 * GiB)
    check_weights_fit(memory, 0.9, 7 * GiB)  # fits: 7 GiB of 7.2 GiB
    with pytest.raises(StartupError) as err:
        check_weights_fit(memory, 0.5, 5 * GiB)
    msg = str(err.value)
    for part in (
        f"{5 * GiB} bytes",
        "--gpu-memory-utilization 0.5",
        f"{8 * GiB} bytes",
        f"allows {4 * GiB} bytes",
        "--ep-size",
        "--quantization int4 or mxfp4",
        "--max-model-len",
        "--max-num-seqs",
        "at least 0.63",
    ):
        assert part in msg, (part, msg)
    assert "\n" not in msg


def test_activations_leaving_too_little_for_one_request(plan) -> None:
    need = plan.blocks_per_request(256) * plan.kv_bytes_per_block
    # weights + activations leave half of one max_model_len request
    total = 10 * GiB
    activations = int(0.9 * total) - GiB - need // 2
    with pytest.raises(StartupError) as err:
        size_kv_cache(DeviceMemory(total, total), 0.9, GiB, activations, plan, 256)
    msg = str(err.value)
    for part in (
        f"needs {plan.blocks_per_request(256)} blocks ({need} bytes)",
        f"activations peak {activations}",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--ep-size",
        "--quantization int4 or mxfp4",
        "--max-num-seqs",
        "fits)",
    ):
        assert part in msg, (part, msg)
    # a higher utilization would fit it: the message says how high
    assert "higher --gpu-memory-utilization (at least 0.91)" in msg


def test_the_plan_after_profile_prints_each_term(plan) -> None:
    memory = DeviceMemory(total=4 * GiB, free=3 * GiB, non_torch=100 << 20)
    sized = kv_plan_after_profile(
        plan,
        utilization=0.5,
        max_model_len=256,
        weight_bytes=GiB,
        profile=lambda: 300 << 20,
        memory=lambda: memory,
    )
    blocks = (2 * GiB - GiB - (300 << 20) - (100 << 20)) // plan.kv_bytes_per_block
    assert sized.num_blocks == blocks
    assert sized.kv_cache_source == "gpu_memory_utilization 0.5"
    text = sized.describe()
    assert f"KV blocks: {blocks}" in text
    assert "activations peak 300.0 MiB (profiled)" in text
    assert "4.00 GiB total x gpu_memory_utilization 0.5 = 2.00 GiB" in text


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, "abc", True])
def test_gpu_memory_utilization_outside_its_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization .*\(0, 1\].*got"):
        DeviceConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize("bad", ["0", "1.5", "abc"])
def test_the_flag_names_the_field_value_and_limit(capsys, bad) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--gpu-memory-utilization", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization" in err and f"got {bad!r}" in err and "(0, 1]" in err


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    return LLM(model=str(qwen3_ckpt), device="cpu", max_model_len=128, num_blocks_override=24)


def test_cpu_plan_notes_the_flag_is_ignored(llm) -> None:
    text = llm.engine.plan.describe()
    assert "--gpu-memory-utilization 0.9 applies to cuda only" in text
    assert llm.engine.plan.num_blocks == 24


def test_a_cpu_profile_run_leaves_pool_cache_and_recorder_untouched(llm) -> None:
    engine, runner = llm.engine, llm.engine.runner
    free = engine.kv.pool.num_free_blocks
    caches = [
        [t.clone() for t in ((c,) if isinstance(c, torch.Tensor) else c)] for c in runner.kv_caches
    ]
    counts = engine.expert_load.snapshot()
    assert any(moe.load_recorder is not None for _, moe in engine.model.moe_layers())
    # the largest step: two chunks of max_model_len tokens at full context, 8 logits rows
    runner.profile_run(num_tokens=200, max_num_seqs=8, max_model_len=128)
    assert engine.kv.pool.num_free_blocks == free
    assert torch.equal(engine.expert_load.snapshot(), counts)
    assert int(engine.expert_load.counts.sum()) == int(counts.sum())
    assert all(moe.load_recorder is engine.expert_load for _, moe in engine.model.moe_layers())
    for before, cache in zip(caches, runner.kv_caches, strict=True):
        after = (cache,) if isinstance(cache, torch.Tensor) else cache
        for b, a in zip(before, after, strict=True):
            assert torch.equal(a, b)
            assert not a[0].any()  # the null block is all-zero again


class _RecordingCommunicator:
    """One rank's identity communicator that records begin_step and the tokens of each
    dispatch, and says it switches path at 3 tokens (as DeepEP at its low-latency bound)."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []
        self.dispatched: list[int] = []

    def begin_step(self, num_tokens: int | None) -> None:
        self.steps.append(num_tokens)

    def profile_token_counts(self, max_tokens: int) -> set[int]:
        return {3} if max_tokens > 3 else set()

    def dispatch(self, hidden, topk_ids, topk_weights):
        from comm.base import DispatchResult

        self.dispatched.append(hidden.shape[0])
        return DispatchResult(hidden, topk_ids, topk_weights, None)

    def combine(self, expert_out, handle):
        return expert_out


def test_the_profile_run_also_runs_the_decode_steps(llm) -> None:
    """Prefill-sized, then the largest decode step (max_num_seqs one-token requests), then each
    size a communicator switches path at: each forward announced once with begin_step."""
    runner = llm.engine.runner
    layers = [moe for _, moe in llm.engine.model.moe_layers()]
    recorder, saved = _RecordingCommunicator(), [moe.communicator for moe in layers]
    kept = runner.communicators
    try:
        for moe in layers:
            moe.communicator = recorder
        runner.communicators = [recorder]
        runner.profile_run(num_tokens=200, max_num_seqs=8, max_model_len=128)
    finally:
        for moe, comm in zip(layers, saved, strict=True):
            moe.communicator = comm
        runner.communicators = kept
    assert recorder.steps == [200, 8, 3]
    assert recorder.dispatched == [200] * len(layers) + [8] * len(layers) + [3] * len(layers)
