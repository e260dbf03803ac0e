"""verify_drafts: greedy prefix acceptance, and rejection sampling whose emitted tokens are
distributed exactly as plain sampling (a chi-square test at alpha 1e-3)."""

from __future__ import annotations

import pytest
import torch

from moe_engine.request import Request
from moe_engine.runner.sampler import Sampler
from moe_engine.runner.spec_decode.rejection import verify_drafts
from moe_engine.sampling_params import SamplingParams

#: Chi-square critical value, 5 degrees of freedom (V = 6), alpha = 1e-3.
CHI2_DF5_ALPHA_1E3 = 20.515
V = 6


def _requests(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [0], SamplingParams(**params)) for i in range(n)]


def test_greedy_accepts_the_matching_prefix() -> None:
    # argmax per row: request 0 rows -> 2, 3, 1; request 1 rows -> 4; request 2 -> 5, 0
    argmax = [2, 3, 1, 4, 5, 0]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
    out = verify_drafts(Sampler(), logits, _requests(3, temperature=0), [[2, 0], [], [5]])
    assert out.token_ids == [[2, 3], [4], [5, 0]]
    assert out.num_accepted == [1, 0, 1]
    assert out.rows == [[0, 1], [3], [4, 5]]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5  # rows: after the real token, after draft 0, after draft 1
    drafts = [1, 4]
    p = logits.double().softmax(-1)
    n, calls = 4000, 5
    sampler = Sampler(seed=1)
    first = torch.zeros(V)
    second = torch.zeros(V)  # the token after the first, when the first was draft 0
    accepted = 0
    for _ in range(calls):
        out = verify_drafts(
            sampler, logits.repeat(n, 1), _requests(n, temperature=1.0), [drafts] * n
        )
        for toks, m in zip(out.token_ids, out.num_accepted, strict=True):
            assert toks[:m] == drafts[:m] and len(toks) == m + 1
            first[toks[0]] += 1
            if toks[0] == drafts[0]:
                second[toks[1]] += 1
            accepted += m
    assert _chi2(first, p[0]) < CHI2_DF5_ALPHA_1E3
    assert _chi2(second, p[1]) < CHI2_DF5_ALPHA_1E3
    # both outcomes happen, and the first draft is accepted at its target probability
    assert 0 < accepted < 2 * n * calls
    assert abs(first[drafts[0]] / (n * calls) - p[0, drafts[0]]) < 0.02


def test_top_k_and_temperature_are_the_plain_samplers() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    params = dict(temperature=0.7, top_k=3)
    n = 6000
    out = verify_drafts(Sampler(seed=2), logits.repeat(n, 1), _requests(n, **params), [[0]] * n)
    counts = torch.zeros(V)
    for toks in out.token_ids:
        counts[toks[0]] += 1
    scaled = logits[0].double() / 0.7
    top = scaled.topk(3).indices
    target = torch.zeros(V, dtype=torch.float64)
    target[top] = scaled[top].softmax(-1)
    assert _chi2(counts, target) < CHI2_DF5_ALPHA_1E3


def test_seeded_requests_are_reproducible() -> None:
    logits = torch.randn(4, V)

    def run() -> list[list[int]]:
        reqs = _requests(2, temperature=1.0, seed=7)
        return verify_drafts(Sampler(seed=3), logits, reqs, [[2], [3]]).token_ids

    assert run() == run()


def test_row_count_mismatch() -> None:
    with pytest.raises(ValueError, match="logits: 3 rows, expected 4"):
        verify_drafts(Sampler(), torch.zeros(3, V), _requests(2, temperature=0), [[1], [2]])
