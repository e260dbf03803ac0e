"""Turn last-position logits into tokens: greedy, temperature, top-k, top-p, min_p, seeds,
logprobs, and the logits processors (logit_bias, penalties: `logits_processors`).

Vectorised over the batch. Random rows use the exponential-race trick (argmax of p / q with
q ~ Exp(1)), which samples exactly from p and lets each seeded request draw its noise from its
own generator, as vLLM's sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine.request import Request
from moe_engine.runner.logits_processors import (
    TokenCache,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
)
from moe_engine.structured_output import GrammarBitmask


@dataclass
class SamplerOutput:
    """Sampled tokens and, where asked for, logprobs.

    Attributes:
        token_ids: [N] int64, one per row.
        logprobs: per row, None or (sampled token's logprob, {top token id: logprob}).
    """

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None]


#: One generated token's logprobs: (its logprob, {top token id: logprob}).
LogprobEntry = tuple[float, dict[int, float]]


@dataclass
class StepSamples:
    """What one step emits per sampling row (`ModelRunner.execute`).

    Attributes:
        token_ids: per row, its new tokens: one, or with drafts the accepted drafts and one
            more (the correction, or the bonus token when every draft was accepted).
        logprobs: per row, None (not asked for) or one entry per new token.
        num_accepted: per row, drafts accepted (0 for a row without drafts).
        proposals: with MTP drafts (`spec_decode.mtp`), per row the drafts proposed for its
            next step ([] where none); None otherwise.
    """

    token_ids: list[list[int]]
    logprobs: list[list[LogprobEntry] | None]
    num_accepted: list[int]
    proposals: list[list[int]] | None = None

    @classmethod
    def of(cls, out: SamplerOutput) -> StepSamples:
        """One token per row, from the plain sampler."""
        return cls(
            [[t] for t in out.token_ids],
            [None if lp is None else [lp] for lp in out.logprobs],
            [0] * len(out.token_ids),
        )


class Sampler:
    """Samples one token per row of logits.

    Args:
        seed: seeds the generator of rows without a per-request seed.
        max_num_seqs: the most rows of one step (sizes the structured-output bitmask, which is
            allocated on the first step with a grammar row).
    """

    def __init__(self, seed: int = 0, max_num_seqs: int = 64) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.grammar_bitmask = GrammarBitmask(max_num_seqs)
        #: The requests' prompt and output id tensors the penalties reuse
        #: (`logits_processors.apply_penalties`); a request's are dropped by `forget`.
        self.token_cache = TokenCache()

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator and cached prompt ids."""
        self._request_generators.pop(request_id, None)
        self.token_cache.forget(request_id)

    def skip_draw(self, req: Request, vocab_size: int) -> None:
        """Advance a seeded, non-greedy request's generator past one token's noise (a
        [vocab_size] float32 draw, what `_sample` takes per token), as if this sampler had
        drawn a token another instance drew (a disaggregated request's first token), so the
        same seed gives the same tokens as on one instance. Nothing for other requests."""
        if req.sampling_params.seed is not None and not req.sampling_params.greedy:
            torch.empty(vocab_size, dtype=torch.float32).exponential_(
                generator=self.generator_for(req))

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [N, V] float32 on the engine's device, one row per request in `requests`.

        Everything stays on the logits' device until one copy brings the sampled ids, and
        the logprobs asked for, back to the host together (the step's one host sync).
        Rows of requests with a grammar (structured output) are masked in place first, so
        sampling and logprobs see only the tokens the grammar allows (as vLLM v1). Then, when
        some row asks for them, logit_bias and the penalties (`logits_processors`), which
        greedy rows see too; the logprobs stay those of the masked raw logits (vLLM's default
        `raw_logprobs`): the processors work on a copy when a row wants logprobs, else in
        place (the caller's `logits` is then changed).
        """
        self.grammar_bitmask.apply(logits, requests)
        processed = self._process(logits, requests)
        greedy = [r.sampling_params.greedy for r in requests]
        token_ids = processed.argmax(dim=-1)
        if not all(greedy):
            random_rows = [i for i, g in enumerate(greedy) if not g]
            index = torch.tensor(random_rows, device=logits.device)
            sub = [requests[i] for i in random_rows]
            token_ids[index] = self._sample(processed[index], sub)
        return to_host(logits, requests, token_ids)

    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` with logit_bias and the penalties applied when a row has them (checked on
        the host first: a batch without them touches nothing): in place, or on a copy when a
        row asks for logprobs (which are those of the raw logits)."""
        if not any(r.sampling_params.logit_bias or r.sampling_params.has_penalties
                   for r in requests):
            return logits
        keep_raw = any(r.sampling_params.logprobs is not None for r in requests)
        processed = logits.contiguous()  # a copy already when `logits` is not contiguous
        if keep_raw and processed is logits:
            processed = logits.clone()
        apply_logit_bias(processed, requests)
        apply_penalties(processed, requests, self.token_cache)
        return processed

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        logits = logits / temperature.to(device)[:, None]
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
            logits = apply_min_p(logits, min_p.to(device))
        logits = apply_top_k_top_p(
            logits,
            torch.tensor([p.top_k for p in params]).to(device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device),
        )
        probs = logits.softmax(dim=-1)
        # The generators are host ones on every device, so a seed draws the same noise (and
        # the same tokens) on a CPU and on CUDA.
        noise = torch.empty(probs.shape, dtype=probs.dtype)
        for i, req in enumerate(requests):
            noise[i].exponential_(generator=self.generator_for(req))
        return (probs / noise.to(device)).argmax(dim=-1)

    def generator_for(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._request_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._request_generators[req.request_id] = gen
        return gen


def to_host(
    logits: torch.Tensor, requests: list[Request], token_ids: torch.Tensor
) -> SamplerOutput:
    """The sampled ids and the logprobs asked for, read back in one device-to-host copy.

    Args:
        logits: [N, V] float32; token_ids: [N] int64 sampled, on the logits' device.

    The logprobs are the raw logits' log-softmax (vLLM's default); ids and float32 logprobs
    travel as float64, which holds both exactly.
    """
    wanted = [r.sampling_params.logprobs for r in requests]
    out: list[tuple[float, dict[int, float]] | None] = [None] * len(requests)
    rows = [i for i, n in enumerate(wanted) if n is not None]
    if not rows:
        return SamplerOutput(token_ids.tolist(), out)
    index = torch.tensor(rows, device=logits.device)
    logp = logits[index].log_softmax(dim=-1)
    sampled = logp.gather(1, token_ids[index, None]).flatten()
    k = max(wanted[i] for i in rows)
    parts = [token_ids.double(), sampled.double()]
    if k > 0:
        top_vals, top_ids = logp.topk(k, dim=-1)
        parts += [top_vals.flatten().double(), top_ids.flatten().double()]
    host = torch.cat(parts).tolist()
    n, r = len(requests), len(rows)
    ids = [int(v) for v in host[:n]]
    top_vals_h, top_ids_h = host[n + r : n + r + r * k], host[n + r + r * k :]
    for j, i in enumerate(rows):
        m = wanted[i]
        top = {int(top_ids_h[j * k + c]): top_vals_h[j * k + c] for c in range(m or 0)}
        out[i] = (host[n + j], top)
    return SamplerOutput(ids, out)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf.

    Args:
        logits: [N, V] float32; top_k: [N] int64 (-1: off); top_p: [N] float32 in (0, 1].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k < 1, vocab, top_k.clamp(max=vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    remove |= cum_before >= top_p[:, None]
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
