"""RMSNorm followed by a low-rank, input-dependent sigmoid gate (A.X-K2's `AXK2GatedRMSNorm`,
transformers 5.24 models/axk2/modeling_axk2.py; Megatron's `GatedNormWrapper`):

    y = RMSNorm(x);  out = y * sigmoid(fc2(silu(fc1(y))))   (the sigmoid in float32)

with fc1 [H -> rank], fc2 [rank -> H], no biases (names `norm.weight`, `mlp.fc1.weight`,
`mlp.fc2.weight` under the norm's own name, as transformers').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.norm import RMSNorm


class _GateMLP(nn.Module):
    """fc2(silu(fc1(y))): [*, H] -> [*, H]."""

    def __init__(self, hidden_size: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(hidden_size, rank, bias=False, dtype=dtype)
        self.fc2 = Linear(rank, hidden_size, bias=False, dtype=dtype)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(y)))


class LowRankGatedRMSNorm(nn.Module):
    """`RMSNorm` times a low-rank sigmoid gate of its own output (module doc).

    Args:
        hidden_size: H. rank: the gate's bottleneck (config.json `gated_norm_rank`).
        eps: the RMSNorm's epsilon. dtype: parameter dtype.

    Raises:
        ValueError: rank < 1.
    """

    def __init__(self, hidden_size: int, rank: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LowRankGatedRMSNorm: gated_norm_rank {rank} must be >= 1")
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.mlp = _GateMLP(hidden_size, rank, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> gated norm [T, H] (x's dtype); with `residual` as `RMSNorm`'s: the add
        fused first, returns (gated norm of x + residual, x + residual)."""
        if residual is None:
            return self._gate(self.norm(x))
        y, residual = self.norm(x, residual)
        return self._gate(y), residual

    def _gate(self, y: torch.Tensor) -> torch.Tensor:
        return (y * torch.sigmoid(self.mlp(y).float())).to(y.dtype)
