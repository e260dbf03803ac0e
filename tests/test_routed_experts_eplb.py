"""Routing replay under runtime EPLB at --ep-size 2 (issue 45): with redundant experts, a skewed
router and rebalances while requests run, the routed experts a served engine returns are still
the logical ids transformers' router chooses (never a replica's physical slot), with n-gram
speculation on (only accepted tokens' routing is returned) and prefix caching on (a later
request's cached prefix keeps the routing recorded when it was computed, across the move).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from routed_experts_helpers import assert_routing_equal
from skewed_checkpoint import make_skewed_checkpoint

from moe_engine.engine.client import EngineClient
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    EplbConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_skewed_checkpoint(tmp_path_factory.mktemp("replay_eplb"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(45)
    prefix = torch.randint(3, 400, (36,), generator=g).tolist()
    # repeated n-grams give the n-gram drafter something to propose
    loop = torch.randint(3, 400, (6,), generator=g).tolist() * 4
    return [prefix + [5, 6], loop, torch.randint(3, 400, (11,), generator=g).tolist(),
            loop[:9] + prefix[:7]]


async def _one(client: EngineClient, rid: str, prompt: list[int], max_tokens: int
               ) -> tuple[list[int], np.ndarray | None]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            return_routed_experts=True)
    ids: list[int] = []
    routed = None
    async for out in client.generate(rid, prompt, params):
        ids += out.new_token_ids
        if out.routed_experts is not None:
            routed = np.frombuffer(out.routed_experts, dtype="<i4").reshape(
                out.routed_experts_shape)
    return ids, routed


async def _serve(ckpt: Path) -> tuple[list, list, object]:
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=160),
        cache=CacheConfig(num_blocks_override=64, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=2, collective_timeout_s=60),
        speculative=SpeculativeConfig("ngram", 3, 1, 3, 0),
        eplb=EplbConfig(enabled=True, window_steps=4, step_interval=4,
                        num_redundant_experts=2, balancedness_threshold=1.0),
        enable_return_routed_experts=True,
    )
    client = EngineClient()
    await client.start(config, startup_timeout_s=300)
    try:
        prompts = _prompts()
        first = await asyncio.gather(*[_one(client, f"a{i}", p, 40)
                                       for i, p in enumerate(prompts)])
        # after the rebalances above: the cached prefix of prompt 0, then new tokens
        later = await asyncio.gather(_one(client, "b0", prompts[0][:36] + [9, 10, 11], 12),
                                     _one(client, "b1", prompts[3], 12))
        stats = await client.get_stats()
        return first, later, stats
    finally:
        await client.shutdown()


def test_routed_experts_stay_logical_across_eplb_with_speculation(skewed: Path) -> None:
    first, later, stats = asyncio.run(_serve(skewed))
    prompts = _prompts()
    assert stats.total.eplb.num_rebalances >= 1, "no rebalance happened while the requests ran"
    for prompt, (ids, routed) in zip(prompts, first, strict=True):
        assert_routing_equal(routed, skewed, prompt, ids)
    for prompt, (ids, routed) in zip([prompts[0][:36] + [9, 10, 11], prompts[3]], later,
                                     strict=True):
        assert_routing_equal(routed, skewed, prompt, ids)
    assert stats.total.prefix_cache_hits > 0, "no prefix-cache hit"
    assert stats.total.spec_decode_num_accepted_tokens > 0, "no draft accepted"
