"""Prefill/decode disaggregation on the engine cores (moe_engine/disagg): a prefill core runs
each prompt to its first token, Mooncake's TCP transfer engine (loopback) writes the blocks
into a decode core's cache, and the decode core continues. Greedy outputs equal transformers
(Qwen3-MoE, and gpt-oss whose sliding-window layers move only the blocks within the window),
with prefix caching on and off; every block returns to the pool on both sides, also when a
transfer fails or a request is aborted while its K/V is on the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import hf_greedy

from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.disagg.handoff import DecodeHandoff, KVPlacement, PrefillHandoff, kv_transfer_for
from moe_engine.disagg.kv_layout import _runs
from moe_engine.disagg.transfer import TransferError, mooncake_unavailable_reason
from moe_engine.errors import RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

pytestmark = [pytest.mark.skipif(mooncake_unavailable_reason() is not None,
                                 reason=str(mooncake_unavailable_reason())),
              pytest.mark.ci_must_run]

PROMPT_LENS = [1, 5, 16, 17, 40, 150, 300]
MAX_TOKENS = 6


def _core(ckpt: Path, prefix_caching: bool) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=512),
        cache=CacheConfig(num_blocks_override=96, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    ))


class Pair:
    """A prefill core and a decode core, each with its own transfer engine."""

    def __init__(self, ckpt: Path, prefix_caching: bool):
        self.p, self.d = _core(ckpt, prefix_caching), _core(ckpt, prefix_caching)
        p_transfer, p_cache = kv_transfer_for(self.p)
        self.d_transfer, d_cache = kv_transfer_for(self.d)
        self.prefill = PrefillHandoff(self.p, p_transfer, p_cache)
        self.decode = DecodeHandoff(self.d, d_cache)
        self.free_at_start = (self.p.kv.pool.num_free_blocks, self.d.kv.pool.num_free_blocks)

    def free_blocks(self) -> tuple[int, int]:
        return self.p.kv.pool.num_free_blocks, self.d.kv.pool.num_free_blocks

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        placements = {}
        for i, prompt in enumerate(prompts):
            placements[f"r{i}"] = self.decode.park(f"r{i}", prompt, params)
            self.prefill.add(f"r{i}", prompt, params)
        first: dict[str, int] = {}
        while self.p.has_unfinished_requests():
            for out in self.p.step():
                if out.finished:
                    (first[out.request_id],) = out.new_token_ids
        tokens: dict[str, list[int]] = {}
        for rid, placement in placements.items():
            self.prefill.send(rid, placement)
            for out in self.decode.arrived(rid, first[rid]):
                tokens.setdefault(rid, []).extend(out.new_token_ids)
        while self.d.has_unfinished_requests():
            for out in self.d.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[f"r{i}"] for i in range(len(prompts))]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("name", ["qwen3_ckpt", "gpt_oss_ckpt", "deepseek_v3_ckpt"])
def test_split_equals_transformers(request, name: str, prefix_caching: bool) -> None:
    ckpt = request.getfixturevalue(name)
    pair = Pair(ckpt, prefix_caching)
    prompts = _prompts(pair.d.vocab_size)
    expected = hf_greedy(ckpt, prompts, MAX_TOKENS)
    assert pair.generate(prompts, MAX_TOKENS) == expected
    if prefix_caching:  # again: the decode side's own prefix-cache hits skip those blocks
        hits = pair.d.kv.prefix_cache_hits
        assert pair.generate(prompts, MAX_TOKENS) == expected
        assert pair.d.kv.prefix_cache_hits > hits
    assert pair.free_blocks() == pair.free_at_start
    assert not pair.p.scheduler.held and not pair.d.scheduler.awaiting_kv


def test_failed_transfer_and_aborts_free_every_block(qwen3_ckpt: Path) -> None:
    pair = Pair(qwen3_ckpt, prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(3, 60))
    placement = pair.decode.park("a", prompt, params)
    assert pair.d.kv.pool.num_free_blocks < pair.free_at_start[1]
    assert not pair.d.has_unfinished_requests()  # parked: no step runs it
    pair.prefill.add("a", prompt, params)
    while pair.p.has_unfinished_requests():
        pair.p.step()
    assert pair.p.kv.pool.num_free_blocks < pair.free_at_start[0]  # held for the transfer
    closed = KVPlacement(placement.cache.__class__(
        "127.0.0.1:1", placement.cache.signature, placement.cache.groups,
        placement.cache.num_blocks), placement.tables, placement.first_block)
    with pytest.raises(TransferError, match="127.0.0.1:1"):
        pair.prefill.send("a", closed)
    (out,) = pair.decode.abort("a")
    assert out.finished and str(out.finish_reason) == "abort"
    with pytest.raises(KeyError):
        pair.decode.arrived("a", 5)
    with pytest.raises(KeyError):
        pair.prefill.send("a", placement)  # freed when the write failed
    assert pair.free_blocks() == pair.free_at_start
    # a parked request aborted before its K/V arrives, and a prefill nobody asks for
    pair.decode.park("b", prompt, params)
    pair.prefill.add("b", prompt, params)
    while pair.p.has_unfinished_requests():
        pair.p.step()
    pair.decode.abort("b")
    assert pair.prefill.release("b") and not pair.prefill.release("b")
    assert pair.free_blocks() == pair.free_at_start


def test_decode_side_refuses_when_full(qwen3_ckpt: Path) -> None:
    pair = Pair(qwen3_ckpt, prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(8):  # max_num_seqs
        pair.decode.park(f"q{i}", [3, 4, 5], params)
    with pytest.raises(RequestError, match="kv_cache: no free batch slot"):
        pair.decode.park("q8", [3, 4, 5], params)
    assert "q8" not in pair.d.scheduler.requests
    with pytest.raises(RequestError, match="n: a disaggregated request has one completion"):
        pair.decode.park("n2", [3, 4], SamplingParams(n=2))
    for i in range(8):
        pair.decode.abort(f"q{i}")
    assert pair.free_blocks() == pair.free_at_start


def test_runs_merge_consecutive_blocks() -> None:
    assert _runs([(3, 7), (4, 8), (5, 9), (9, 10), (10, 12)]) == [
        (3, 7, 3), (9, 10, 1), (10, 12, 1)]
    assert _runs([]) == []
