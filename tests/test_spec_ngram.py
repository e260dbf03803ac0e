"""NgramProposer (batched prompt lookup) against the plain-Python definition."""

from __future__ import annotations

import random

import pytest

from moe_engine.runner.spec_decode.ngram import NgramProposer, propose_ngram_reference


def test_examples() -> None:
    p = NgramProposer(3, 1, 3)
    # suffix "1 2" occurs at 0 and 4: the latest (4) is followed by 9 then the suffix itself.
    assert p.propose([[1, 2, 7, 8, 1, 2, 9, 1, 2]], [5]) == [[9, 1, 2]]
    # no earlier occurrence of any suffix n-gram: no drafts
    assert p.propose([[1, 2, 3, 4]], [5]) == [[]]
    # max_drafts caps, and 0 gives none
    assert p.propose([[5, 6, 7, 5, 6]], [1]) == [[7]]
    assert p.propose([[5, 6, 7, 5, 6]], [0]) == [[]]
    # fewer tokens follow the match than K: the loop it found repeats (period 3, then 1)
    assert NgramProposer(4, 1, 2).propose([[1, 2, 3, 1, 2]], [9]) == [[3, 1, 2, 3]]
    assert NgramProposer(3, 1, 3).propose([[4, 9, 9, 9]], [9]) == [[9, 9, 9]]
    assert propose_ngram_reference([1, 2, 3, 1, 2], 4, 1, 2) == [3, 1, 2, 3]
    # too short to hold a match
    assert p.propose([[4], []], [3, 3]) == [[], []]


def test_longest_n_wins() -> None:
    # the 1-gram "3" latest occurs at 5 (followed by 8); the 2-gram "2 3" at 1 (followed by 4)
    tokens = [1, 2, 3, 4, 0, 3, 8, 2, 3]
    assert NgramProposer(2, 1, 2).propose([tokens], [2]) == [[4, 0]]
    assert NgramProposer(2, 1, 1).propose([tokens], [2]) == [[8, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_batched_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    k, lo, hi = rng.randint(1, 5), rng.randint(1, 2), rng.randint(2, 5)
    lookback = rng.choice([8, 64, 4096])
    p = NgramProposer(k, lo, hi, max_lookback=lookback)
    batch = [
        [rng.randrange(rng.choice([3, 6, 50])) for _ in range(rng.randint(0, 120))]
        for _ in range(rng.randint(1, 12))
    ]
    limits = [rng.randint(-1, 6) for _ in batch]
    got = p.propose(batch, limits)
    want = [
        propose_ngram_reference(t, min(k, m), lo, hi, lookback) if m > 0 else []
        for t, m in zip(batch, limits, strict=True)
    ]
    assert got == want


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens: 0"):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError, match="min_n: 0"):
        NgramProposer(2, 0, 2)
    with pytest.raises(ValueError, match="max_n: 1 is below min_n 2"):
        NgramProposer(2, 2, 1)
    with pytest.raises(ValueError, match="max_drafts: 1 entries for 2"):
        NgramProposer(2, 1, 2).propose([[1], [2]], [1])


def test_draft_length_adapts_to_what_is_accepted() -> None:
    """`Drafter`: m + 1 drafts after m of k were accepted, one more after all were, none for
    DRAFT_COOLDOWN_STEPS steps after a single rejected draft; the counters see every step."""
    from moe_engine.request import Request
    from moe_engine.runner.spec_decode.drafter import DRAFT_COOLDOWN_STEPS, Drafter
    from moe_engine.sampling_params import SamplingParams
    from moe_engine.startup.spec_config import SpeculativeConfig

    drafter = Drafter(SpeculativeConfig("ngram", 4, 1, 3, 0))
    req = Request("r", [1, 2, 1, 2, 1, 2, 1], SamplingParams(max_tokens=100))
    req.num_computed_tokens = req.num_tokens - 1  # decoding next

    def drafts() -> list[int]:
        drafter.propose([req])
        return req.spec_token_ids

    assert drafts() == [2, 1, 2, 1]
    drafter.record(req, 4, 1)
    assert drafts() == [2, 1]
    drafter.record(req, 2, 2)
    assert drafts() == [2, 1, 2]
    drafter.record(req, 3, 0)
    assert drafts() == [2]
    drafter.record(req, 1, 0)
    assert [drafts() for _ in range(DRAFT_COOLDOWN_STEPS)] == [[]] * DRAFT_COOLDOWN_STEPS
    assert drafts() == [2]
    drafter.record(req, 1, 1)
    assert drafts() == [2, 1]
    s = drafter.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (5, 11, 4)
    assert s.accepted_per_pos == [3, 1, 0, 0]


def test_speculative_flags_are_checked_without_a_method() -> None:
    """A bad n-gram or disable-by value is refused even with speculation off (never ignored)."""
    from moe_engine.startup.spec_config import SpeculativeConfig

    with pytest.raises(ValueError, match="ngram_max: 3 is below ngram_min 5"):
        SpeculativeConfig(None, 0, 5, 3)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size: -1 is below 0"):
        SpeculativeConfig(None, 0, 1, 4, -1)
    with pytest.raises(ValueError, match="num_speculative_tokens: 4 without a speculative_method"):
        SpeculativeConfig(None, 4)
