"""Parallel sampling (SamplingParams.n): the n completions share the prompt's KV blocks with
prefix caching on or off, the prompt is computed once, aborting or preempting frees every
completion's blocks, seeds differ per completion and repeat; on the scheduler with fake tokens
and end to end on the tiny Qwen3-MoE checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from moe_engine import LLM, SamplingParams
from moe_engine.core.parallel_sampling import ParentRequest
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.kv_cache import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from moe_engine.request import FinishReason
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig

BS = 16
PROMPT = [random.Random(3).randrange(3, 500) for _ in range(64)]  # 4 full blocks of 16


def make(num_blocks=64, budget=2048, caching=False, sliding=None):
    specs = [FullAttentionSpec(BS, 2, 8, torch.float32, 2)]
    if sliding is not None:
        specs.append(SlidingWindowSpec(BS, 2, 8, torch.float32, 2, sliding))
    kv = KVCacheManager(specs, num_blocks, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget)
    return Scheduler(config, kv), kv


def add_parent(sched, kv, rid="p", n=4, prompt=PROMPT, max_tokens=8):
    parent = ParentRequest(rid, SamplingParams(n=n, max_tokens=max_tokens, temperature=0))
    salt = None if kv.enable_prefix_caching else f"n:{rid}"
    for child in parent.make_children(prompt, frozenset(), 0.0, salt):
        sched.add_request(child)
    return parent


def step(sched, token=7):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    return out


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_blocks_are_held_once_and_computed_once(caching):
    sched, kv = make(caching=caching)
    parent = add_parent(sched, kv)
    out = step(sched)
    # the lead computes the 64 prompt tokens; each sibling shares 3 full blocks and computes
    # only its last block (the last prompt token is always recomputed, as for a prefix hit)
    assert [(s.request.index, s.start, s.num_tokens) for s in out.scheduled] == [
        (0, 0, 64), (1, 48, 16), (2, 48, 16), (3, 48, 16)
    ]
    tables = [kv.block_table(c.request_id) for c in parent.children]
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert len({t[3] for t in tables}) == 4
    assert sum(kv.blocks_used_per_group()) == 3 + 4 * 1  # not 4 * 4
    step(sched)  # every completion's first decode needs a fifth block of its own
    assert sum(kv.blocks_used_per_group()) == 3 + 4 * 2
    assert kv.num_free_blocks == 64 - 11
    assert [kv.pool.ref_counts[b] for b in tables[0][:3]] == [4, 4, 4]


def test_siblings_of_a_chunked_lead_come_after_its_prompt_and_share():
    sched, kv = make(budget=40)
    add_parent(sched, kv)
    first = step(sched)
    assert [(s.request.index, s.num_tokens) for s in first.scheduled] == [(0, 40)]
    second = step(sched)  # the lead's last 24 tokens; then siblings share 3 blocks
    assert [(s.request.index, s.start, s.num_tokens) for s in second.scheduled] == [
        (0, 40, 24), (1, 48, 16)
    ]
    computed = 64 + 16
    for _ in range(10):
        computed += sum(s.num_tokens for s in step(sched).scheduled if s.start < 64)
    assert computed == 64 + 3 * 16  # the prompt once, plus each sibling's last block


@pytest.mark.parametrize("caching", [False, True])
def test_abort_of_every_completion_frees_all_blocks_and_forgets_salted_ones(caching):
    sched, kv = make(caching=caching)
    start = kv.num_free_blocks
    parent = add_parent(sched, kv)
    step(sched)
    step(sched)
    for child in parent.children:
        sched.finish_request(child.request_id, FinishReason.ABORT)
    assert parent.finished and not sched.num_unfinished
    assert kv.num_free_blocks == start and all(c == 0 for c in kv.pool.ref_counts)
    # caching off: the siblings' salted blocks leave the map; on: they stay cached as usual
    assert (kv.pool.num_cached_blocks > 0) == caching


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("sliding", [None, 24])
def test_preemption_of_completions_leaks_nothing(caching, sliding):
    sched, kv = make(num_blocks=14, budget=48, caching=caching, sliding=sliding)
    start = kv.num_free_blocks
    parents = [add_parent(sched, kv, rid, n=3, prompt=PROMPT[:40], max_tokens=30)
               for rid in ("a", "b")]
    for _ in range(500):
        if not sched.num_unfinished:
            break
        step(sched)
        assert kv.num_free_blocks == start - sum(kv.blocks_used_per_group())
    assert not sched.num_unfinished and sched.num_preemptions > 0
    assert all(p.finished for p in parents)
    assert all(c.num_output_tokens == 30 for p in parents for c in p.children)
    assert kv.num_free_blocks == start and all(c == 0 for c in kv.pool.ref_counts)
    assert (kv.pool.num_cached_blocks == 0) == (not caching)


def test_child_ids_and_seeds_follow_vllm():
    parent = ParentRequest("r", SamplingParams(n=3, seed=10))
    children = parent.make_children([5, 6], frozenset(), 0.0, None)
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 and c.external_id == "r" for c in children)
    unseeded = ParentRequest("u", SamplingParams(n=2)).make_children([5], frozenset(), 0.0, None)
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


# ---------------------------------------------------------------- end to end (tiny Qwen3-MoE)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    return LLM(model=str(qwen3_ckpt), max_model_len=256, block_size=BS)


def test_n4_uses_the_prompt_blocks_once_in_the_engine(llm):
    engine = llm.engine
    start = engine.kv.pool.num_free_blocks
    engine.add_request("p", PROMPT, SamplingParams(n=4, max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    engine.step()
    assert engine.last_step.num_tokens == 64 + 3 * 16
    assert sum(engine.kv.blocks_used_per_group()) == 3 + 4
    outs = engine.step()
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    assert {o.request_id for o in outs} == {"p"}
    assert sum(engine.kv.blocks_used_per_group()) == 3 + 4 * 2  # 20 without sharing
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free_blocks == start and engine.kv.pool.num_cached_blocks == 0


def test_greedy_n_gives_n_identical_completions_equal_to_n1(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    [single] = llm.generate(PROMPT, params, use_tqdm=False)
    [out] = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=10, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_seeded_completions_differ_repeat_and_match_seed_plus_index(llm):
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    for i, tokens in enumerate(first):  # vLLM's rule: completion i samples with seed + i
        single = SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert llm.generate([PROMPT], single, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_abort_of_the_parent_ends_every_completion(llm):
    engine = llm.engine
    start = engine.kv.pool.num_free_blocks
    engine.add_request("q", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    outs = engine.abort_requests(["q"])
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.request_id == "q" and o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests() and not engine._parents
    assert engine.kv.pool.num_free_blocks == start and engine.kv.pool.num_cached_blocks == 0


def test_live_ids_of_a_parent_and_its_completions_are_refused(llm):
    engine = llm.engine
    engine.add_request("d", [5, 6, 7], SamplingParams(n=2, max_tokens=4))
    for rid, n in (("d", 1), ("d", 3), ("1_d", 1)):
        with pytest.raises(RequestError) as info:
            engine.add_request(rid, [5, 6], SamplingParams(n=n, max_tokens=4))
        assert info.value.code == ErrorCode.ALREADY_EXISTS
    engine.abort_requests(["d"])
    assert not engine.has_unfinished_requests()


def test_preempted_completions_give_the_same_tokens(qwen3_ckpt):
    small = LLM(model=str(qwen3_ckpt), max_model_len=96, block_size=BS, num_blocks_override=10)
    prompt = PROMPT[:40]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    [single] = small.generate(prompt, params, use_tqdm=False)
    start = small.engine.kv.pool.num_free_blocks
    [out] = small.generate(prompt, SamplingParams(n=4, max_tokens=40, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    assert small.engine.kv.pool.num_free_blocks == start


def test_sliding_window_model_shares_and_matches_n1(gpt_oss_ckpt):
    """gpt-oss alternates sliding-window (8 tokens) and full layers: a completion's share of a
    sliding group needs only the blocks inside the window (block size 4 here)."""
    hybrid = LLM(model=str(gpt_oss_ckpt), max_model_len=128, block_size=4)
    prompt = PROMPT[:22]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [single] = hybrid.generate(prompt, params, use_tqdm=False)
    engine = hybrid.engine
    engine.add_request("h", prompt, SamplingParams(n=3, max_tokens=12, temperature=0,
                                                   ignore_eos=True))
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.index] += out.new_token_ids
        if first:  # siblings recompute only tokens 20..21 (the last, partial block)
            assert engine.last_step.num_tokens == 22 + 2 * 2
            first = False
    assert all(t == single.outputs[0].token_ids for t in tokens.values())
    assert engine.kv.pool.num_free_blocks == engine.plan.num_blocks
