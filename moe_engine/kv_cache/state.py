"""Per-request state of linear-attention layers, beside the paged KV cache.

A Gated DeltaNet layer (Qwen3-Next) keeps no per-token keys and values: each request carries a
fixed state per layer, the causal conv1d's last W - 1 inputs and the delta rule's recurrent
matrix (Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464); a Mamba layer (Jamba's
Mamba-1, Granite-4.0-H's and Nemotron-H's Mamba-2) the same two, its conv state and its SSM
state ([intermediate, d_state] or [heads, head_dim, d_state]). As vLLM's `MambaSpec`
and SGLang's `MambaPool`, the engine holds these states in slots: slot 0 is the null slot
(padding, never a request's), slots 1..num_slots are handed to running requests by the
`KVCacheManager`, one slot for all of a request's linear layers, taken with its first blocks
and returned with them (finish, abort, preemption: the state is dropped and recomputed with
the prompt).

The state is exact only for the tokens the request computed itself, so a model with these
layers never reuses another request's KV blocks (no prefix-cache hits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_engine.kv_cache.spec import LINEAR_ATTENTION

#: The padding rows' slot: all zeros, never handed out.
NULL_STATE_SLOT = 0


@dataclass(frozen=True)
class MambaSpec:
    """The state one request holds in each linear-attention layer.

    Attributes:
        layers: the decoder-layer indices of the linear layers.
        conv_shape: the conv state, e.g. (C, W - 1) (the last W - 1 conv inputs, oldest
            first); None for a mixer without a causal conv (lightning attention).
        ssm_shape: the recurrent state: (Hv, Dk, Dv) for Gated DeltaNet (per value head a
            Dk x Dv matrix), (heads, head_dim, d_state) for Mamba-2, (intermediate, d_state)
            for Mamba-1; any number of dims; None for a mixer with a conv state only (a short
            convolution).
        conv_dtype: the conv state's dtype (the model's).
        ssm_dtype: the recurrent state's dtype, float32 by default as SGLang keeps it (a
            bfloat16 state rounds every decode step's update).
    """

    layers: tuple[int, ...]
    conv_shape: tuple[int, ...] | None
    ssm_shape: tuple[int, ...] | None
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32

    @property
    def kind(self) -> str:
        """`LINEAR_ATTENTION`."""
        return LINEAR_ATTENTION

    @property
    def bytes_per_layer(self) -> int:
        """One request's state in one layer (bytes)."""
        conv = math.prod(self.conv_shape) * self.conv_dtype.itemsize if self.conv_shape else 0
        ssm = math.prod(self.ssm_shape) * self.ssm_dtype.itemsize if self.ssm_shape else 0
        return conv + ssm

    @property
    def bytes_per_request(self) -> int:
        """One request's state over all linear layers (bytes)."""
        return self.bytes_per_layer * len(self.layers)

    def allocate(
        self, num_slots: int, device: torch.device | str = "cpu"
    ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per linear layer, its zeroed (conv [num_slots + 1, *conv_shape], recurrent
        [num_slots + 1, *ssm_shape]) tensors, None for a part the spec lacks; row 0 is the
        null slot."""

        def part(shape: tuple[int, ...] | None, dtype: torch.dtype) -> torch.Tensor | None:
            if shape is None:
                return None
            return torch.zeros(num_slots + 1, *shape, dtype=dtype, device=device)

        return [
            (part(self.conv_shape, self.conv_dtype), part(self.ssm_shape, self.ssm_dtype))
            for _ in self.layers
        ]


class StateSlotPool:
    """Hands out state slots 1..num_slots, one per request id.

    Args:
        num_slots: slots for requests (the null slot comes on top).

    Raises:
        ValueError: num_slots below 1.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: {num_slots} is below 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # pop() hands out 1 first
        self._slots: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        """The request's slot, or None when it holds none."""
        return self._slots.get(request_id)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it holds none; None when none is free."""
        slot = self._slots.get(request_id)
        if slot is None and self._free:
            slot = self._slots[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Return the request's slot (no-op when it holds none)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
