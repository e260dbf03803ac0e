"""Rotary position embedding (RoFormer, Su et al. 2021), "rotate half" layout as in Llama/HF."""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.errors import StartupError


def rope_theta_of(hf_config) -> float:
    """The rotary base from a transformers config (old `rope_theta` or new `rope_parameters`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise StartupError(f"rope_type {rope_type!r} is not supported yet (supported: default)")
    if theta is None:
        raise StartupError("config.json has no rope_theta")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: positions [0, max_position) are precomputed.
        base: the rotary base (rope_theta).
    """

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] -> rotated (same shapes/dtypes)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
