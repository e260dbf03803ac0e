"""What `LLM.generate` and `LLM.chat` return, in vLLM's shape (`vllm/outputs.py`,
`vllm/logprobs.py`): one `RequestOutput` per prompt holding one `CompletionOutput` per
completion (`SamplingParams.n`).

Logprobs (when `SamplingParams.logprobs` is set) are, as in vLLM, one dict per generated token
mapping token id -> `Logprob`: the sampled token first, then the top-`logprobs` tokens in
descending order (so `logprobs + 1` entries, or `logprobs` when the sampled token is among the
top ones). `rank` is the 1-based rank in the model's distribution for the top tokens; for a
sampled token outside the top ones the engine does not compute it and `rank` is None (vLLM
gives it), except for greedy requests, whose sampled token is rank 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moe_engine.core.outputs import EngineCoreOutput


@dataclass
class Logprob:
    """One token's log probability.

    Attributes:
        logprob: natural log of its probability under the model's raw logits (before
            temperature, top-k and top-p; vLLM's default "raw_logprobs").
        rank: 1-based rank in the distribution (1 = most likely), None when not computed.
        decoded_token: the token's text alone, None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: 0..n-1 within the request.
        text: generated text ("" without a tokenizer; a matched stop string is cut off).
        token_ids: generated token ids (a stop token id is kept; EOS too).
        cumulative_logprob: sum of the sampled tokens' logprobs when logprobs were asked for,
            else None.
        logprobs: per generated token a dict token id -> Logprob (see the module docstring),
            or None when not asked for.
        finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or
            max_model_len) or "abort"; None while unfinished.
        stop_reason: the stop string or stop token id that ended it; None for EOS, length or
            abort (as vLLM).
        routed_experts: with `SamplingParams.return_routed_experts` (and an engine started
            with `enable_return_routed_experts`), once finished: [tokens, moe_layers, top_k]
            int32 logical expert ids the router chose for every token the model ran for this
            completion (prompt, then outputs but the last: positions [0, seqlen - 1));
            docs/weight_updates.md "Routing replay". None otherwise.
        weight_versions: once finished, every weight version that computed its tokens with
            the token index each begins at, [(version, start), ...] (start 0 first; empty
            without tokens); None before.
        kv_from_other_weights: once finished, whether some K/V its tokens read was computed
            with other weights than the tokens reading it (`LLM.update_weights_*` while it
            ran, without a "retract" pause).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None
    weight_versions: list[tuple[str, int]] | None = None
    kv_from_other_weights: bool = False

    def finished(self) -> bool:
        """True once the completion has a finish reason (vLLM's method of the same name)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result for one prompt.

    Attributes:
        request_id: "0", "1", ... in the order `LLM` received the prompts.
        prompt: the prompt text (for chat, the rendered template), None for token ids.
        prompt_token_ids: the prompt as token ids.
        prompt_logprobs: always None (prompt logprobs are not computed).
        outputs: one CompletionOutput per completion, by index.
        finished: True when every completion has finished.
        weight_version: the weights that computed the last tokens (`LLM.update_weights_*`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    weight_version: str = ""


class RequestOutputBuilder:
    """Accumulates the engine's per-step outputs (deltas) of one request into its
    `RequestOutput`.

    Args:
        output: the RequestOutput to fill (its `outputs` list is made here).
        n: completions of the request.
        want_logprobs: whether the request asked for logprobs.
        greedy: whether its tokens are argmaxes (their rank is 1).
        tokenizer: decodes each logprob's token, or None.
    """

    def __init__(
        self, output: RequestOutput, n: int, want_logprobs: bool, greedy: bool, tokenizer=None
    ) -> None:
        self.output = output
        self.greedy = greedy
        self.tokenizer = tokenizer
        output.outputs = [
            CompletionOutput(
                index=i,
                cumulative_logprob=0.0 if want_logprobs else None,
                logprobs=[] if want_logprobs else None,
            )
            for i in range(n)
        ]

    def add(self, delta: EngineCoreOutput) -> None:
        """Apply one engine output to completion `delta.index`."""
        completion = self.output.outputs[delta.index]
        completion.token_ids.extend(delta.new_token_ids)
        completion.text += delta.new_text
        self.output.weight_version = delta.weight_version
        if delta.logprobs and completion.logprobs is not None:
            for token_id, (logprob, top) in zip(delta.new_token_ids, delta.logprobs, strict=True):
                completion.logprobs.append(self._logprob_dict(token_id, logprob, top))
                completion.cumulative_logprob += logprob
        if delta.finished:
            completion.finish_reason = str(delta.finish_reason)
            completion.stop_reason = delta.stop_reason
            if delta.routed_experts is not None and delta.routed_experts_shape is not None:
                completion.routed_experts = np.frombuffer(
                    delta.routed_experts, dtype="<i4"
                ).reshape(delta.routed_experts_shape).astype(np.int32)
            completion.weight_versions = list(delta.weight_versions or [])
            completion.kv_from_other_weights = delta.kv_from_other_weights
            self.output.finished = all(c.finished() for c in self.output.outputs)

    def _logprob_dict(self, token_id: int, logprob: float, top: dict[int, float]
                      ) -> dict[int, Logprob]:
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        ranks = {tok: r for r, (tok, _) in enumerate(ranked, start=1)}
        sampled_rank = ranks.get(token_id, 1 if self.greedy else None)
        out = {token_id: Logprob(logprob, sampled_rank, self._decode(token_id))}
        for tok, lp in ranked:
            if tok != token_id:
                out[tok] = Logprob(lp, ranks[tok], self._decode(tok))
        return out

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])
