"""Prefix caching: chained block hashes, the LRU free queue, shared blocks with reference counts,
the scheduler's use of the cached prefix, and exact token equality with caching off on the tiny
Qwen3-MoE checkpoint (offline API and gRPC GetServerStats)."""

from __future__ import annotations

import random

import pytest
import torch

from moe_engine import LLM, SamplingParams
from moe_engine.kv_cache import (
    NULL_BLOCK_ID,
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    hash_block_tokens,
)
from moe_engine.kv_cache.manager import ROOT_BLOCK_HASH
from moe_engine.request import FinishReason, Request
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig

BS = 4  # tokens per block in the unit tests


def make(num_blocks=32, budget=64, max_num_seqs=8, sliding=None, caching=True):
    specs = [FullAttentionSpec(BS, 2, 8, torch.float32, 2)]
    if sliding is not None:
        specs.append(SlidingWindowSpec(BS, 2, 8, torch.float32, 2, sliding))
    kv = KVCacheManager(specs, num_blocks, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv), kv


def req(rid, ids, max_tokens=3):
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0))


def step(sched, token=7):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    return out


def drain(sched, limit=500):
    for _ in range(limit):
        if not sched.num_unfinished:
            return
        step(sched)
    raise AssertionError("requests did not finish")


def test_block_hash_chains_parent_and_tokens():
    ids = [random.randrange(1000) for _ in range(2 * BS)]
    h0 = hash_block_tokens(ROOT_BLOCK_HASH, ids[:BS])
    h1 = hash_block_tokens(h0, ids[BS:])
    assert len(h1) == 32 and h1 == hash_block_tokens(h0, list(ids[BS:]))
    other0 = hash_block_tokens(ROOT_BLOCK_HASH, [ids[0] + 1] + ids[1:BS])
    assert hash_block_tokens(other0, ids[BS:]) != h1  # same tokens, different parent
    assert hash_block_tokens(h0, ids[BS:], extra_keys=("lora", 3)) != h1


def test_free_queue_is_lru_and_evicts_only_on_reallocation():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [1, 2] and NULL_BLOCK_ID not in a
    pool.cache_block(a[0], "h0")
    pool.cache_block(a[1], "h1")
    pool.free(a)  # tail first: block 2 joins the queue before block 1
    assert pool.num_free_blocks == 4 and pool.get_cached_block("h0") == 1
    # never-cached blocks leave the queue first; the cached ones stay reusable meanwhile
    assert pool.allocate(2) == [3, 4]
    assert pool.get_cached_block("h0") == 1 and pool.get_cached_block("h1") == 2
    pool.touch([1])  # a hit takes block 1 back out of the queue
    assert pool.ref_counts[1] == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [2]  # reallocation evicts block 2's hash
    assert pool.get_cached_block("h1") is None and pool.get_cached_block("h0") == 1
    assert pool.allocate(1) is None
    pool.free([1, 2, 3, 4])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 1


def test_repeated_prompt_reuses_full_blocks_and_recomputes_last_token():
    sched, kv = make()
    prompt = list(range(10, 30))  # 20 tokens = 5 full blocks
    a = req("a", prompt)
    sched.add_request(a)
    drain(sched)
    b = req("b", prompt)
    sched.add_request(b)
    out = step(sched)
    # 4 blocks (16 tokens) are reused: the hit never covers the last prompt token
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(16, 4)]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20 + 20, 0 + 16)
    c = req("c", prompt[:14] + [999] * 6)  # shares 3 full blocks and 2 tokens
    sched.add_request(c)
    out = step(sched)
    assert [(s.request.request_id, s.start) for s in out.scheduled] == [("b", 20), ("c", 12)]
    assert kv.block_table("c")[:3] == kv.block_table("b")[:3]
    assert kv.block_table("c")[3] != kv.block_table("b")[3]
    shared = kv.block_table("b")[0]
    assert kv.pool.ref_counts[shared] == 2
    sched.finish_request("b", FinishReason.ABORT)
    assert kv.pool.ref_counts[shared] == 1
    drain(sched)
    assert kv.num_free_blocks == 32


def test_budget_counts_only_the_uncached_remainder():
    sched, kv = make(budget=8)
    prompt = list(range(50, 70))
    sched.add_request(req("a", prompt, max_tokens=1))
    drain(sched)
    sched.add_request(req("b", prompt, max_tokens=1))  # 16 cached, 4 to compute
    sched.add_request(req("c", [1, 2, 3], max_tokens=1))
    out = step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("b", 4), ("c", 3)]


def test_preempted_request_rehits_its_own_blocks():
    sched, kv = make(num_blocks=9)
    a, b = req("a", list(range(100, 116)), 12), req("b", list(range(200, 216)), 12)
    sched.add_request(a)
    sched.add_request(b)
    drain(sched)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1
    assert kv.prefix_cache_hits > 0  # the recompute reused b's freed (cached) blocks
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert kv.num_free_blocks == 9


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("sliding", [None, 6])
def test_free_count_returns_after_finish_abort_and_preemption(caching, sliding):
    rng = random.Random(1)
    sched, kv = make(num_blocks=16, budget=12, sliding=sliding, caching=caching)
    initial = kv.num_free_blocks
    stem = [rng.randrange(1, 500) for _ in range(12)]
    for i in range(12):
        tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 10))]
        sched.add_request(req(str(i), stem[: rng.randrange(0, 13)] + tail, rng.randrange(1, 9)))
    for n in range(300):
        if not sched.num_unfinished:
            break
        step(sched, token=rng.randrange(1, 500))
        if n % 7 == 3 and sched.running:  # abort a running request now and then
            sched.finish_request(sched.running[-1].request_id, FinishReason.ABORT)
        assert kv.num_free_blocks == initial - sum(kv.blocks_used_per_group())
    assert not sched.num_unfinished and sched.num_preemptions > 0
    assert kv.num_free_blocks == initial and not kv.block_tables
    assert all(c == 0 for c in kv.pool.ref_counts)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    base = [rng.randrange(3, 500) for _ in range(40)]
    return [
        base,
        base,  # repeated
        base[:33] + [7, 8, 9],  # shares 33 tokens
        base[:20],  # a prefix of an earlier prompt
        [5] * 16,  # exactly 4 full blocks
        [5] * 16 + [6],
    ]


def _run(ckpt, caching: bool, max_model_len=128, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM(
        model=str(ckpt),
        max_model_len=max_model_len,
        block_size=4,
        enable_prefix_caching=caching,
        **kw,
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = _prompts()
    one_by_one = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    return one_by_one + together, stats


def test_prefix_caching_gives_the_same_tokens_on_qwen3(qwen3_ckpt):
    off, stats_off = _run(qwen3_ckpt, False)
    on, stats = _run(qwen3_ckpt, True)
    assert on == off
    assert stats_off.prefix_cache_queries == stats_off.prefix_cache_hits == 0
    # one at a time: 0 + 36 + 32 + 16 + 0 + 16 tokens hit (full blocks, last token recomputed)
    assert stats.prefix_cache_hits >= 100
    assert stats.prefix_cache_queries == 2 * sum(len(p) for p in _prompts())
    # chunked prefill (chunks of 5) and preemption (20 blocks) with caching on
    assert _run(qwen3_ckpt, True, max_num_batched_tokens=5)[0] == off
    on_small, small = _run(qwen3_ckpt, True, max_model_len=64, num_blocks_override=20)
    assert on_small == off and small.num_preemptions > 0


def test_hit_counters_in_grpc_stats_and_prometheus(qwen3_ckpt):
    import grpc
    from grpc_helpers import ServerThread, request

    from moe_engine.core.outputs import CoreStats, KVCacheGroupStats, engine_stats
    from moe_engine.server.app import ServerOptions
    from moe_engine.server.metrics import ServerMetrics
    from moe_engine.server.pb import moe_engine_pb2 as pb
    from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
    from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig

    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks_override=64, enable_prefix_caching=True),
    )
    handle = ServerThread(config, ServerOptions(port=0))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
            for _ in range(2):
                list(stub.Generate(request(prompt, max_tokens=2, temperature=0.0)))
            stats = stub.GetServerStats(pb.GetServerStatsRequest())
    finally:
        handle.close()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (42, 20)
    assert stats.kv_cached_blocks >= 5 and stats.kv_blocks_free == 64
    assert [(g.kind, g.num_layers, g.blocks_used) for g in stats.kv_groups] == [
        ("full_attention", 3, 0)
    ]
    metrics = ServerMetrics()
    counts = dict.fromkeys(CoreStats.__struct_fields__[:15], 0)
    counts.update(prefix_cache_queries=42, prefix_cache_hits=20)
    group = KVCacheGroupStats(
        group=0, kind="full_attention", sliding_window=0, num_layers=3, kv_bytes_per_token=8,
        blocks_used=3,
    )
    metrics.update_from_stats(engine_stats([CoreStats(**counts, kv_groups=[group])]))
    reg = metrics.registry
    assert reg.get_sample_value("moe_engine_prefix_cache_queries_total") == 42
    assert reg.get_sample_value("moe_engine_prefix_cache_hits_total") == 20
    used = reg.get_sample_value(
        "moe_engine_kv_cache_group_blocks_used", {"group": "0", "kind": "full_attention"}
    )
    assert used == 3
