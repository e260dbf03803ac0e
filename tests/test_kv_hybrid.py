"""Hybrid KV cache: full-attention and sliding-window groups over one block pool.

Unit tests of the group split, the sliding-window block arithmetic and accounting, admission
of requests that could never fit, the startup plan per group; then the model path against
`transformers` on the tiny gpt-oss checkpoint (sliding and full layers, window 8) and on a
Qwen3-MoE checkpoint with `use_sliding_window`, under chunked prefill, preemption and prefix
caching.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from fixtures import hf_greedy, make_tiny_checkpoint

from moe_engine import LLM, SamplingParams
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.kv_cache import (
    FULL_ATTENTION,
    NULL_BLOCK_ID,
    SLIDING_ATTENTION,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    make_kv_cache_groups,
)
from moe_engine.models import model_shape
from moe_engine.request import FinishReason, Request
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig
from moe_engine.startup.plan import make_plan

BS = 4
WINDOW = 10  # not a multiple of BS


def spec_kw(dtype=torch.float32):
    return dict(block_size=BS, num_kv_heads=2, head_dim=8, dtype=dtype)


def test_layers_split_into_equal_groups():
    groups = make_kv_cache_groups(
        [(FULL_ATTENTION, None, (1, 3, 5, 7)), (SLIDING_ATTENTION, 128, (0, 2, 4, 6))],
        **spec_kw(),
    )
    assert [(g.spec.kind, g.spec.sliding_window, g.layers) for g in groups] == [
        (FULL_ATTENTION, None, (1, 3, 5, 7)),
        (SLIDING_ATTENTION, 128, (0, 2, 4, 6)),
    ]
    # 4 full + 2 sliding layers: groups of gcd(4, 2) = 2 layers
    groups = make_kv_cache_groups(
        [(FULL_ATTENTION, None, (0, 1, 2, 3)), (SLIDING_ATTENTION, 8, (4, 5))], **spec_kw()
    )
    assert [g.layers for g in groups] == [(0, 1), (2, 3), (4, 5)]
    assert {g.spec.num_layers for g in groups} == {2}
    assert groups[0].spec.bytes_per_token == 2 * 2 * 2 * 8 * 4
    with pytest.raises(ValueError, match="two attention groups"):
        make_kv_cache_groups(
            [(FULL_ATTENTION, None, (0, 1)), (SLIDING_ATTENTION, 8, (1,))], **spec_kw()
        )
    with pytest.raises(ValueError, match="sliding window"):
        make_kv_cache_groups([(SLIDING_ATTENTION, None, (0,))], **spec_kw())
    with pytest.raises(ValueError, match="not supported"):
        make_kv_cache_groups([("linear_attention", None, (0,))], **spec_kw())


def test_sliding_window_block_arithmetic():
    s = SlidingWindowSpec(BS, 2, 8, torch.float32, 1, WINDOW)
    # the query at position 12 reads keys 3..12: block 0 (0..3) is still needed
    assert s.num_skipped_blocks(12) == 0
    assert s.num_skipped_blocks(13) == 1  # keys 4..13
    assert s.num_skipped_blocks(100) == (100 - WINDOW + 1) // BS
    # decode: ceil(10 / 4) + 1 = 4 blocks; a chunk of 8 from s: positions s-9 .. s+7
    assert s.max_blocks_held(1000, 1) == math.ceil(WINDOW / BS) + 1 == 4
    assert s.max_blocks_held(1000, 8) == math.ceil((WINDOW - 1 + 8) / BS) + 1 == 6
    assert s.max_blocks_held(6, 8) == 2  # never more than the whole context
    f = FullAttentionSpec(BS, 2, 8, torch.float32, 1)
    assert f.max_blocks_held(1000, 8) == 250 and f.num_skipped_blocks(1000) == 0
    with pytest.raises(ValueError, match=">= 1"):
        SlidingWindowSpec(BS, 2, 8, torch.float32, 1, 0)


def make(num_blocks=40, budget=8, max_num_seqs=4, caching=False):
    specs = [
        FullAttentionSpec(BS, 2, 8, torch.float32, 1),
        SlidingWindowSpec(BS, 2, 8, torch.float32, 1, WINDOW),
    ]
    kv = KVCacheManager(specs, num_blocks, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv), kv


@pytest.mark.parametrize("caching", [False, True])
def test_sliding_group_gives_blocks_back_and_stays_bounded(caching):
    rng = random.Random(3)
    sched, kv = make(caching=caching)
    initial = kv.num_free_blocks
    stem = [rng.randrange(1, 100) for _ in range(30)]
    for i in range(6):
        n = rng.randrange(5, 31)
        sched.add_request(Request(str(i), stem[:n], SamplingParams(max_tokens=25)))
    max_decode_blocks = math.ceil(WINDOW / BS) + 1
    decode_steps = 0
    for _ in range(400):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for s in out.scheduled:
            rid, n = s.request.request_id, s.start + s.num_tokens
            sliding = kv.block_table(rid, 1)
            held = kv.num_blocks_held(rid, 1)
            # during the step: the window before the chunk plus the chunk itself
            assert held <= math.ceil((WINDOW - 1 + s.num_tokens) / BS) + 1
            if s.num_tokens == 1:
                decode_steps += 1
                assert held <= max_decode_blocks
            # every block before the window of the first query is the null block
            first_needed = max(0, s.start - WINDOW + 1) // BS
            assert all(b == NULL_BLOCK_ID for b in sliding[:first_needed])
            assert NULL_BLOCK_ID not in sliding[first_needed:]
            assert len(sliding) == math.ceil(n / BS)
            assert kv.num_blocks_held(rid, 0) == math.ceil(n / BS)  # full: every block
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        for r in sched.running:  # between steps: only the window of the next query
            assert kv.num_blocks_held(r.request_id, 1) <= max_decode_blocks
        assert kv.num_free_blocks == initial - sum(kv.blocks_used_per_group())
    assert not sched.num_unfinished and decode_steps > 50
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == initial


def test_abort_and_preemption_free_both_groups():
    sched, kv = make(num_blocks=40)
    initial = kv.num_free_blocks
    sched.add_request(Request("a", list(range(1, 30)), SamplingParams(max_tokens=4)))
    sched.add_request(Request("b", list(range(1, 9)), SamplingParams(max_tokens=4)))
    for _ in range(5):
        out = sched.schedule()
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    assert kv.num_blocks_held("a", 1) > 0 and kv.num_blocks_held("a", 0) > 0
    sched._preempt(sched.running.pop())  # what schedule() does when blocks run out
    sched.finish_request("a", FinishReason.ABORT)
    assert kv.num_free_blocks == initial and not kv.block_tables


def test_request_that_can_never_fit_is_rejected_not_requeued():
    sched, kv = make(num_blocks=10, budget=8)
    # 40 tokens of context: 10 full-attention blocks + ceil((9 + 8) / 4) + 1 = 6 sliding ones
    big = Request("big", list(range(1, 31)), SamplingParams(max_tokens=11))
    with pytest.raises(ValueError) as err:
        sched.add_request(big)
    for piece in ("40 tokens", "needs 16 KV blocks", "full attention 10", "sliding window 10 6",
                  "pool has 10"):
        assert piece in str(err.value), (piece, str(err.value))
    assert not sched.num_unfinished and not sched.requests
    ok = Request("ok", list(range(1, 11)), SamplingParams(max_tokens=2))  # 11 tokens: 3 + 3
    sched.add_request(ok)
    for _ in range(10):
        sched.update(sched.schedule(), {"ok": 5})
    assert ok.is_finished and kv.num_free_blocks == 10


GPT_OSS_LIKE = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}


def test_plan_reports_kv_bytes_per_group_and_caps_sliding_share():
    shape = model_shape(GPT_OSS_LIKE)
    plan = make_plan(
        shape, torch.bfloat16, block_size=16, max_model_len=4096, kv_cache_memory=1 << 30,
        max_num_batched_tokens=2048,
    )
    full, sliding = plan.kv_specs
    assert (full.sliding_window, sliding.sliding_window) == (None, 128)
    assert full.bytes_per_token == sliding.bytes_per_token == 2 * 12 * 8 * 64 * 2  # 24 KiB
    assert plan.kv_bytes_per_block == 16 * 24576  # one block id = one group's 12 layers
    assert plan.num_blocks == (1 << 30) // (16 * 24576)
    # 4096 tokens: 256 full blocks + a sliding share capped at ceil((127 + 2048) / 16) + 1
    assert plan.blocks_per_request(4096) == 256 + 137
    text = plan.describe()
    assert "KV group 0: full attention, 12 layers, 24.00 KiB per token" in text
    assert "KV group 1: sliding window 128, 12 layers, 24.00 KiB per token" in text
    # a pool too small for one max_model_len request fails at startup with the numbers
    small = make_plan(
        shape, torch.bfloat16, block_size=16, max_model_len=4096, kv_cache_memory=300 * 393216,
        max_num_batched_tokens=2048,
    )
    with pytest.raises(StartupError) as err:
        small.check()
    for piece in ("393 blocks", "300 blocks", "sliding window 128", "--kv-cache-memory"):
        assert piece in str(err.value), (piece, str(err.value))
    fits = small.max_fitting_len()
    assert small.blocks_per_request(fits) <= 300 < small.blocks_per_request(fits + 1)
    assert f"--max-model-len {fits} or less" in str(err.value)


def _prompts(window: int) -> list[list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(3, 500) for _ in range(4 * window + 3)]
    # shorter than, equal to, one past, several times the window; one sharing a long prefix
    return [
        base[: window - 3],
        base[:window],
        base[: window + 1],
        base[: 4 * window + 3],
        base[: 3 * window] + [9, 10, 11, 12, 13],
    ]


def _engine_tokens(ckpt, prompts, max_new, one_by_one=False, **kw) -> tuple[list, LLM]:
    """Greedy tokens of all prompts submitted together (and first one at a time, so that
    later prompts can hit earlier ones' cached blocks, when `one_by_one`)."""
    llm = LLM(model=str(ckpt), max_model_len=48, block_size=4, **kw)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)]]
    if one_by_one:
        runs.insert(0, [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts])
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert all(g.blocks_used == 0 for g in stats.kv_groups)
    return runs, llm


@pytest.fixture(scope="module")
def gpt_oss_ckpt(tiny_ckpt_root):
    """The tiny gpt-oss checkpoint of tests/fixtures.py: 4 layers, sliding / full alternating,
    window 8."""
    return make_tiny_checkpoint("gpt_oss", tiny_ckpt_root)


@pytest.fixture(scope="module")
def gpt_oss_expected(gpt_oss_ckpt):
    return hf_greedy(gpt_oss_ckpt, _prompts(8), 5)


def test_gpt_oss_hybrid_groups_match_transformers(gpt_oss_ckpt, gpt_oss_expected):
    (got,), llm = _engine_tokens(gpt_oss_ckpt, _prompts(8), 5, max_num_batched_tokens=5)
    assert got == gpt_oss_expected
    runner = llm.engine.runner
    kinds = [(g.spec.kind, g.layers) for g in runner.kv_groups]
    assert kinds == [(FULL_ATTENTION, (1, 3)), (SLIDING_ATTENTION, (0, 2))]
    # layer j of each group shares one tensor pair: two pairs of num_blocks + 1 blocks
    assert runner.kv_caches[0] is runner.kv_caches[1] and runner.kv_caches[2] is runner.kv_caches[3]
    assert runner.kv_caches[0][0].shape[0] == llm.engine.plan.num_blocks + 1
    # a pool that forces preemption, chunks above the window
    (got,), llm = _engine_tokens(
        gpt_oss_ckpt, _prompts(8), 5, max_num_batched_tokens=16, num_blocks_override=20
    )
    assert got == gpt_oss_expected and llm.engine.scheduler.num_preemptions > 0


def test_gpt_oss_prefix_caching_gives_the_same_tokens(gpt_oss_ckpt, gpt_oss_expected):
    runs, llm = _engine_tokens(
        gpt_oss_ckpt, _prompts(8), 5, one_by_one=True, max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    assert runs == [gpt_oss_expected, gpt_oss_expected]
    stats = llm.engine.get_stats()
    # one at a time: prompts 2, 3, 4 reuse 1, 2, 2 blocks of their predecessors (4 tokens each;
    # a sliding group needs 2 blocks before the hit's end), the last one 6 blocks of prompt 4;
    # then all five again: every full block but the one holding the last token
    assert stats.prefix_cache_hits == (4 + 8 + 8 + 24) + (4 + 4 + 8 + 32 + 28), stats
    (got,), llm = _engine_tokens(
        gpt_oss_ckpt, _prompts(8), 5, max_num_batched_tokens=5, num_blocks_override=16,
        enable_prefix_caching=True,
    )
    assert got == gpt_oss_expected and llm.engine.scheduler.num_preemptions > 0


def test_qwen3_use_sliding_window_matches_transformers(tiny_ckpt_root):
    ckpt = make_tiny_checkpoint(
        "qwen3_moe", tiny_ckpt_root, use_sliding_window=True, sliding_window=6
    )
    prompts = _prompts(6)
    expected = hf_greedy(ckpt, prompts, 6)
    (got,), llm = _engine_tokens(
        ckpt, prompts, 6, max_num_batched_tokens=5, num_blocks_override=20,
        enable_prefix_caching=True,
    )
    assert [(g.spec.kind, g.spec.sliding_window) for g in llm.engine.runner.kv_groups] == [
        (SLIDING_ATTENTION, 6)
    ]
    assert got == expected


def test_engine_maps_never_fitting_request_to_out_of_range(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), max_model_len=64, block_size=4, num_blocks_override=16)
    llm.engine.kv.pool.num_blocks = 8  # as if the pool held 8 blocks (32 tokens)
    llm.engine.add_request("fits", list(range(3, 15)), SamplingParams(max_tokens=21))
    with pytest.raises(RequestError) as err:  # 12 + 22 - 1 = 33 tokens: 9 blocks
        llm.engine.add_request("x", list(range(3, 15)), SamplingParams(max_tokens=22))
    assert err.value.code == ErrorCode.OUT_OF_RANGE and err.value.field == "max_tokens"
    assert "needs 9 KV blocks" in err.value.message and "pool has 8" in err.value.message
    assert "x" not in llm.engine.scheduler.requests
    llm.engine.abort_requests(["fits"])
    assert not llm.engine.has_unfinished_requests()
