"""One step's sampling when some rows carry drafts: the plain `Sampler` for the rows without,
`verify_drafts` (rejection.py) for the rows with, and the logprobs of every emitted token.
"""

from __future__ import annotations

import torch

from moe_engine.runner.sampler import LogprobEntry, Sampler, StepSamples, to_host
from moe_engine.runner.spec_decode.rejection import verify_drafts
from moe_engine.scheduler import ScheduledRequest


def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledRequest]
) -> StepSamples:
    """The tokens each sampling row emits.

    Args:
        sampler: the engine's sampler (its generators: seeded requests stay reproducible).
        logits: [sum over rows of 1 + drafts, V] float32, requests-contiguous in `rows`'
            order (`model_runner._logits_indices`): per row its last real token's logits,
            then each draft's.
        rows: the step's sampling rows; a row with a grammar or logits processors
            (penalties, min_p, logit_bias) never has drafts (the engine proposes none for
            it), so the grammar mask and the processors are the plain sampler's.

    Returns:
        Per row its new tokens (accepted drafts + 1), their logprobs entries where asked
        for (the raw logits' log-softmax at each emitted token's row, as without drafts),
        and the drafts accepted.
    """
    counts = [1 + len(s.draft_token_ids) for s in rows]
    offsets = [sum(counts[:i]) for i in range(len(rows))]
    plain = [i for i, s in enumerate(rows) if not s.draft_token_ids]
    spec = [i for i, s in enumerate(rows) if s.draft_token_ids]
    out = StepSamples([[] for _ in rows], [None] * len(rows), [0] * len(rows))
    if plain:
        index = torch.tensor([offsets[i] for i in plain], device=logits.device)
        sub = StepSamples.of(sampler(logits[index], [rows[i].request for i in plain]))
        for j, i in enumerate(plain):
            out.token_ids[i], out.logprobs[i] = sub.token_ids[j], sub.logprobs[j]
    spec_rows = torch.tensor(
        [offsets[i] + c for i in spec for c in range(counts[i])], device=logits.device
    )
    spec_logits = logits[spec_rows]
    verified = verify_drafts(
        sampler, spec_logits, [rows[i].request for i in spec],
        [rows[i].draft_token_ids for i in spec],
    )  # fmt: skip
    for j, i in enumerate(spec):
        out.token_ids[i] = verified.token_ids[j]
        out.num_accepted[i] = verified.num_accepted[j]
    wanted = [j for j, i in enumerate(spec) if rows[i].request.sampling_params.logprobs is not None]
    if wanted:
        entries = _emitted_logprobs(spec_logits, verified, wanted, [rows[spec[j]] for j in wanted])
        for j, lps in zip(wanted, entries, strict=True):
            out.logprobs[spec[j]] = lps
    return out


def _emitted_logprobs(
    logits: torch.Tensor, verified, wanted: list[int], rows: list[ScheduledRequest]
) -> list[list[LogprobEntry]]:
    """Per wanted verified request (index into `verified`), one logprobs entry per emitted
    token, from the logits row it was chosen from (one read-back for all of them)."""
    index = [r for j in wanted for r in verified.rows[j]]
    tokens = [t for j in wanted for t in verified.token_ids[j]]
    requests = [s.request for j, s in zip(wanted, rows, strict=True) for _ in verified.token_ids[j]]
    device = logits.device
    host = to_host(
        logits[torch.tensor(index, device=device)], requests,
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )  # fmt: skip
    entries, start = [], 0
    for j in wanted:
        n = len(verified.token_ids[j])
        entries.append([e for e in host.logprobs[start : start + n] if e is not None])
        start += n
    return entries
