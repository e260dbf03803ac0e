"""The activation between the two expert projections: SwiGLU, plain or gpt-oss's clamp; or the
non-gated squared ReLU.

Plain SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer"; Qwen3-MoE, Mixtral, DeepSeek):
``silu(gate) * up``.

gpt-oss's clamped variant (Hugging Face ``transformers``, ``GptOssExperts._apply_gate`` in
``models/gpt_oss/modeling_gpt_oss.py``; config fields ``swiglu_alpha`` = 1.702 and
``swiglu_limit`` = 7.0)::

    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    out = (up + 1) * (gate * sigmoid(alpha * gate))

Nemotron-H's non-gated experts (So et al. 2021, "Primer", squared ReLU; transformers
``NemotronHExperts``, ``mlp_hidden_act`` "relu2"): ``relu(up)^2``, with no gate projection, so
``w13`` holds the up rows only (``[E, I, H]``). The native-cpu and Triton expert kernels
compute SwiGLU only: non-gated experts run the torch expert paths, which call the activation
on ``x @ w13.T`` whatever its width (``FusedMoE.bind_kernels`` says so at startup).

gpt-oss interleaves gate and up columns in its checkpoint; the engine's layout is always gate
rows then up rows (``w13 [E, 2I, H]``), so a gpt-oss loader de-interleaves once at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SwiGLU:
    """Which SwiGLU the experts apply; the default ``SwiGLU()`` is plain ``silu(gate) * up``.

    Args:
        alpha: gpt-oss's sigmoid slope; set, the clamped form ``(up + 1) * gate *
            sigmoid(alpha * gate)`` is used. ``None``: plain SwiGLU.
        limit: gpt-oss's clamp (``gate <= limit``, ``-limit <= up <= limit``); ``None``: no
            clamp. Only meaningful with ``alpha``.

    Raises:
        ValueError: ``limit`` without ``alpha``, or a ``limit`` that is not positive.
    """

    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.alpha is None:
            raise ValueError(f"swiglu limit {self.limit} needs swiglu alpha (gpt-oss sets both)")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"swiglu limit {self.limit} must be positive")

    #: gate rows then up rows in w13 ([E, 2I, H]).
    gated = True

    @property
    def clamped(self) -> bool:
        """Whether this is gpt-oss's variant (``alpha`` set)."""
        return self.alpha is not None

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[..., 2I]`` (gate columns, then up columns) -> ``[..., I]``, same dtype, computed
        in that dtype."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.apply(gate, up)

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gate``, ``up``: ``[..., I]`` -> ``[..., I]`` in their dtype."""
        if self.alpha is None:
            return F.silu(gate) * up
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class SquaredReLU:
    """The non-gated ``relu(up)^2`` (module docstring): w13 holds the up rows only."""

    #: w13 is [E, I, H], the up projection alone.
    gated = False
    #: Never gpt-oss's clamp (the SwiGLU kernels' fields, for any that read them).
    clamped = False
    alpha = None
    limit = None

    def __call__(self, up: torch.Tensor) -> torch.Tensor:
        """``[..., I]`` -> ``[..., I]``, same dtype."""
        return torch.relu(up).square()


#: Plain SwiGLU, the default of every expert path.
SILU_AND_MUL = SwiGLU()
#: Nemotron-H's non-gated experts' activation.
RELU2 = SquaredReLU()
