"""Turn last-position logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs.

Vectorised over the batch. Random rows use the exponential-race trick (argmax of p / q with
q ~ Exp(1)), which samples exactly from p and lets each seeded request draw its noise from its
own generator, as vLLM's sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine.request import Request


@dataclass
class SamplerOutput:
    """Sampled tokens and, where asked for, logprobs.

    Attributes:
        token_ids: [N] int64, one per row.
        logprobs: per row, None or (sampled token's logprob, {top token id: logprob}).
    """

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    """Samples one token per row of logits.

    Args:
        seed: seeds the generator of rows without a per-request seed.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [N, V] float32, one row per request in `requests`."""
        greedy = torch.tensor([r.sampling_params.greedy for r in requests])
        token_ids = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            random_rows = (~greedy).nonzero().flatten()
            sub = [requests[i] for i in random_rows.tolist()]
            token_ids[random_rows] = self._sample(logits[random_rows], sub)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, requests, ids))

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        logits = logits / temperature[:, None]
        logits = _apply_top_k_top_p(
            logits,
            torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
        )
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, req in enumerate(requests):
            noise[i].exponential_(generator=self._generator_for(req))
        return (probs / noise).argmax(dim=-1)

    def _generator_for(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._request_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._request_generators[req.request_id] = gen
        return gen

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, requests: list[Request], ids: list[int]
    ) -> list[tuple[float, dict[int, float]] | None]:
        wanted = [r.sampling_params.logprobs for r in requests]
        out: list[tuple[float, dict[int, float]] | None] = [None] * len(requests)
        rows = [i for i, n in enumerate(wanted) if n is not None]
        if not rows:
            return out
        logp = logits[rows].log_softmax(dim=-1)
        k = max(wanted[i] for i in rows)
        top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (None, None)
        for j, i in enumerate(rows):
            n = wanted[i]
            top = {}
            if n:
                top = dict(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
            out[i] = (float(logp[j, ids[i]]), top)
        return out


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf.

    Args:
        logits: [N, V] float32; top_k: [N] int64 (-1: off); top_p: [N] float32 in (0, 1].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k < 1, vocab, top_k.clamp(max=vocab))
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    remove |= cum_before >= top_p[:, None]
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
