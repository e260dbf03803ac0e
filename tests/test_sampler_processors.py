"""The sampler's logits processors (logit_bias, repetition/frequency/presence penalties, min_p)
against references: transformers' `RepetitionPenaltyLogitsProcessor`, `MinPLogitsWarper` and
`SequenceBiasLogitsProcessor`, and OpenAI's frequency/presence formula written out (transformers
has no such processor), on random logits for batches that mix rows with and without each."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from moe_engine.errors import ParamError
from moe_engine.request import Request
from moe_engine.runner.logits_processors import apply_min_p
from moe_engine.runner.sampler import Sampler
from moe_engine.runner.spec_decode.drafter import _may_draft
from moe_engine.sampling_params import SamplingParams

VOCAB = 300


def make_request(rid: str, gen: torch.Generator, **kw) -> Request:
    """A request with a random prompt and a random output so far (repeats included)."""
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 40, (1,), generator=gen)),),
                           generator=gen).tolist()  # fmt: skip
    r = Request(rid, prompt, SamplingParams(**kw))
    for t in torch.randint(0, 60, (int(torch.randint(0, 30, (1,), generator=gen)),),
                           generator=gen).tolist():  # fmt: skip
        r.append_token(t)
    return r


def reference(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One row's logits after logit_bias, then the repetition penalty (transformers), then
    OpenAI's frequency/presence penalties: vLLM v1's order."""
    p = req.sampling_params
    row = logits.clone()[None]
    ids = torch.tensor([req.prompt_token_ids + req.output_token_ids])
    if p.logit_bias:
        bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])
        row = bias(ids, row)
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.int64),
                            minlength=VOCAB).float()  # fmt: skip
    row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return row[0]


ROW_PARAMS = [
    {},
    {"repetition_penalty": 1.7},
    {"frequency_penalty": 0.8},
    {},
    {"presence_penalty": -1.5, "frequency_penalty": 2.0},
    {"repetition_penalty": 0.6, "presence_penalty": 1.0},
    {"logit_bias": {3: 100.0, 7: -100.0, 250: 5.5}},
    {"logit_bias": {0: -2.5}, "repetition_penalty": 1.3, "frequency_penalty": -0.4},
]


def test_penalties_and_logit_bias_match_transformers_on_a_mixed_batch():
    gen = torch.Generator().manual_seed(3)
    for trial in range(5):
        reqs = [make_request(f"{trial}-{i}", gen, temperature=0, logprobs=0, **kw)
                for i, kw in enumerate(ROW_PARAMS)]  # fmt: skip
        logits = torch.randn(len(reqs), VOCAB, generator=gen) * 4  # both signs
        raw = logits.clone()
        sampler = Sampler()
        processed = sampler._process(logits, reqs)
        assert torch.equal(logits, raw), "the raw logits (for logprobs) stay untouched"
        for i, r in enumerate(reqs):
            want = reference(raw[i], r)
            torch.testing.assert_close(processed[i], want, rtol=1e-6, atol=1e-5)
            if not ROW_PARAMS[i]:
                assert torch.equal(processed[i], raw[i])
        # greedy rows sample the processed argmax; logprobs stay the raw log-softmax
        out = sampler(logits.clone(), reqs)
        assert out.token_ids == processed.argmax(-1).tolist()
        logp = raw.log_softmax(-1)
        for i, (lp, _) in enumerate(out.logprobs):
            assert lp == pytest.approx(float(logp[i, out.token_ids[i]]), abs=1e-5)
        # without logprobs the processors work in place: the same result
        for r in reqs:
            r.sampling_params.logprobs = None
        in_place = raw.clone()
        assert sampler._process(in_place, reqs) is in_place
        torch.testing.assert_close(in_place, processed, rtol=0, atol=0)


def test_a_batch_without_processors_is_not_copied():
    gen = torch.Generator().manual_seed(0)
    reqs = [make_request(str(i), gen, temperature=0.7, top_p=0.9) for i in range(4)]
    logits = torch.randn(4, VOCAB)
    assert Sampler()._process(logits, reqs) is logits


def test_min_p_matches_transformers_and_only_its_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 0.0, 1.0, 0.6])
    masked = apply_min_p(logits, min_p)
    for i in range(6):
        want = logits[i : i + 1].clone()
        if min_p[i] > 0:
            want = MinPLogitsWarper(float(min_p[i]))(torch.zeros(1, 1, dtype=torch.long), want)
        assert torch.equal(torch.isfinite(masked[i]), torch.isfinite(want[0]))
    # through the sampler: rows with min_p draw only kept tokens, a row without draws others
    temps = [1.0, 0.5]
    reqs = [Request(f"m{i}", [1], SamplingParams(temperature=temps[i % 2],
                                                 min_p=0.2 if i % 3 else 0.0))
            for i in range(6)]  # fmt: skip
    flat = torch.randn(6, VOCAB, generator=gen) * 0.5
    seen: dict[int, set[int]] = {i: set() for i in range(6)}
    sampler = Sampler(seed=11)
    for _ in range(150):
        for i, t in enumerate(sampler(flat.clone(), reqs).token_ids):
            seen[i].add(t)
    for i, r in enumerate(reqs):
        p = r.sampling_params
        probs = (flat[i] / p.temperature).softmax(-1)
        keep = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
        if p.min_p:
            assert seen[i] <= keep
        else:
            assert seen[i] - keep, "a row without min_p is not masked"


def test_penalties_change_a_greedy_row_only_where_asked():
    # token 5 is the argmax and already in the output: a repetition penalty moves the
    # greedy choice away from it, the same row without it keeps it
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 9] = 4.0, 3.0
    a = Request("a", [1], SamplingParams(temperature=0, repetition_penalty=2.0))
    b = Request("b", [1], SamplingParams(temperature=0))
    for r in (a, b):
        r.append_token(5)
    assert Sampler()(logits, [a, b]).token_ids == [9, 5]


def test_requests_with_processors_take_no_drafts():
    plain = Request("p", [1, 2], SamplingParams())
    plain.num_computed_tokens = 1
    assert _may_draft(plain)
    for kw in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.5}, {"min_p": 0.1},
               {"logit_bias": {1: 1.0}}, {"frequency_penalty": -0.1}):  # fmt: skip
        r = Request("r", [1, 2], SamplingParams(**kw))
        r.num_computed_tokens = 1
        assert not _may_draft(r), kw


@pytest.mark.parametrize(
    ("kw", "field", "text"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "> 0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2], got 2.5"),
        ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2], got -2.01"),
        ({"min_p": 1.5}, "min_p", "[0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"logit_bias": {3: 101}}, "logit_bias", "[-100, 100], got 101"),
        ({"logit_bias": {-1: 1}}, "logit_bias", "negative"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "integer"),
        ({"logit_bias": [1, 2]}, "logit_bias", "map of token id"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "got 0"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ">= 1 or -1"),
        ({"priority": 1.5}, "priority", "integer"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw, field, text):
    with pytest.raises(ParamError) as info:
        SamplingParams(**kw)
    assert info.value.field == field
    assert text in str(info.value)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={VOCAB: 1.0})
    with pytest.raises(ParamError, match=rf"logit_bias token id {VOCAB} is outside \[0, {VOCAB}\)"):
        p.verify(VOCAB)
    SamplingParams(logit_bias={VOCAB - 1: 1.0}).verify(VOCAB)


def test_grammar_masked_tokens_stay_masked_under_bias_and_penalties():
    # the structured-output bitmask runs first (-inf): no bias or penalty brings a token back
    logits = torch.randn(1, VOCAB)
    logits[0, 10:] = float("-inf")
    r = Request("g", [50, 60], SamplingParams(temperature=0, logit_bias={50: 100.0},
                                              repetition_penalty=3.0, presence_penalty=-2.0))
    r.append_token(60)
    out = Sampler()._process(logits, [r])
    assert torch.isneginf(out[0, 10:]).all() and torch.isfinite(out[0, :10]).all()
    assert Sampler()(logits, [r]).token_ids[0] < 10


def test_moe_client_logit_bias_and_processor_fields():
    from moe_engine.cli.request_fields import build_request, parse_logit_bias

    req = build_request(prompt="x", logit_bias={"5": -100, 7: 2.5}, min_p=0.1, priority=-1)
    assert dict(req.logit_bias) == {5: -100.0, 7: 2.5} and req.priority == -1
    with pytest.raises(ValueError, match="logit_bias: key 'five' is not a token id"):
        build_request(prompt="x", logit_bias={"five": 1})
    assert parse_logit_bias("50256:-100, 13:2.5") == {50256: -100.0, 13: 2.5}


def test_the_token_cache_follows_outputs_that_grow_step_by_step():
    gen = torch.Generator().manual_seed(5)
    reqs = [make_request(f"s{i}", gen, temperature=0, logprobs=0, **kw)
            for i, kw in enumerate(ROW_PARAMS)]  # fmt: skip
    sampler = Sampler()
    for _ in range(6):
        raw = torch.randn(len(reqs), VOCAB, generator=gen) * 4
        processed = sampler._process(raw, reqs)
        for i, r in enumerate(reqs):
            torch.testing.assert_close(processed[i], reference(raw[i], r), rtol=1e-6, atol=1e-5)
        for r in reqs:  # repeats of earlier tokens and new ones
            r.append_token(int(torch.randint(0, 60, (1,), generator=gen)))
    sampler.forget("s1")
    assert "s1" not in sampler.token_cache.output and "s2" in sampler.token_cache.output
