"""Weight versions that never lie (issue 45), on the engine core that `LLM` drives, step by step:
an update lands exactly where a test puts it (mid chunked prefill, mid decode, between two
requests sharing a prefix), with each pause mode.

Every completion's finished output lists the versions that sampled its tokens with the
output-token index each begins at (`EngineCoreOutput.weight_versions`) and says whether its
tokens read K/V computed with other weights (`kv_from_other_weights`). The oracle: tokens
labelled with the old version equal transformers' greedy continuation on the old checkpoint;
a request recomputed after a "retract" pause (or admitted after a flushing update) equals
transformers on the new checkpoint, token for token, and carries no flag.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import hf_greedy, perturbed_checkpoint

from moe_engine import LLM, SamplingParams
from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.kv_cache import KVCacheManager, SlidingWindowSpec
from moe_engine.request import Request
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig
from moe_engine.weight_update.messages import PauseGeneration, ResumeGeneration

#: 120 prompt tokens at 8 a step: 15 prefill steps.
PROMPT = list(range(3, 123))
BUDGET = 8
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def new_ckpt(qwen3_ckpt: Path, tmp_path_factory) -> Path:
    return perturbed_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("weight_versions"))


@pytest.fixture(scope="module")
def llm(qwen3_ckpt: Path) -> LLM:
    return LLM(str(qwen3_ckpt), max_model_len=256, max_num_batched_tokens=BUDGET,
               enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def restore(llm: LLM, qwen3_ckpt: Path):
    """After each test: the original weights as "default", nothing running or cached."""
    yield
    assert not llm.engine.scheduler.num_unfinished
    llm.update_weights_from_disk(str(qwen3_ckpt), "default")


def _steps(llm: LLM, n: int | None = None) -> list[EngineCoreOutput]:
    """`n` engine steps (None: until nothing is left); their outputs."""
    core, outs, i = llm.engine, [], 0
    while core.has_unfinished_requests() and (n is None or i < n):
        outs += core.step()
        i += 1
    return outs


def _control(llm: LLM, message) -> None:
    reply, ended = llm.engine.rollout.handle(message)
    reply.checked()
    assert not ended


def _run(llm: LLM, new_ckpt: Path, prompt: list[int], steps_before: int, pause: str | None,
         rid: str = "r", flush_cache: bool = True) -> tuple[list[int], EngineCoreOutput]:
    """One greedy request with an update to `new_ckpt` ("new") after `steps_before` steps,
    under `pause` (None: no pause); (its tokens, its finished output)."""
    llm.engine.add_request(rid, prompt, GREEDY)
    outs = _steps(llm, steps_before)
    if pause is not None:
        _control(llm, PauseGeneration(0, pause))
    llm.update_weights_from_disk(str(new_ckpt), "new", flush_cache=flush_cache)
    if pause is not None:
        _control(llm, ResumeGeneration(0))
    outs += _steps(llm)
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert all(o.weight_versions is None for o in outs[:-1])
    return [t for o in outs for t in o.new_token_ids], outs[-1]


@pytest.mark.parametrize("pause", [None, "keep"])
def test_an_update_mid_prefill_flags_the_old_kv(llm, new_ckpt, pause) -> None:
    """Defect (b) of issue 45: every token is sampled on the new weights, but the prompt's
    first chunks' K/V is the old weights': the output says so."""
    tokens, final = _run(llm, new_ckpt, PROMPT, 5, pause)
    assert final.weight_versions == [("new", 0)]
    assert final.kv_from_other_weights is True
    assert len(tokens) == N


def test_a_retract_mid_prefill_is_exact_on_the_new_weights(llm, new_ckpt) -> None:
    tokens, final = _run(llm, new_ckpt, PROMPT, 5, "retract")
    assert tokens == hf_greedy(new_ckpt, [PROMPT], N)[0]
    assert final.weight_versions == [("new", 0)]
    assert final.kv_from_other_weights is False


@pytest.mark.parametrize("pause", [None, "keep", "retract"])
def test_an_update_mid_decode_labels_where_the_new_version_begins(
        llm, qwen3_ckpt, new_ckpt, pause) -> None:
    """5 prefill steps (the last samples token 0), 3 decode steps: tokens 0..3 are the old
    weights'; from token 4 on the new ones sample."""
    prompt = PROMPT[:40]
    tokens, final = _run(llm, new_ckpt, prompt, 8, pause)
    old = hf_greedy(qwen3_ckpt, [prompt], N)[0]
    assert final.weight_versions == [("default", 0), ("new", 4)]
    assert tokens[:4] == old[:4]
    assert final.kv_from_other_weights is (pause != "retract")
    if pause == "retract":
        assert tokens[4:] == hf_greedy(new_ckpt, [prompt + tokens[:4]], N - 4)[0]


def test_the_prefix_cache_never_serves_other_weights_after_a_flush(
        llm, qwen3_ckpt, new_ckpt) -> None:
    """A request that straddles a flushing update caches its later blocks (computed on the
    old K/V); a request admitted afterwards with the same prompt finds none of them."""
    _run(llm, new_ckpt, PROMPT, 5, None, rid="straddles")
    assert llm.engine.kv.pool.num_cached_blocks > 0  # the straddler's later blocks
    llm.engine.add_request("after", PROMPT, GREEDY)
    outs = _steps(llm)
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(new_ckpt, [PROMPT], N)[0]
    assert (outs[-1].weight_versions, outs[-1].kv_from_other_weights) == ([("new", 0)], False)


def test_kept_prefix_cache_blocks_of_old_weights_are_flagged(llm, qwen3_ckpt, new_ckpt) -> None:
    """`flush_cache` false (`--keep-prefix-cache`): a later request reuses the old weights'
    blocks, and says so; the next flushing update ends that."""
    old = [o.outputs[0] for o in llm.generate([PROMPT], GREEDY, use_tqdm=False)][0]
    assert (old.weight_versions, old.kv_from_other_weights) == ([("default", 0)], False)
    llm.update_weights_from_disk(str(new_ckpt), "new", flush_cache=False)
    hits = llm.engine.kv.prefix_cache_hits
    kept = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert llm.engine.kv.prefix_cache_hits > hits  # the old blocks served it
    assert kept.weight_version == "new"
    assert (kept.outputs[0].weight_versions, kept.outputs[0].kv_from_other_weights) == (
        [("new", 0)], True)
    llm.update_weights_from_disk(str(new_ckpt), "new-flushed")
    fresh = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert fresh.token_ids == hf_greedy(new_ckpt, [PROMPT], N)[0]
    assert (fresh.weight_versions, fresh.kv_from_other_weights) == ([("new-flushed", 0)], False)
    hits = llm.engine.kv.prefix_cache_hits
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert llm.engine.kv.prefix_cache_hits > hits  # blocks of the weights serving: reused
    assert again.token_ids == fresh.token_ids
    assert (again.weight_versions, again.kv_from_other_weights) == ([("new-flushed", 0)], False)


def test_a_lookup_begun_before_a_flush_finds_no_block_of_older_weights() -> None:
    """The block tags, alone: a request looked up before the update (its hashes on the old
    chain) and a straddling request that caches its later blocks on that chain after the
    flush. A sliding-window group needs only the blocks before the end, so without the tags
    those blocks (K/V computed reading the old weights') would be a hit."""
    kv = KVCacheManager([SlidingWindowSpec(4, 2, 8, torch.float32, 2, 5)], 32,
                        enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4), kv)
    prompt = list(range(1, 18))  # 4 full blocks of 4 tokens, and one more token

    def step() -> None:
        out = sched.schedule()
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})

    sched.add_request(Request("straddles", prompt, SamplingParams(max_tokens=2)))
    step(), step()  # blocks 0 and 1 computed and cached
    looked_up = Request("looked-up", prompt, SamplingParams(max_tokens=2))
    assert kv.get_computed_blocks(looked_up).num_tokens == 8
    assert kv.new_weights(flush=True) == 2
    step(), step()  # blocks 2 and 3 cached after the flush, on the old chain
    assert kv.pool.num_cached_blocks == 2
    assert kv.get_computed_blocks(looked_up).num_tokens == 0
