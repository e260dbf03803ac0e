"""The communicator interface every EP backend implements (DESIGN.md section 6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from comm.placement import ExpertPlacement


@dataclass
class DispatchResult:
    """What `dispatch` hands the local experts.

    Attributes:
        hidden: [N, H] tokens this rank's experts must process.
        topk_ids: [N, k'] int32 local expert ids (-1 where the slot belongs to another rank,
            and on padding rows); k' is the layer's top_k, or 1 where each row is one (token,
            expert) pair (DeepEP's low-latency kernels).
        topk_weights: [N, k'] float32 routing weights.
        handle: what `combine` needs to send the results back.
    """

    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    handle: Any


class Communicator(Protocol):
    """Moves tokens to the ranks that hold their experts and brings the results back."""

    def begin_step(self, num_tokens: int | None) -> None:
        """Called once per step on every rank before its first dispatch: this rank's tokens
        (T of each dispatch of the step); None forgets the step."""
        ...

    def profile_token_counts(self, max_tokens: int) -> set[int]:
        """Token counts per rank below `max_tokens` at which this communicator switches to
        another path with other buffers: the profile run measures a decode step at each."""
        ...

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """hidden: [T, H]; topk_ids: [T, k] int32 global expert ids, or -1 for a slot that holds
        no expert (a zero-computation expert's: it reaches no expert); topk_weights: [T, k]
        fp32."""
        ...

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """expert_out: [N, H] weighted partial sums -> [T, H] in the original token order."""
        ...

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from the next dispatch on (runtime EPLB, `moe_engine.eplb`):
        called on every rank between the same two steps, after the experts' weights moved.
        Takes the `ExpertPlacement` object itself (its route tables are built on first use).

        Raises:
            ValueError: a placement this communicator cannot take (another ep_size,
                num_experts or slots per rank; the message names both numbers).
        """
        ...
