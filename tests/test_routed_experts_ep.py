"""Routing replay at --ep-size 2 (issue 45): each rank runs its own requests and keeps their
routing in its own per-KV-slot store; the routed experts a served engine returns
(`EngineClient`, the front ends' one client) are the logical expert ids transformers' router
chooses, never the physical slots of a rank, for Qwen3-MoE and DeepSeek-V3 (sigmoid, correction
bias, groups), with prefix caching on and a parallel-sampling request; and a served engine
started without the flag refuses the field through the same client with INVALID_ARGUMENT
naming it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from routed_experts_helpers import assert_routing_equal

from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    prefix = torch.randint(3, 400, (40,), generator=g).tolist()
    return [prefix + [5, 6], torch.randint(3, 400, (9,), generator=g).tolist(),
            prefix + [7, 8, 9], list(range(30, 47))]


async def _collect(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams
                   ) -> list[tuple[list[int], np.ndarray | None]]:
    """Per completion: (output ids, routed experts or None)."""
    got: dict[int, list] = {}
    async for out in client.generate(rid, prompt, params):
        ids, _ = got.setdefault(out.index, [[], None])
        ids += out.new_token_ids
        if out.routed_experts is not None:
            got[out.index][1] = np.frombuffer(out.routed_experts, dtype="<i4").reshape(
                out.routed_experts_shape)
    return [tuple(got[i]) for i in range(params.n)]


async def _serve_and_generate(ckpt, enabled: bool) -> list:
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=64, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=2, collective_timeout_s=60),
        enable_return_routed_experts=enabled,
    )
    client = EngineClient()
    await client.start(config, startup_timeout_s=300)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                return_routed_experts=True)
        if not enabled:
            try:
                await _collect(client, "refused", [5, 6, 7], greedy)
            except RequestError as err:
                return [err]
            return []
        prompts = _prompts()
        jobs = [_collect(client, f"r{i}", p, greedy) for i, p in enumerate(prompts)]
        sampled = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True,
                                 return_routed_experts=True)
        jobs.append(_collect(client, "n2", prompts[1], sampled))
        results = await asyncio.gather(*jobs)
        later = await _collect(client, "again", prompts[2], greedy)  # a prefix-cache hit
        stats = await client.get_stats()
        return [results, later, stats]
    finally:
        await client.shutdown()


@pytest.mark.parametrize("name", [
    "qwen3_ckpt",
    pytest.param("deepseek_v3_ckpt", marks=pytest.mark.slow),  # a second server: ~30 s more
])
def test_ep2_routed_experts_equal_transformers(name, request) -> None:
    ckpt = request.getfixturevalue(name)
    results, later, stats = asyncio.run(_serve_and_generate(ckpt, enabled=True))
    prompts = _prompts()
    for prompt, [(ids, routed)] in zip(prompts, results[:4], strict=True):
        assert_routing_equal(routed, ckpt, prompt, ids)
    assert results[4][0][0] != results[4][1][0], "both completions sampled the same tokens"
    for ids, routed in results[4]:
        assert_routing_equal(routed, ckpt, prompts[1], ids)
    [(ids, routed)] = later
    assert_routing_equal(routed, ckpt, prompts[2], ids)
    assert stats.total.prefix_cache_hits > 0, "no prefix-cache hit on either rank"
    assert all(r.num_finished > 0 for r in stats.ranks), "a rank ran no request"


@pytest.mark.slow  # a third server; the core's refusal itself is tested at ep 1
def test_ep2_without_the_flag_refuses_naming_it(qwen3_ckpt) -> None:
    [err] = asyncio.run(_serve_and_generate(qwen3_ckpt, enabled=False))
    assert err.code == ErrorCode.INVALID_ARGUMENT and err.field == "return_routed_experts"
    assert "--enable-return-routed-experts" in str(err)
