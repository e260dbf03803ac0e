"""One rank: dispatch and combine are the identity."""

from __future__ import annotations

from typing import Any

import torch

from comm.base import DispatchResult
from comm.placement import ExpertPlacement


class NoopCommunicator:
    """The communicator for ep_size 1: every expert is local, nothing moves."""

    #: `combine` returns the experts' output itself (tokens in their own order, on this rank):
    #: a layer may add to it inside the experts' last kernel (`FusedMoE.forward`).
    combine_is_identity = True

    def begin_step(self, num_tokens: int | None) -> None:
        """Nothing to agree on with one rank."""

    def profile_token_counts(self, max_tokens: int) -> set[int]:
        """One path only: none."""
        return set()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchResult:
        """Returns the inputs unchanged (see `comm.base.Communicator.dispatch`)."""
        return DispatchResult(hidden, topk_ids, topk_weights, handle=None)

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """Returns `expert_out` unchanged."""
        return expert_out

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Accepts only the one layout it serves: one rank, experts in checkpoint order.

        Raises:
            ValueError: a placement over more than one rank or not contiguous (replicas or
                permuted slots: local ids would no longer be global ids).
        """
        if placement.ep_size != 1 or not placement.is_contiguous:
            raise ValueError(
                "the noop communicator (ep_size 1) serves only the contiguous placement; got "
                f"ep_size {placement.ep_size}, "
                f"{'contiguous' if placement.is_contiguous else 'non-contiguous'} slots"
            )
