"""`--scheduling-policy priority` (vLLM's): the waiting queue in (priority, arrival) order, and
the preemption victim the least urgent running request, even one scheduled earlier in the step;
fcfs unchanged, and a non-zero priority refused under it."""

from __future__ import annotations

import pytest
import torch

from moe_engine.core.validation import check_priority
from moe_engine.errors import RequestError
from moe_engine.kv_cache import FullAttentionSpec, KVCacheManager
from moe_engine.request import Request
from moe_engine.sampling_params import SamplingParams
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig


def make_scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    spec = FullAttentionSpec(4, 2, 8, torch.float32, 2)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy)
    return Scheduler(config, KVCacheManager([spec], num_blocks))


def make_request(rid: str, priority: int, arrival: float, prompt: int = 3,
                 max_tokens: int = 1) -> Request:  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority)
    return Request(rid, list(range(3, 3 + prompt)), params, arrival_time=arrival)


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.request.request_id: 7 for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    return out


def run_order(policy: str) -> list[str]:
    """Ids in the order they run, one at a time (max_num_seqs 1, one token each)."""
    sched = make_scheduler(policy, max_num_seqs=1)
    for rid, prio, arrival in [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 1, 3.0),
                               ("e", -5, 4.0)]:  # fmt: skip
        sched.add_request(make_request(rid, prio if policy == "priority" else 0, arrival))
    order = []
    while sched.num_unfinished:
        order += [s.request.request_id for s in step(sched).scheduled]
    return order


def test_waiting_queue_runs_lowest_priority_value_first_ties_by_arrival():
    assert run_order("priority") == ["e", "b", "d", "c", "a"]
    assert run_order("fcfs") == ["a", "b", "c", "d", "e"]


def fill_and_grow(policy: str):
    """5 blocks of 4 tokens: "lazy" (priority 5) prefills 8 tokens (2 blocks) alone, then
    decodes into a third block while "urgent" (priority 0) prefills 8 (2 blocks: the pool is
    full); at the next step lazy decodes within its third block and urgent needs one more."""
    sched = make_scheduler(policy, num_blocks=5)
    lazy = make_request("lazy", 5 if policy == "priority" else 0, 0.0, prompt=8, max_tokens=6)
    urgent = make_request("urgent", 0, 1.0, prompt=8, max_tokens=6)
    sched.add_request(lazy)
    step(sched)
    sched.add_request(urgent)
    second = step(sched)
    assert [s.request.request_id for s in second.scheduled] == ["lazy", "urgent"]
    assert sched.kv.pool.num_free_blocks == 0
    return sched, step(sched)


def test_priority_preempts_the_least_urgent_even_when_already_scheduled():
    sched, out = fill_and_grow("priority")
    # lazy took the free block first; urgent's allocation then evicts lazy, whose share of
    # the step is taken back
    assert out.preempted_ids == ["lazy"]
    assert [s.request.request_id for s in out.scheduled] == ["urgent"]
    assert [r.request_id for r in sched.running] == ["urgent"]
    assert [r.request_id for r in sched.waiting] == ["lazy"]
    assert sched.kv.pool.num_free_blocks == 2


def test_fcfs_preempts_the_newest():
    sched, out = fill_and_grow("fcfs")
    assert out.preempted_ids == ["urgent"]
    assert [s.request.request_id for s in out.scheduled] == ["lazy"]


def test_a_preempted_request_goes_back_to_its_place_in_priority_order():
    sched = make_scheduler("priority")
    sched.add_request(make_request("x", 1, 5.0))
    sched.add_request(make_request("y", 4, 0.0))
    victim = make_request("v", 2, 9.0)
    sched.requests["v"] = victim
    sched._preempt(victim)
    assert [r.request_id for r in sched.waiting] == ["x", "v", "y"]


def test_priority_is_refused_under_fcfs_naming_the_field():
    check_priority(SamplingParams(priority=0), "fcfs")
    check_priority(SamplingParams(priority=-3), "priority")
    with pytest.raises(RequestError) as info:
        check_priority(SamplingParams(priority=2), "fcfs")
    assert info.value.field == "priority"
    assert "--scheduling-policy" in str(info.value)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy .*--scheduling-policy.* got 'lifo'"):
        SchedulerConfig(policy="lifo")
