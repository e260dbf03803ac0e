"""Speculative decoding (n-gram drafts) end to end in the engine core: greedy output with drafts
equals output without them and transformers' for Qwen3-MoE, gpt-oss (sliding window + full
attention groups) and DeepSeek-V3 (MLA), for K = 1..4, with chunked prefill, prefix caching and
preemption; seeded sampling is reproducible; KV blocks come back after rejections and aborts.
Each engine is stepped directly (no server); the prompts repeat spans so that drafts exist and
are both accepted and rejected (the tests check that they were)."""

from __future__ import annotations

import pytest
import torch
from fixtures import hf_greedy

from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from moe_engine.startup.spec_config import SpeculativeConfig

MAX_TOKENS = 20


def _prompts(seed: int = 5) -> list[list[int]]:
    """Prompts that repeat spans (n-gram drafts find matches) and one that does not."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(3, 200, (7,), generator=g).tolist()
    noise = torch.randint(3, 200, (30,), generator=g).tolist()
    return [span * 4, noise[:9] + span + noise[9:20] + span, noise, span[:3] * 5 + noise[:4]]


def _engine(
    ckpt,
    k: int | None,
    *,
    max_model_len: int = 128,
    budget: int = 64,
    num_blocks: int = 64,
    block_size: int = 16,
    caching: bool = False,
) -> EngineCore:
    spec = SpeculativeConfig("ngram", k, 1, 3, 0) if k else SpeculativeConfig()
    return build_engine_core(
        EngineConfig(
            model=ModelConfig(model=str(ckpt), max_model_len=max_model_len),
            cache=CacheConfig(
                block_size=block_size, num_blocks_override=num_blocks, enable_prefix_caching=caching
            ),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
            speculative=spec,
        )
    )


def _run(engine: EngineCore, prompts, params) -> list[list[int]]:
    return [ids for ids, _, _ in _run_full(engine, prompts, params)]


def _run_full(engine: EngineCore, prompts, params) -> list[tuple[list[int], list, str]]:
    """Per prompt: its tokens, its logprobs entries and its finish reason."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, tuple[list[int], list, list]] = {
        f"r{i}": ([], [], []) for i in range(len(prompts))
    }
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, lps, reason = got[out.request_id]
            ids += out.new_token_ids
            lps += out.logprobs or []
            if out.finished:
                reason.append(out.finish_reason)
    return [
        (ids, lps, reason[0]) for ids, lps, reason in (got[f"r{i}"] for i in range(len(prompts)))
    ]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(request):
    return {}


def _hf(ckpt, cache) -> list[list[int]]:
    if ckpt not in cache:
        cache[ckpt] = hf_greedy(ckpt, _prompts(), MAX_TOKENS)
    return cache[ckpt]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_qwen3_equals_transformers_with_drafts(qwen3_ckpt, expected, k):
    engine = _engine(qwen3_ckpt, k, budget=24)  # prompts of 28-42 tokens: chunked prefill
    free = engine.kv.num_free_blocks
    assert _run(engine, _prompts(), GREEDY) == _hf(qwen3_ckpt, expected)
    stats = engine.drafter.stats
    assert stats.num_accepted_tokens > 0, "no draft was ever accepted: the test shows nothing"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft was ever rejected"
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert engine.kv.num_free_blocks == free


class OracleProposer:
    """Drafts from the known greedy continuation (transformers'), every third step with its
    last draft wrong: acceptance and rejection both happen whatever the model generates
    (a tiny random model's output need not repeat itself, so n-gram drafts may all miss)."""

    def __init__(self, k: int, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.k, self.calls = k, 0
        self.known = [(p, o) for p, o in zip(prompts, outputs, strict=True)]

    def propose(self, token_ids, max_drafts) -> list[list[int]]:
        self.calls += 1
        out = []
        for tokens, room in zip(token_ids, max_drafts, strict=True):
            prompt, output = next((p, o) for p, o in self.known if list(tokens[: len(p)]) == p)
            done = len(tokens) - len(prompt)
            drafts = list(output[done : done + min(self.k, room)])
            if drafts and self.calls % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % 200
            out.append(drafts)
        return out


@pytest.mark.parametrize("name", ["gpt_oss_ckpt", "deepseek_v3_ckpt"])
def test_greedy_sliding_window_and_mla_equal_transformers(name, request, expected):
    ckpt = request.getfixturevalue(name)
    want = _hf(ckpt, expected)
    for k in (1, 3):
        engine = _engine(ckpt, k, block_size=4, budget=20)  # gpt-oss window 8: blocks drop out
        engine.drafter.proposer = OracleProposer(k, _prompts(), want)
        free = engine.kv.num_free_blocks
        assert _run(engine, _prompts(), GREEDY) == want
        stats = engine.drafter.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert engine.kv.num_free_blocks == free


def test_prefix_caching_and_preemption_keep_greedy_tokens(qwen3_ckpt, expected):
    """A pool too small for every request at once preempts (recompute); prefix caching hits on
    the second run of the same prompts; only accepted tokens' blocks are ever hashed, so the
    hits give the same tokens."""
    engine = _engine(qwen3_ckpt, 4, block_size=4, num_blocks=40, caching=True)
    free = engine.kv.num_free_blocks
    want = _hf(qwen3_ckpt, expected)
    assert _run(engine, _prompts(), GREEDY) == want
    assert engine.scheduler.num_preemptions > 0
    again = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert _run(engine, _prompts(), again) == want
    assert engine.kv.prefix_cache_hits > 0
    assert engine.kv.num_free_blocks == free


def test_seeded_sampling_is_reproducible_with_drafts(qwen3_ckpt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=11, ignore_eos=True)
    first = _run(_engine(qwen3_ckpt, 3), _prompts(), params)
    assert _run(_engine(qwen3_ckpt, 3), _prompts(), params) == first
    other = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=12, ignore_eos=True)
    assert _run(_engine(qwen3_ckpt, 3), _prompts(), other) != first


def test_stops_and_max_tokens_land_exactly_when_drafts_are_accepted(qwen3_ckpt, expected):
    """Several tokens land in one step: a stop token id, max_tokens and logprobs still cut and
    count exactly where they do without drafts."""
    base = _engine(qwen3_ckpt, None)
    spec = _engine(qwen3_ckpt, 4)
    want = _hf(qwen3_ckpt, expected)
    stop_id = want[0][6]  # a token the first request generates (and a repeated one, likely)
    for params in [
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2),
    ]:
        got, want_full = _run_full(spec, _prompts(), params), _run_full(base, _prompts(), params)
        for (ids, lps, reason), (ids0, lps0, reason0) in zip(got, want_full, strict=True):
            assert (ids, reason) == (ids0, reason0)
            assert len(lps) == len(lps0) == (len(ids) if params.logprobs is not None else 0)
            for (lp, top), (lp0, top0) in zip(lps, lps0, strict=True):
                # the verify pass computes a draft's logits in a multi-token forward
                assert lp == pytest.approx(lp0, abs=1e-4)
                assert top.keys() == top0.keys()
    assert spec.drafter.stats.num_accepted_tokens > 0


def test_aborts_mid_speculation_free_every_block(qwen3_ckpt):
    engine = _engine(qwen3_ckpt, 4, block_size=4, num_blocks=60)
    free = engine.kv.num_free_blocks
    for i, p in enumerate(_prompts() * 2):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    engine.abort_requests([f"a{i}" for i in range(0, 8, 2)])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == free
