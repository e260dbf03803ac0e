"""The interface of an engine core, as the core process, the ranks and the offline API use it.

`EngineCore` provides it, and so does the test double `tests/fake_core.py:FakeEngineCore`; the
core process (`core_proc.CoreLoop`) and the expert-parallel loop (`rank.LockstepLoop`), through
`engine.loop`, only call what is listed here (and `rollout.handle` for control messages).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from moe_engine.core.outputs import CoreStats, EngineCoreOutput, ExpertLoad, ModelInfo
from moe_engine.sampling_params import SamplingParams


@runtime_checkable
class EngineCoreProtocol(Protocol):
    """One rank's engine: requests in, per-step output deltas out.

    Attributes:
        tokenizer: the checkpoint's tokenizer (transformers), or None when it ships none.
    """

    tokenizer: Any | None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request.

        Raises:
            RequestError: a bad field, a duplicate live id (ALREADY_EXISTS), a full queue
                (RESOURCE_EXHAUSTED).
        """
        ...

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """End live requests (unknown ids are ignored): one final output each."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether a request is running or waiting."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduler step; this step's output deltas."""
        ...

    def get_stats(self) -> CoreStats:
        """Queue, KV-cache and token counters."""
        ...

    def get_expert_load(self) -> ExpertLoad:
        """Tokens routed to each expert of each MoE layer, with per-layer summaries."""
        ...

    def model_info(self) -> ModelInfo:
        """Static facts about the model and the engine's limits."""
        ...

    def close(self) -> None:
        """Release what the core holds (flush traces); called once when it stops."""
        ...
