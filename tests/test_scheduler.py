"""Scheduler and KV cache on fake requests: budget, sequence cap, chunking, preemption, freeing."""

from __future__ import annotations

import torch

from moe_engine.kv_cache import BlockPool, FullAttentionSpec, KVCacheManager
from moe_engine.request import FinishReason, Request
from moe_engine.sampling_params import SamplingParams
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, block_size=4):
    spec = FullAttentionSpec(block_size, 2, 8, torch.float32, 2)
    kv = KVCacheManager([spec], num_blocks)
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv
    ), kv


def make_request(rid, n, max_tokens=4):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0))


def run_step(sched):
    out = sched.schedule()
    sampled = {s.request.request_id: 7 for s in out.scheduled if s.samples}
    return out, sched.update(out, sampled)


def test_budget_chunks_prefill_and_decodes_go_first():
    sched, _ = make_scheduler(budget=10)
    sched.add_request(make_request("a", 25))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.start, s.num_tokens) for s in out.scheduled] == [("a", 0, 10)]
    sched.add_request(make_request("b", 3))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 10)]
    out, (advanced, _) = run_step(sched)  # a's last 5 tokens, then b's 3 fit in the budget
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 5), ("b", 3)]
    assert {r.request_id for r in advanced} == {"a", "b"}
    out, _ = run_step(sched)
    assert [s.num_tokens for s in out.scheduled] == [1, 1]
    assert out.total_num_tokens <= 10


def test_max_num_seqs_caps_running():
    sched, _ = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(str(i), 3))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3


def test_preemption_frees_blocks_and_recomputes_newest():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4, then grow until one is evicted
    sched, kv = make_scheduler(num_blocks=6)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    for _ in range(40):
        if not sched.num_unfinished:
            break
        out, _ = run_step(sched)
        preempted += out.preempted_ids
    assert "b" in preempted and sched.num_preemptions >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert kv.num_free_blocks == 6


def test_finish_and_abort_return_blocks():
    sched, kv = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", 9))
    run_step(sched)
    assert kv.num_free_blocks < 16
    assert sched.finish_request("a", FinishReason.ABORT).finish_reason == FinishReason.ABORT
    assert sched.finish_request("a", FinishReason.ABORT) is None  # idempotent
    assert kv.num_free_blocks == 16


def test_block_pool_all_or_nothing_and_double_free():
    pool = BlockPool(4)
    assert pool.allocate(5) is None and pool.num_free_blocks == 4
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    try:
        pool.free(blocks)
    except ValueError as e:
        assert "not allocated" in str(e)
    else:
        raise AssertionError("double free must raise")
