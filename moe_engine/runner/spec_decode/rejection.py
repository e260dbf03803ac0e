"""Verify draft tokens against the target model's logits: greedy prefix matching, and
rejection sampling that keeps the target distribution exactly (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023).

The drafts here come from a deterministic proposer (n-gram), so the draft distribution q is
one-hot at each draft x: draft j is accepted with probability min(1, p_j(x) / q(x)) = p_j(x),
and on a rejection the next token is drawn from the residual max(0, p_j - q), normalised,
which is p_j with x removed. When every draft is accepted the bonus token is drawn from the
last row's p. Each emitted token is then distributed exactly as plain sampling from p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_engine.request import Request
from moe_engine.runner.sampler import Sampler, apply_top_k_top_p


@dataclass
class VerifyOutput:
    """What the verification emits per request.

    Attributes:
        token_ids: per request, the accepted drafts then one more token (the correction, or
            the bonus token when every draft was accepted): 1..drafts+1 tokens.
        rows: per request, for each emitted token the row of `logits` it was chosen from.
        num_accepted: per request, the drafts accepted.
    """

    token_ids: list[list[int]]
    rows: list[list[int]]
    num_accepted: list[int]


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
) -> VerifyOutput:
    """Accept or reject every request's drafts from one target forward pass.

    Args:
        sampler: supplies each request's generator (`Sampler.generator_for`), so a seeded
            request draws the same numbers run after run.
        logits: [sum over requests of len(drafts[i]) + 1, V] float32, requests-contiguous:
            request i's rows are the logits after its last real token, then after each draft.
        requests: the requests (their SamplingParams: greedy, temperature, top_k, top_p).
        drafts: per request, its draft token ids (may be empty: then one token is sampled).

    Returns:
        The emitted tokens, their logits rows and the drafts accepted, per request.

    Raises:
        ValueError: if `logits` does not have one row per draft plus one per request.
    """
    if len(requests) != len(drafts):
        raise ValueError(f"drafts: {len(drafts)} entries for {len(requests)} requests")
    counts = [len(d) + 1 for d in drafts]
    if logits.shape[0] != sum(counts):
        raise ValueError(
            f"logits: {logits.shape[0]} rows, expected {sum(counts)} (drafts + 1 per request)"
        )
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    out = VerifyOutput([[] for _ in requests], [[] for _ in requests], [0] * len(requests))
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
    random = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if greedy:
        _verify_greedy(logits, greedy, offsets, drafts, out)
    if random:
        _verify_random(sampler, logits, random, offsets, requests, drafts, out)
    return out


def _verify_greedy(
    logits: torch.Tensor,
    which: list[int],
    offsets: list[int],
    drafts: Sequence[Sequence[int]],
    out: VerifyOutput,
) -> None:
    """Accept the longest prefix of drafts equal to the target's argmax, then its argmax."""
    index = torch.tensor(
        [offsets[i] + c for i in which for c in range(len(drafts[i]) + 1)],
        device=logits.device,
    )
    argmax = logits[index].argmax(dim=-1).tolist()
    pos = 0
    for i in which:
        target = argmax[pos : pos + len(drafts[i]) + 1]
        pos += len(drafts[i]) + 1
        m = 0
        while m < len(drafts[i]) and drafts[i][m] == target[m]:
            m += 1
        out.token_ids[i] = list(drafts[i][:m]) + [target[m]]
        out.rows[i] = [offsets[i] + c for c in range(m + 1)]
        out.num_accepted[i] = m


def _verify_random(
    sampler: Sampler,
    logits: torch.Tensor,
    which: list[int],
    offsets: list[int],
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    out: VerifyOutput,
) -> None:
    """Rejection sampling (module docstring): one read-back of every draft's target
    probability, the accept/reject draws on the host from each request's generator, then one
    exponential-race sample per request from its residual or its bonus row."""
    probs = _target_probs(logits, which, offsets, requests, drafts)
    device = logits.device
    # request j's rows of `probs` start at starts[j] (its drafts' rows, then its bonus row)
    starts = [0]
    for i in which:
        starts.append(starts[-1] + len(drafts[i]) + 1)
    draft_rows = torch.tensor(
        [starts[j] + c for j, i in enumerate(which) for c in range(len(drafts[i]))],
        dtype=torch.int64, device=device,
    )  # fmt: skip
    draft_ids = torch.tensor(
        [t for i in which for t in drafts[i]], dtype=torch.int64, device=device
    )
    p_draft = probs[draft_rows, draft_ids].tolist() if len(draft_ids) else []
    last_rows, removed, pos = [], [], 0
    for j, i in enumerate(which):
        gen = sampler.generator_for(requests[i])
        m = 0
        while m < len(drafts[i]) and torch.rand(1, generator=gen).item() < p_draft[pos + m]:
            m += 1
        pos += len(drafts[i])
        rejected = m < len(drafts[i])
        last_rows.append(starts[j] + m)
        removed.append(drafts[i][m] if rejected else -1)
        out.token_ids[i] = list(drafts[i][:m])
        out.rows[i] = [offsets[i] + c for c in range(m + 1)]
        out.num_accepted[i] = m
    final = _sample_final(sampler, probs, last_rows, removed, [requests[i] for i in which])
    for i, t in zip(which, final, strict=True):
        out.token_ids[i].append(t)


def _target_probs(
    logits: torch.Tensor,
    which: list[int],
    offsets: list[int],
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
) -> torch.Tensor:
    """[sum over `which` of drafts + 1, V] float32: p after temperature, top-k and top-p,
    exactly as the plain sampler computes it, for every row of the random requests."""
    device = logits.device
    index = torch.tensor(
        [offsets[i] + c for i in which for c in range(len(drafts[i]) + 1)], device=device
    )
    params = [requests[i].sampling_params for i in which for _ in range(len(drafts[i]) + 1)]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    scaled = logits[index] / temperature.to(device)[:, None]
    scaled = apply_top_k_top_p(
        scaled,
        torch.tensor([p.top_k for p in params]).to(device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device),
    )
    return scaled.softmax(dim=-1)


def _sample_final(
    sampler: Sampler,
    probs: torch.Tensor,
    rows: list[int],
    removed: list[int],
    requests: list[Request],
) -> list[int]:
    """One token per request from `probs[rows[i]]` with token `removed[i]` zeroed (-1: none),
    by the exponential race (argmax p / q, q ~ Exp(1): an exact sample of p normalised)."""
    device = probs.device
    p = probs[torch.tensor(rows, device=device)].clone()
    for i, t in enumerate(removed):
        if t >= 0:
            p[i, t] = 0.0
    noise = torch.empty(p.shape, dtype=p.dtype)
    for i, req in enumerate(requests):
        noise[i].exponential_(generator=sampler.generator_for(req))
    return (p / noise.to(device)).argmax(dim=-1).tolist()
