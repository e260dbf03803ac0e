"""`--stream-interval N` (SchedulerConfig.stream_interval): a request's tokens leave the engine
core every N tokens, its first token and its last output at once; what is generated never
changes, and an abort still delivers the tokens not yet sent. One tiny Qwen3-MoE engine per
interval, stepped directly (no server)."""

from __future__ import annotations

import pytest
import torch

from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.errors import ParamError
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

PROMPT_LENS = [5, 17, 40]
MAX_TOKENS = [11, 1, 9]


def _engine(ckpt, interval: int) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24,
                                  stream_interval=interval),
    ))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(engine: EngineCore, logprobs: int | None = None, output_kind: str = "delta"):
    """Every output per request id, in order, until all finish."""
    for i, (prompt, n) in enumerate(zip(_prompts(), MAX_TOKENS, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs,
                                output_kind=output_kind)
        engine.add_request(f"r{i}", prompt, params)
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.fixture(scope="module")
def every_token(qwen3_ckpt):
    return _run(_engine(qwen3_ckpt, 1), logprobs=2)


@pytest.mark.parametrize("interval", [3, 4])
def test_same_tokens_fewer_outputs(qwen3_ckpt, every_token, interval):
    got = _run(_engine(qwen3_ckpt, interval), logprobs=2)
    for rid, outs in every_token.items():
        ids = [t for o in got[rid] for t in o.new_token_ids]
        assert ids == [t for o in outs for t in o.new_token_ids]
        assert all(len(o.new_token_ids) == 1 for o in outs)  # interval 1: one token each
        sizes = [len(o.new_token_ids) for o in got[rid]]
        n = len(ids)
        # the first token at once, then full intervals, the rest with the final output
        assert sizes == [1] + [interval] * ((n - 1) // interval) + (
            [(n - 1) % interval] if (n - 1) % interval else []
        )
        assert [o.finished for o in got[rid]] == [False] * (len(sizes) - 1) + [True]
        assert got[rid][-1].num_output_tokens == n
        # one logprobs entry per token, the same values
        lps = [lp for o in got[rid] for lp in o.logprobs]
        assert lps == [lp for o in outs for lp in o.logprobs]


def test_abort_delivers_unsent_tokens(qwen3_ckpt):
    engine = _engine(qwen3_ckpt, 8)
    engine.add_request("a", _prompts()[0], SamplingParams(max_tokens=50, temperature=0,
                                                          ignore_eos=True))
    sent: list[int] = []
    while len(sent) < 1 or engine.scheduler.requests["a"].num_output_tokens < 5:
        for out in engine.step():
            sent += out.new_token_ids
    generated = list(engine.scheduler.requests["a"].output_token_ids)
    assert sent == generated[:1]  # the first token at once, the next four held back
    (last,) = engine.abort_requests(["a"])
    assert last.finished and str(last.finish_reason) == "abort"
    assert sent + last.new_token_ids == generated
    assert not engine._unsent and not engine.has_unfinished_requests()


@pytest.mark.parametrize("interval", [1, 4])
def test_final_only_sends_one_output_with_every_token(qwen3_ckpt, every_token, interval):
    got = _run(_engine(qwen3_ckpt, interval), logprobs=2, output_kind="final_only")
    for rid, outs in every_token.items():
        (out,) = got[rid]
        assert out.finished and out.num_output_tokens == len(out.new_token_ids)
        assert out.new_token_ids == [t for o in outs for t in o.new_token_ids]
        assert out.logprobs == [lp for o in outs for lp in o.logprobs]
        assert out.decode_s is not None and out.decode_s >= 0
        assert all(o.decode_s is None for o in outs)  # deltas carry none


def test_final_only_abort_delivers_every_token(qwen3_ckpt):
    engine = _engine(qwen3_ckpt, 1)
    engine.add_request("a", _prompts()[0], SamplingParams(
        max_tokens=50, temperature=0, ignore_eos=True, output_kind="final_only"))
    while engine.scheduler.requests["a"].num_output_tokens < 5:
        assert engine.step() == []
    generated = list(engine.scheduler.requests["a"].output_token_ids)
    (last,) = engine.abort_requests(["a"])
    assert last.finished and str(last.finish_reason) == "abort"
    assert last.new_token_ids == generated
    assert not engine._unsent and not engine.has_unfinished_requests()


def test_bad_output_kind_is_refused():
    with pytest.raises(ParamError, match="output_kind must be one of delta, final_only, got 'x'"):
        SamplingParams(output_kind="x")


def test_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1 tokens, got 0"):
        SchedulerConfig(stream_interval=0)
