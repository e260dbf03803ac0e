"""Startup on a device (moe_engine/runner/warmup.py, startup/memory.py): the Triton warm-up's
dummy steps cover every variant class the kernels distinguish (checked against brute force
over every reachable shape), the warm-up is skipped where nothing compiles, the dummy steps
run through the real runner, and the decode graphs' pool is counted in the KV budget."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.triton_attention import num_kv_splits
from kernels.moe.fused_moe_configs import token_bucket
from kernels.plan import KernelPlan
from moe_engine.runner import warmup
from moe_engine.runner.warmup import (
    decode_split_steps,
    dummy_steps,
    moe_token_counts,
    paged_decode_splits,
    prefill_query_lens,
    warm_up,
    warm_up_skip_reason,
)
from moe_engine.startup.memory import (
    GRAPH_POOL_SLACK,
    DeviceMemory,
    graph_pool_estimate,
    kv_plan_after_profile,
    size_kv_cache,
)

GiB = 1 << 30


def _moe_class(t: int) -> tuple[int, bool, bool]:
    """What picks a fused-MoE variant: the config bucket, and Triton's integer
    specialisations (== 1, divisible by 16)."""
    return token_bucket(t), t == 1, t % 16 == 0


@pytest.mark.parametrize("limit", [1, 8, 9, 64, 100, 2048, 4097, 8192])
def test_moe_token_counts_cover_every_bucket_and_class(limit) -> None:
    counts = moe_token_counts(limit)
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] == limit
    assert {_moe_class(t) for t in counts} == {_moe_class(t) for t in range(1, limit + 1)}
    assert len(counts) == len({_moe_class(t) for t in counts})  # one step per class


def test_prefill_query_lens_cover_every_query_tile() -> None:
    for budget, max_len in [(2048, 512), (16, 4096), (100, 100), (1, 64)]:
        lens = prefill_query_lens(budget, max_len)
        longest = min(budget, max_len)
        tiles = {1 << (q - 1).bit_length() for q in range(2, longest + 1)}
        assert {1 << (q - 1).bit_length() for q in lens} == tiles
        assert all(q <= longest for q in lens)


@pytest.mark.parametrize("kv_heads, seqs, max_len", [(4, 64, 8192), (1, 8, 2048), (8, 256, 16384)])
def test_decode_steps_hit_every_split_count(kv_heads, seqs, max_len) -> None:
    """Brute force: every batch size and every block-table width up to max_model_len."""
    block = 16
    splits_of = paged_decode_splits(kv_heads)
    steps = decode_split_steps(splits_of, seqs, max_len, block)
    every = {
        num_kv_splits(b * kv_heads, w * block)
        for b in range(1, seqs + 1)
        for w in range(1, max_len // block + 1)
    }
    assert [s for s, _, _ in steps] == sorted(every)
    for splits, batch, context in steps:
        assert batch <= seqs and context <= max_len
        assert splits_of(batch, -(-context // block) * block) == splits


def test_dummy_steps_fit_the_limits() -> None:
    steps = dummy_steps(
        max_num_batched_tokens=300, max_num_seqs=16, max_model_len=128, block_size=16,
        splits_of=paged_decode_splits(2),
    )  # fmt: skip
    assert all(s.num_tokens <= 300 and max(s.q_lens) <= s.context_len <= 128 for s in steps)
    assert all(len(s.q_lens) <= 16 for s in steps if set(s.q_lens) == {1})
    assert {_moe_class(s.num_tokens) for s in steps} == {_moe_class(t) for t in range(1, 301)}
    no_decode = dummy_steps(
        max_num_batched_tokens=300, max_num_seqs=16, max_model_len=128, block_size=16,
        splits_of=None,
    )  # fmt: skip
    assert all("decode" not in s.why for s in no_decode)


def test_warm_up_is_skipped_where_nothing_compiles() -> None:
    triton, torch_plan = KernelPlan.uniform("triton", "cuda"), KernelPlan.uniform("torch", "cuda")
    ops = ["fused_moe", "attention_decode"]
    assert "cpu" in warm_up_skip_reason(torch.device("cpu"), triton, ops)
    assert warm_up_skip_reason(torch.device("cuda"), torch_plan, ops) == "no op runs on Triton"
    # the test session runs Triton's interpreter (tests/conftest.py)
    assert "interpreter" in warm_up_skip_reason(torch.device("cuda"), triton, ops)
    assert triton.compiled_on_launch([*ops, "fused_moe", "linear"]) == ops


def test_warm_up_counts_the_compiles_and_restores_the_hook(caplog) -> None:
    from triton import knobs

    calls = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: calls.append(k)
    try:
        steps = dummy_steps(max_num_batched_tokens=16, max_num_seqs=1, max_model_len=16,
                            block_size=16, splits_of=None)  # fmt: skip

        def run(step: warmup.DummyStep) -> None:  # a "compile" per new token count
            knobs.runtime.jit_post_compile_hook(step=step.num_tokens)

        with caplog.at_level("INFO", logger="moe_engine.runner.warmup"):
            compiled, _ = warm_up(run, steps)
        assert compiled == len(steps) == len(calls)  # counted, and the old hook chained
        assert f"compiled {compiled} kernel variants in" in caplog.text
    finally:
        restored = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = None
    assert restored is not None and restored.__name__ == "<lambda>"


def test_the_dummy_steps_run_through_the_runner(qwen3_ckpt) -> None:
    """The warm-up's steps (decode splits included) are valid runner inputs: each runs on
    the null block and leaves it zero (CPU, torch kernels: the shapes, not the compiles)."""
    from moe_engine.core.device import kv_groups_of
    from moe_engine.models.build import build_model
    from moe_engine.runner.model_runner import ModelRunner
    from moe_engine.runner.sampler import Sampler
    from moe_engine.startup.config import EngineConfig, ModelConfig

    config = EngineConfig(ModelConfig(str(qwen3_ckpt), max_model_len=32), kernel_backend="torch")
    built = build_model(config)
    groups = kv_groups_of(built, 16)
    runner = ModelRunner(built.model, 0, 16, built.dtype, Sampler(), groups, torch.device("cpu"))
    steps = dummy_steps(max_num_batched_tokens=40, max_num_seqs=3, max_model_len=32,
                        block_size=16, splits_of=lambda b, k: b + k // 16)  # fmt: skip
    # the distinct shapes: two chunks (40 > max_model_len), one token, decode batches
    steps = [s for s in steps if s.num_tokens in (1, 40) or "decode" in s.why]
    assert [s.q_lens for s in steps] == [(1,), (32, 8), (1,), (1, 1), (1, 1, 1), (1, 1, 1)]
    for step in steps:
        runner.dummy_run(step.q_lens, step.context_len, min(3, len(step.q_lens)))
    for cache in runner.kv_caches:
        for t in (cache,) if isinstance(cache, torch.Tensor) else cache:
            assert not t[0].any()


def _plan(qwen3_ckpt):
    from moe_engine.models import checkpoint_shape
    from moe_engine.startup.plan import make_plan

    return make_plan(checkpoint_shape(qwen3_ckpt), torch.float32, block_size=16,
                     max_model_len=256, kv_cache_memory=1 << 20)  # fmt: skip


def test_the_graph_pool_comes_out_of_the_kv_budget(qwen3_ckpt) -> None:
    plan = _plan(qwen3_ckpt)
    memory = DeviceMemory(total=4 * GiB, free=3 * GiB, non_torch=100 << 20)
    args = dict(utilization=0.5, max_model_len=256, weight_bytes=GiB,
                profile=lambda: 300 << 20, memory=lambda: memory)  # fmt: skip
    eager = kv_plan_after_profile(plan, **args, graph_note="off: --enforce-eager")
    pool = graph_pool_estimate(200 << 20)
    assert pool == (200 << 20) + GRAPH_POOL_SLACK
    graphs = kv_plan_after_profile(
        plan, **args, graph_pool=lambda: pool, graph_note="estimated: a decode step of 8 requests"
    )
    assert eager.graph_pool_bytes == 0 and graphs.graph_pool_bytes == pool
    assert eager.num_blocks - graphs.num_blocks == -(-pool // plan.kv_bytes_per_block) or (
        eager.num_blocks - graphs.num_blocks == pool // plan.kv_bytes_per_block
    )
    assert "CUDA graphs 0 B (off: --enforce-eager)" in eager.describe()
    assert "CUDA graphs 264.0 MiB (estimated: a decode step of 8 requests)" in graphs.describe()
    assert "CUDA graphs" not in plan.describe()  # a CPU plan has no such term


def test_a_graph_pool_that_leaves_too_little_names_enforce_eager(qwen3_ckpt) -> None:
    from moe_engine.errors import StartupError

    plan = _plan(qwen3_ckpt)
    total = 4 * GiB
    with pytest.raises(StartupError, match=r"CUDA graphs \d+ .*or --enforce-eager"):
        size_kv_cache(DeviceMemory(total, total), 0.5, GiB, 100 << 20, plan, 256,
                      graph_pool=int(0.5 * total) - GiB - (100 << 20))  # fmt: skip


def test_the_engine_runs_the_warm_up_where_it_applies(qwen3_ckpt, monkeypatch, caplog) -> None:
    """The engine's wiring: where the warm-up applies (forced here: on this CPU it never
    does), its dummy steps run after the KV cache is made and before graph capture, and
    leave the null block zero; the log names the count and the time."""
    from moe_engine.core import build as core_build
    from moe_engine.startup.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    ran: list[warmup.DummyStep] = []
    real_warm_up = core_build.warm_up

    def spy(run, steps):
        ran.extend(steps)
        return real_warm_up(run, steps)

    monkeypatch.setattr(core_build, "warm_up_skip_reason", lambda *a: None)
    monkeypatch.setattr(core_build, "warm_up", spy)
    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=32),
        cache=CacheConfig(num_blocks_override=4),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16),
        kernel_backend="torch",
    )
    with caplog.at_level("INFO", logger="moe_engine.runner.warmup"):
        engine = core_build.build_engine_core(config)
    assert sorted(s.num_tokens for s in ran) == [1, 2, 4, 8, 15, 16]  # no Triton decode
    assert "Triton warm-up: compiled 0 kernel variants in" in caplog.text
    for cache in engine.runner.kv_caches:
        for t in (cache,) if isinstance(cache, torch.Tensor) else cache:
            assert not t[0].any()
