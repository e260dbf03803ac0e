"""SpeculativeConfig: which drafts a step proposes and how many (`--speculative-method`,
`--num-speculative-tokens`, `--ngram-min`, `--ngram-max`, `--speculative-disable-by-batch-size`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: Draft methods the engine implements.
SPECULATIVE_METHODS = ("ngram", "mtp")
#: Most draft tokens one request may carry into a step.
MAX_SPECULATIVE_TOKENS = 16
#: Drafts per request and step when a method is given without a count.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
#: `--speculative-disable-by-batch-size` by default (bench/NOTES.md section 18).
DEFAULT_DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): each running request
    proposes up to `num_speculative_tokens` draft tokens, one target forward verifies them all,
    and greedy output is the same as without speculation.

    Attributes:
        method: None (off), "ngram" (prompt lookup: the continuation of the latest earlier
            occurrence of the request's longest suffix n-gram, vLLM's `ngram`) or "mtp" (the
            checkpoint's multi-token-prediction layer, chained: DeepSeek-V3, GLM-4.5;
            `spec_decode/mtp.py`).
        num_speculative_tokens: drafts per request and step (1..MAX_SPECULATIVE_TOKENS).
        ngram_min, ngram_max: the n-gram lengths tried, longest first (tokens, 1 <= min <= max).
        disable_by_batch_size: no drafts in a step where this many requests or more are
            running (vLLM's `disable_by_batch_size`): at large batches the verification's extra
            tokens cost more than the steps they save (bench/NOTES.md section 18). 0: never.

    Raises:
        ValueError: naming the field, the value and the limit.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        # checked with or without a method: a flag that is given is never silently ignored
        if self.ngram_min < 1:
            raise ValueError(f"ngram_min: {self.ngram_min} is below 1")
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max: {self.ngram_max} is below ngram_min {self.ngram_min}")
        if self.disable_by_batch_size < 0:
            raise ValueError(
                f"speculative_disable_by_batch_size: {self.disable_by_batch_size} is below 0"
            )
        if self.method is None:
            if self.num_speculative_tokens:
                raise ValueError(
                    f"num_speculative_tokens: {self.num_speculative_tokens} without a "
                    f"speculative_method (one of {', '.join(SPECULATIVE_METHODS)})"
                )
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method: {self.method!r} is not one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens: {k} is outside 1..{MAX_SPECULATIVE_TOKENS} (required "
                f"with speculative_method {self.method!r})"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its step's tokens: an MTP chain writes the MTP
        layer's KV of K - 1 positions ahead (`spec_decode/mtp.py`); 0 for n-gram drafts."""
        return self.num_speculative_tokens - 1 if self.method == "mtp" else 0


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """`moe-serve`'s speculative decoding flags (vLLM's names, flattened)."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-method", choices=SPECULATIVE_METHODS, default=None,
        help="propose draft tokens and verify them in one forward (greedy output unchanged): "
        "ngram = prompt lookup in the request's own tokens; mtp = the checkpoint's "
        "multi-token-prediction layer (DeepSeek-V3, GLM-4.5: num_nextn_predict_layers) "
        "(default: off)",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", type=int, default=None, metavar="K",
        help=f"drafts per request and step, 1..{MAX_SPECULATIVE_TOKENS} (default with a "
        "method: 4)",
    )  # fmt: skip
    g.add_argument(
        "--ngram-min",
        type=int,
        default=1,
        metavar="N",
        help="shortest n-gram matched (tokens, default %(default)s)",
    )
    g.add_argument(
        "--ngram-max",
        type=int,
        default=4,
        metavar="N",
        help="longest n-gram matched, tried first (tokens, default %(default)s)",
    )
    g.add_argument(
        "--speculative-disable-by-batch-size", type=int, default=DEFAULT_DISABLE_BY_BATCH_SIZE,
        metavar="N",
        help="no drafts in steps with N or more running requests (0: never; default "
        "%(default)s, bench/NOTES.md section 18)",
    )  # fmt: skip


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The SpeculativeConfig the flags describe.

    Raises:
        ValueError: a value out of range, naming the flag's field.
    """
    return make_speculative_config(
        args.speculative_method, args.num_speculative_tokens, args.ngram_min, args.ngram_max,
        args.speculative_disable_by_batch_size,
    )  # fmt: skip


def make_speculative_config(
    method: str | None,
    num_speculative_tokens: int | None = None,
    ngram_min: int = 1,
    ngram_max: int = 4,
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE,
) -> SpeculativeConfig:
    """A SpeculativeConfig with `num_speculative_tokens` defaulting to 4 when a method is set
    (and 0 when none is).

    Raises:
        ValueError: see `SpeculativeConfig`.
    """
    if num_speculative_tokens is None:
        num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS if method else 0
    return SpeculativeConfig(
        method, num_speculative_tokens, ngram_min, ngram_max, disable_by_batch_size
    )
