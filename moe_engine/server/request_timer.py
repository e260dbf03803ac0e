"""`RequestTimer`: one request's times and token counts as its outputs arrive at a front end,
for the latency metrics (`metrics.ServerMetrics`, `vllm_metrics.VllmMetrics`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moe_engine.core.outputs import EngineCoreOutput


@dataclass
class RequestTimer:
    """Wall-clock times of one request (time.monotonic() seconds) and its output tokens, summed
    over its completions (`SamplingParams.n`).

    Attributes:
        inter_token_s: per output after the first token (of completion 0 only with n > 1),
            seconds since the previous one (vLLM's inter-token latency, one per step).
        num_prompt_tokens: the prompt's length (tokens).
        queue_s, prefill_s: the engine core's queue and prefill intervals of the first
            completion to finish (`EngineCoreOutput`), or None.
    """

    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_output_s: float = 0.0
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    inter_token_s: list[float] = field(default_factory=list, repr=False)
    queue_s: float | None = None
    prefill_s: float | None = None
    _tokens_by_index: dict[int, int] = field(default_factory=dict, repr=False)
    _last_token_s: float | None = field(default=None, repr=False)

    def record(self, out: EngineCoreOutput) -> None:
        """Note an output: the first one with tokens fixes the time to first token (on a
        final-only output, `decode_s` before it arrived)."""
        now = time.monotonic()
        if out.new_token_ids and self.first_token_s is None:
            # A final-only output arrives at the end; the core says how long after the first.
            self.first_token_s = now - (out.decode_s or 0.0)
        elif out.new_token_ids and out.index == 0 and self._last_token_s is not None:
            self.inter_token_s.append(now - self._last_token_s)
        if out.new_token_ids and out.index == 0:
            self._last_token_s = now
        self.last_output_s = now
        self.num_prompt_tokens = out.num_prompt_tokens
        before = self._tokens_by_index.get(out.index, 0)
        self._tokens_by_index[out.index] = out.num_output_tokens
        self.num_output_tokens += out.num_output_tokens - before
        if out.finished and self.queue_s is None:
            self.queue_s, self.prefill_s = out.queue_s, out.prefill_s

    @property
    def first_completion_tokens(self) -> int:
        """Output tokens of completion 0 (the one `inter_token_s` follows)."""
        return self._tokens_by_index.get(0, 0)
