"""Compile every Triton kernel variant a step can launch at startup, so that no request waits
for Triton's compiler.

Triton compiles a kernel on its first launch with each new set of constexprs (tile configs,
split counts) and specialisations (an integer argument equal to 1 or a multiple of 16); on an
H100 each compile takes seconds, and a request whose step meets a new variant waits for it.
As vLLM does with dummy runs at its compile and capture sizes (`compile_or_warm_up_model`),
the engine runs dummy forwards after the profile run and before graph capture (`dummy_steps`),
one per variant class the kernels distinguish:

- fused MoE: one step per `TOKEN_BUCKETS` bucket of the tile-config table
  (`kernels.moe.fused_moe_configs.get_moe_config`) up to max_num_batched_tokens, with a token
  count that is a multiple of 16 and one that is not (and 1) where the bucket holds both;
- prefill attention: a chunk of each power-of-two query length up to the budget (the query
  tile follows `next_power_of_2(max_query_len)`);
- decode attention: one step per flash-decoding split count the kernel can pick
  (`splits_of(batch, max_keys)`, e.g. `paged_decode_splits`) over every batch size up to
  max_num_seqs and block-table widths up to max_model_len (the merge kernel is specialised
  on the same count).

The other Triton kernels a forward launches (the fused router, norms, rotary) compile in the
same steps, at the same token counts and so the same specialisations.

Every dummy step reads and writes only the null KV block, like the profile run
(`ModelRunner.dummy_run`). It runs on CUDA with compiled Triton only (`warm_up_skip_reason`):
on a CPU, with other backends, or under Triton's interpreter (nothing to compile) it is
skipped and costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kernels.moe.fused_moe_configs import TOKEN_BUCKETS
from kernels.plan import KernelPlan

logger = logging.getLogger(__name__)

#: (batch, max_keys) -> the flash-decoding split count the decode kernel launches with.
SplitsOf = Callable[[int, int], int]

#: Block-table widths tried for decode splits step by this many keys (the kernel's splits
#: change at multiples of its keys per split, 512 in `triton_attention`), up to this many.
SPLIT_KEYS_STEP, SPLIT_KEYS_SCAN = 256, 16 * 1024


@dataclass(frozen=True)
class DummyStep:
    """One dummy forward: requests of `q_lens` tokens each, every one ending at position
    `context_len` - 1 (block tables of ceil(context_len / block_size) null blocks).

    Attributes:
        q_lens: tokens per request (1 each: a decode step).
        context_len: each request's tokens including this step's (keys read).
        why: what variant it compiles (for the debug log).
    """

    q_lens: tuple[int, ...]
    context_len: int
    why: str

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def moe_token_counts(max_num_batched_tokens: int) -> list[int]:
    """Token counts (<= max_num_batched_tokens) that reach every `TOKEN_BUCKETS` bucket, each
    with a count that is a multiple of 16 and one that is not where the bucket holds both
    (Triton specialises integer arguments on divisibility by 16, and on the value 1).

    Returns:
        ascending, e.g. [1, 8, 15, 16, 63, 64] for 64.
    """
    limit = max(1, max_num_batched_tokens)
    counts, lower = {1}, 1
    # the last bucket's config serves every larger count too: its range ends at the limit
    for upper in [b for b in TOKEN_BUCKETS[:-1] if b < limit] + [limit]:
        if upper > lower:  # the bucket's range (lower, upper]: its end, and the other class
            counts.add(upper)
            other = upper - 1
            while other > lower and (other % 16 == 0) == (upper % 16 == 0):
                other -= 1
            if other > lower:
                counts.add(other)
        lower = upper
    return sorted(counts)


def prefill_query_lens(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Powers of two from 2 up to the longest chunk (min of the two limits), then that
    chunk: the prefill query tiles (`next_power_of_2(max_query_len)`)."""
    longest = min(max_num_batched_tokens, max_model_len)
    lens, q = [], 2
    while q < longest:
        lens.append(q)
        q *= 2
    return [*lens, longest] if longest >= 2 else []


def decode_split_steps(
    splits_of: SplitsOf, max_num_seqs: int, max_model_len: int, block_size: int
) -> list[tuple[int, int, int]]:
    """(splits, batch, context_len): one decode shape per split count `splits_of` gives over
    batches 1..max_num_seqs and block tables up to max_model_len, the smallest batch first.

    The widths tried: every `SPLIT_KEYS_STEP` keys up to `SPLIT_KEYS_SCAN` (rounded up to whole
    blocks), every block below the first step, and max_model_len itself."""
    found: dict[int, tuple[int, int]] = {}
    for context in _decode_contexts(max_model_len, block_size):
        keys = -(-context // block_size) * block_size
        for batch in range(1, max(1, max_num_seqs) + 1):
            found.setdefault(splits_of(batch, keys), (batch, context))
    return [(s, b, c) for s, (b, c) in sorted(found.items())]


def _decode_contexts(max_model_len: int, block_size: int) -> list[int]:
    small = range(block_size, min(max_model_len, SPLIT_KEYS_STEP) + 1, block_size)
    steps = range(SPLIT_KEYS_STEP, min(max_model_len, SPLIT_KEYS_SCAN) + 1, SPLIT_KEYS_STEP)
    return sorted({*small, *steps, max_model_len})


def dummy_steps(
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    splits_of: SplitsOf | None,
) -> list[DummyStep]:
    """The dummy forwards of the warm-up (see the module doc): prefill steps of one request
    (split in max_model_len chunks above it) per MoE token count and query tile, then one
    decode step per split count (none when `splits_of` is None: decode attention is not
    Triton's)."""
    steps = []
    counts = set(moe_token_counts(max_num_batched_tokens))
    counts |= set(prefill_query_lens(max_num_batched_tokens, max_model_len))
    for t in sorted(counts):
        q_lens = [max_model_len] * (t // max_model_len) + (
            [t % max_model_len] if t % max_model_len else []
        )
        context = min(max_model_len, max(q_lens))
        steps.append(DummyStep(tuple(q_lens), context, f"{t} tokens"))
    if splits_of is not None:
        for splits, batch, context in decode_split_steps(
            splits_of, max_num_seqs, max_model_len, block_size
        ):
            steps.append(DummyStep((1,) * batch, context, f"decode, {splits} KV splits"))
    return steps


def paged_decode_splits(num_kv_heads: int) -> SplitsOf:
    """`splits_of` for the Triton paged decode kernel: one program per (request, KV head)
    (`kernels.attention.triton_attention.num_kv_splits`)."""
    from kernels.attention.triton_attention import num_kv_splits

    return lambda batch, keys: num_kv_splits(batch * num_kv_heads, keys)


def mla_decode_splits(num_heads: int) -> SplitsOf:
    """`splits_of` for the Triton MLA decode kernel: one program per (request, 16 query heads)
    (its head tile is the 16-row `tl.dot` minimum, `triton_attention.MIN_TILE`)."""
    from kernels.attention.triton_attention import MIN_TILE, num_kv_splits

    head_blocks = -(-num_heads // MIN_TILE)
    return lambda batch, keys: num_kv_splits(batch * head_blocks, keys)


def warm_up_skip_reason(
    device: torch.device, kernels: KernelPlan, ops: Sequence[str]
) -> str | None:
    """Why the warm-up does not run (None: it runs): not CUDA, none of `ops` on Triton, or
    Triton's interpreter (`TRITON_INTERPRET=1`: nothing is compiled)."""
    if device.type != "cuda":
        return f"{device.type}: no Triton compilation"
    if not kernels.compiled_on_launch(ops):
        return "no op runs on Triton"
    if _interpreting():
        return "Triton's interpreter compiles nothing"
    return None


def _interpreting() -> bool:
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing to compile either
        return True
    return bool(knobs.runtime.interpret)


def warm_up(run: Callable[[DummyStep], None], steps: Sequence[DummyStep]) -> tuple[int, float]:
    """Run every dummy step; returns (Triton kernel variants compiled or loaded from Triton's
    cache meanwhile, wall seconds) and logs "compiled N kernel variants in X s"."""
    start = time.perf_counter()
    with _counting_compiles() as compiled:
        for step in steps:
            logger.debug("warm-up step: %s", step.why)
            run(step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    logger.info(
        "Triton warm-up: compiled %d kernel variants in %.1f s (%d dummy steps up to %d tokens)",
        compiled[0], seconds, len(steps), max((s.num_tokens for s in steps), default=0),
    )  # fmt: skip
    return compiled[0], seconds


@contextmanager
def _counting_compiles() -> Iterator[list[int]]:
    """Count Triton's compiles (its `jit_post_compile_hook`), chaining any hook already set."""
    from triton import knobs

    count = [0]
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return previous(*args, **kwargs) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield count
    finally:
        knobs.runtime.jit_post_compile_hook = previous
