"""N-gram (prompt lookup) drafts: the continuation of the latest earlier occurrence of a
request's longest suffix n-gram, in its own prompt and output (Saxena 2023, "Prompt Lookup
Decoding"; vLLM's `ngram` method).

`NgramProposer.propose` matches every request of the batch at once: the requests' last
`max_lookback` tokens sit right-aligned in one padded matrix, and for each n (longest first)
one comparison of all length-n windows against each row's suffix finds every match.
`propose_ngram_reference` is the plain-Python definition the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: Padding of the batch matrix; never equal to a token id (they are >= 0).
_PAD = -1


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per request by prompt lookup.

    For n from `max_n` down to `min_n`: if the request's last n tokens occur earlier in its
    last `max_lookback` tokens, the drafts are the tokens that followed the latest such
    occurrence (at most `num_speculative_tokens`). When fewer tokens follow it than that, the
    sequence is read as repeating with the period the match found (the d tokens from the
    match to the end), so a loop shorter than K still fills K drafts: after ``1 2 3 1 2`` the
    suffix ``1 2`` matched d = 3 tokens back proposes ``3 1 2 3`` (vLLM stops at ``3``). No
    match at any n: no drafts.

    Args:
        num_speculative_tokens: the most drafts per request (>= 1).
        min_n, max_n: the n-gram lengths tried (tokens; 1 <= min_n <= max_n).
        max_lookback: how many of the latest tokens are searched (tokens; bounds the cost per
            step at batch x max_lookback x (max_n - min_n + 1) comparisons of n tokens).

    Raises:
        ValueError: naming the argument, its value and the limit.
    """

    def __init__(
        self, num_speculative_tokens: int, min_n: int, max_n: int, max_lookback: int = 4096
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: {num_speculative_tokens} is below 1")
        if min_n < 1:
            raise ValueError(f"min_n: {min_n} is below 1")
        if max_n < min_n:
            raise ValueError(f"max_n: {max_n} is below min_n {min_n}")
        if max_lookback <= max_n:
            raise ValueError(f"max_lookback: {max_lookback} is not above max_n {max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.max_lookback = max_lookback

    def propose(
        self, token_ids: Sequence[Sequence[int]], max_drafts: Sequence[int]
    ) -> list[list[int]]:
        """The drafts of each request.

        Args:
            token_ids: per request, its tokens so far (prompt then output; ids >= 0).
            max_drafts: per request, the most drafts it may take (e.g. what its max_tokens
                leaves room for); <= 0 gives none.

        Returns:
            Per request, 0..min(num_speculative_tokens, max_drafts[i]) draft token ids.

        Raises:
            ValueError: if the two sequences differ in length.
        """
        if len(token_ids) != len(max_drafts):
            raise ValueError(f"max_drafts: {len(max_drafts)} entries for {len(token_ids)} requests")
        limits = [min(self.num_speculative_tokens, m) for m in max_drafts]
        active = [i for i, m in enumerate(limits) if m > 0 and len(token_ids[i]) > self.min_n]
        out: list[list[int]] = [[] for _ in token_ids]
        if not active:
            return out
        tokens = _right_aligned([token_ids[i] for i in active], self.max_lookback)
        follow = self._match(tokens)
        for row, i in enumerate(active):
            start = follow[row]
            if start >= 0:
                out[i] = _continuation(tokens[row, start:].tolist(), limits[i])
        return out

    def _match(self, tokens: np.ndarray) -> np.ndarray:
        """[B] int64: per row, the column where its drafts start (-1: no match).

        tokens: [B, W] int64, right-aligned, padded on the left with _PAD.
        """
        rows, width = tokens.shape
        follow = np.full(rows, -1, dtype=np.int64)
        lengths = (tokens != _PAD).sum(axis=1)
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            todo = (follow < 0) & (lengths > n)
            if not todo.any():
                break
            suffix = tokens[:, width - n :]
            # Windows starting at 0..width-n-1: each is followed by at least one token, and
            # the suffix itself (starting at width-n) is not among them.
            windows = sliding_window_view(tokens[:, : width - 1], n, axis=1)
            hits = (windows == suffix[:, None, :]).all(axis=2) & todo[:, None]
            found = hits.any(axis=1)
            latest = windows.shape[1] - 1 - hits[:, ::-1].argmax(axis=1)
            follow = np.where(found, latest + n, follow)
        return follow


def _continuation(follow: list[int], k: int) -> list[int]:
    """The first k tokens of `follow` repeated: what follows a match d = len(follow) >= 1
    tokens before the end, continued with period d."""
    d = len(follow)
    return [follow[j % d] for j in range(k)]


def _right_aligned(token_ids: Sequence[Sequence[int]], max_lookback: int) -> np.ndarray:
    """[B, W] int64: each request's last min(len, max_lookback) tokens at the right, _PAD to
    the left; W is the longest of them."""
    tails = [np.asarray(t[-max_lookback:], dtype=np.int64) for t in token_ids]
    width = max(len(t) for t in tails)
    out = np.full((len(tails), width), _PAD, dtype=np.int64)
    for row, t in enumerate(tails):
        out[row, width - len(t) :] = t
    return out


def propose_ngram_reference(
    token_ids: Sequence[int], k: int, min_n: int, max_n: int, max_lookback: int = 4096
) -> list[int]:
    """One request's drafts by the plain definition (the tests' oracle for `NgramProposer`).

    Args:
        token_ids: the request's tokens; k: the most drafts; min_n, max_n: n-gram lengths.
    """
    tokens = list(token_ids)[-max_lookback:]
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if size <= n:
            continue
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n :]
                return [follow[j % len(follow)] for j in range(k)]
    return []
