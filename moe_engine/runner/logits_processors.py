"""The logits processors of `SamplingParams`, batched over the step's rows on the device:
`logit_bias`, the repetition/frequency/presence penalties and `min_p`.

Semantics and order are vLLM v1's sampler's (vllm/v1/sample/sampler.py and
vllm/model_executor/layers/utils.py `apply_penalties`): logit_bias and the penalties change the
logits before the greedy argmax (so they apply to greedy rows too); min_p runs on random rows
after the temperature, before top-k/top-p (`Sampler._sample`). Each function touches only the
rows that ask for it and returns at once (no tensor built, no copy) when no row of the batch
does, so a batch without them pays one Python pass over its requests. The penalties are
sparse: they read and write only the entries of tokens a row has seen (vLLM builds dense
[N, V] masks and counts instead; the result is the same).

- repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858; transformers'
  `RepetitionPenaltyLogitsProcessor`): a token that occurs in the prompt or the output so far
  has its logit divided by the penalty when > 0, multiplied by it otherwise;
- frequency and presence penalties (OpenAI's API reference, "Parameter details"): over the
  output so far only, logit -= frequency_penalty * count + presence_penalty * (count > 0);
- min_p (Nguyen et al. 2024, arXiv:2407.01082; vLLM's `min_p`): tokens whose probability is
  below min_p times the row's largest are masked with -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_engine.request import Request


class TokenCache:
    """Per-request tensors the penalties reuse from step to step (the `Sampler` owns one and
    drops a request's entries when it ends, `forget`).

    Attributes:
        prompt: request id -> [P] int64 distinct prompt token ids, on the logits' device.
        output: request id -> [n] int64 output token ids so far, on the host, extended by the
            tokens appended since the last step (outputs only grow, preemption included).
    """

    def __init__(self) -> None:
        self.prompt: dict[str, torch.Tensor] = {}
        self.output: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self.prompt.pop(request_id, None)
        self.output.pop(request_id, None)

    def prompt_ids(self, req: Request, device: torch.device) -> torch.Tensor:
        ids = self.prompt.get(req.request_id)
        if ids is None:
            ids = torch.tensor(sorted(set(req.prompt_token_ids)), dtype=torch.int64).to(device)
            self.prompt[req.request_id] = ids
        return ids

    def output_ids(self, req: Request) -> torch.Tensor:
        out = req.output_token_ids
        have = self.output.get(req.request_id)
        n = 0 if have is None else have.shape[0]
        if have is not None and n == len(out):
            return have
        if have is None or n > len(out):  # new (or, defensively, a shorter output)
            ids = torch.tensor(out, dtype=torch.int64)
        else:
            ids = torch.cat([have, torch.tensor(out[n:], dtype=torch.int64)])
        self.output[req.request_id] = ids
        return ids


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> bool:
    """Add each row's `logit_bias` to its logits in place.

    Args:
        logits: [N, V] float32, contiguous, one row per request; changed in place.
        requests: the rows' requests (token ids in their logit_bias are < V: `verify`).

    Returns:
        True when some row had a bias (and `logits` changed).
    """
    vocab = logits.shape[1]
    index: list[int] = []
    bias: list[float] = []
    for i, req in enumerate(requests):
        lb = req.sampling_params.logit_bias
        if lb:
            index.extend(i * vocab + t for t in lb)
            bias.extend(lb.values())
    if not index:
        return False
    device = logits.device
    logits.view(-1).index_add_(
        0, torch.tensor(index, device=device), torch.tensor(bias, dtype=logits.dtype,
                                                             device=device),
    )  # fmt: skip
    return True


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], cache: TokenCache | None = None
) -> bool:
    """Apply the repetition, frequency and presence penalties of the rows that have any.

    Sparse: only the (row, token) entries of tokens a row has seen are read and written (a
    gather and a scatter of at most prompt + output entries per row), never a [N, V] mask or
    count tensor, so the cost grows with the tokens seen, not with the vocabulary.

    Args:
        logits: [N, V] float32, contiguous, one row per request; changed in place.
        requests: the rows' requests: their prompt and `output_token_ids` so far.
        cache: the requests' prompt and output id tensors from earlier steps (`TokenCache`);
            None: built for this call only.

    Returns:
        True when some row had a penalty (and `logits` changed).
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return False
    cache = cache if cache is not None else TokenCache()
    device, vocab = logits.device, logits.shape[1]
    flat = logits.view(-1)
    out_index, out_counts = output_token_counts(
        [cache.output_ids(requests[i]) for i in rows], rows, vocab, device
    )
    params = [r.sampling_params for r in requests]
    # [N, 3]: repetition, frequency, presence per row (one host-to-device copy)
    values = torch.tensor(
        [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
        dtype=logits.dtype,
    ).to(device)
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        prompt = [cache.prompt_ids(requests[i], device) for i in rep_rows]
        # duplicates (a token in both prompt and output) read the same value and write the
        # same result, so no `unique` is needed here
        seen = torch.cat([out_index, _flat_index(prompt, rep_rows, vocab).to(device)])
        factor = values[seen // vocab, 0]
        vals = flat.index_select(0, seen)
        flat.index_copy_(0, seen, torch.where(vals > 0, vals / factor, vals * factor))
    row = out_index // vocab
    flat.index_add_(0, out_index, -(values[row, 1] * out_counts + values[row, 2]))
    return True


def output_token_counts(
    outputs: Sequence[torch.Tensor], rows: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the outputs so far and their counts.

    Args:
        outputs: per request, [n] int64 its output token ids (host); rows: each one's row in
            the logits; vocab_size: V.

    Returns:
        ([K] int64 flat indices row * V + token, sorted; [K] float32 occurrences), on
        `device`: counted on the host, where the ids are (a `unique` on CUDA would wait for
        the device to learn K), then one copy each.
    """
    where = _flat_index(outputs, rows, vocab_size)
    if not where.shape[0]:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, torch.empty(0, dtype=torch.float32, device=device)
    index, counts = where.unique(return_counts=True)
    return index.to(device), counts.to(torch.float32).to(device)


def _flat_index(ids: Sequence[torch.Tensor], rows: Sequence[int], vocab: int) -> torch.Tensor:
    """[sum of lengths] int64: row * vocab + id for each row's ids (on the ids' device)."""
    flat = torch.cat(list(ids))
    lens = torch.tensor([t.shape[0] for t in ids])
    offsets = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64) * vocab, lens)
    return flat + offsets.to(flat.device)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf the tokens whose probability is below min_p times the row's largest.

    Args:
        logits: [N, V] float32 (after the temperature); min_p: [N] float32 in [0, 1] on the
            same device (0: the row is kept whole).

    Returns:
        [N, V] float32, a new tensor.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
