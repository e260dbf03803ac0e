"""Rotary position embedding (RoFormer, Su et al. 2021), "rotate half" layout as in Llama/HF,
or on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay out q_pe / k_pe.

Optionally with YaRN context extension (Peng et al. 2023, "YaRN: Efficient Context Window
Extension of Large Language Models"), as gpt-oss uses it: `yarn_inv_freq` follows `transformers`'
`modeling_rope_utils._compute_yarn_parameters` step for step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

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


def rope_with_scaling_of(hf_config) -> tuple[float, YarnScaling | None]:
    """The rotary base and YaRN scaling (None for plain RoPE) from a transformers config:
    `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older config.json).

    Raises:
        StartupError: a rope_type other than "default" or "yarn", or no rope_theta.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params = {**(getattr(hf_config, "rope_scaling", None) or {}), **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise StartupError(
            f"rope_type {rope_type!r} is not supported yet (supported: default, yarn)"
        )
    if theta is None:
        raise StartupError("config.json has no rope_theta")
    if rope_type == "default":
        return float(theta), None
    max_position = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    return float(theta), YarnScaling.from_rope_parameters(params, max_position)


def rope_with_llama3_of(hf_config) -> tuple[float, Llama3Scaling | None]:
    """The rotary base and Llama 3 scaling (None for plain RoPE) from a transformers config
    (`rope_parameters`, or `rope_scaling` + `rope_theta`).

    Raises:
        StartupError: a rope_type other than "default" or "llama3", or no rope_theta.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params = {**(getattr(hf_config, "rope_scaling", None) or {}), **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise StartupError(
            f"rope_type {rope_type!r} is not supported yet (supported: default, llama3)"
        )
    if theta is None:
        raise StartupError("config.json has no rope_theta")
    scaling = Llama3Scaling.from_rope_parameters(params) if rope_type == "llama3" else None
    return float(theta), scaling


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's frequency-dependent RoPE scaling (`rope_type` "llama3"; transformers
    `_compute_llama3_parameters`, Meta's `apply_scaling`): wavelengths 2 pi / f longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter
    than original_max_position_embeddings / high_freq_factor are kept, and those between are
    interpolated smoothly. Llama 4 Scout uses it (factor 16, both frequency factors 1).

    Raises:
        StartupError (`from_rope_parameters`): a field missing.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_rope_parameters(cls, params: dict) -> Llama3Scaling:
        keys = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        missing = [k for k in keys if params.get(k) is None]
        if missing:
            raise StartupError(f"rope_type 'llama3' needs rope_parameters {missing}")
        return cls(float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]),
                   int(params["original_max_position_embeddings"]))

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """[d / 2] float32 inverse frequencies -> the scaled ones (same shape)."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters (config.json `rope_parameters` / `rope_scaling` with rope_type "yarn").

    Attributes:
        factor: context extension factor s (interpolated frequencies are divided by it).
        original_max_position_embeddings: the pre-extension context (tokens).
        beta_fast, beta_slow: rotations bounding the linear ramp between extrapolated and
            interpolated frequencies (paper's alpha/beta; defaults 32 and 1).
        truncate: floor/ceil the ramp bounds (transformers' default True; gpt-oss sets False).
        attention_factor: the cos/sin multiplier ("mscale"); None derives it from `factor`
            (and `mscale`, `mscale_all_dim` when both are set), as transformers does.
        mscale, mscale_all_dim: DeepSeek-style parts of that derivation (None: unused).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @classmethod
    def from_rope_parameters(cls, params: dict, max_position_embeddings: int) -> YarnScaling:
        """From a transformers `rope_parameters` dict whose rope_type is "yarn".

        A null `factor` means max_position_embeddings / original_max_position_embeddings and a
        missing `original_max_position_embeddings` means max_position_embeddings, as in
        transformers. Raises `StartupError` when neither gives a factor.
        """
        original = params.get("original_max_position_embeddings") or max_position_embeddings
        factor = params.get("factor") or (max_position_embeddings / original if original else 0)
        if not factor or factor <= 0 or not original:
            raise StartupError(
                f"yarn rope_parameters {params}: need a positive factor and "
                f"original_max_position_embeddings (or max_position_embeddings)"
            )
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
        )


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(yarn: YarnScaling | None) -> float:
    """The extra softmax-scale factor of DeepSeek-style YaRN: mscale(factor, mscale_all_dim)^2
    when `mscale_all_dim` is set, else 1 (DeepSeek-V2/V3 inference code; transformers
    `yarn_apply_mscale` in modeling_deepseek_v3.py). Multiplies qk_head_dim ** -0.5."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    return _yarn_get_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def yarn_inv_freq(head_dim: int, base: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN's per-dimension-pair inverse frequencies and its attention factor.

    Dimension pairs that rotate fewer than `beta_slow` times over the original context are
    interpolated (frequency / factor), those rotating more than `beta_fast` times are kept
    (extrapolated), with a linear ramp in between; cos and sin are then multiplied by the
    attention factor 0.1 ln(factor) + 1 (Peng et al. 2023, eq. 17-22; transformers
    `_compute_yarn_parameters`).

    Returns:
        inv_freq [head_dim // 2] float32; attention_factor (float, multiplies cos and sin).
    """
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, yarn.mscale) / _yarn_get_mscale(
                factor, yarn.mscale_all_dim
            )
        else:
            attention_factor = _yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        context = yarn.original_max_position_embeddings
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # weight of the original frequency per pair
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: positions [0, max_position) are precomputed.
        base: the rotary base (rope_theta).
        yarn: YaRN scaling (`yarn_inv_freq`; cos and sin carry its attention factor), or None
            for plain RoPE.
        interleaved: the pairs rotated together are (x0, x1), (x2, x3), ... (DeepSeek; V3's
            `rope_interleave`, V2's complex multiplication); the output is de-interleaved,
            [rotated evens | rotated odds], as transformers' `apply_rotary_pos_emb_interleave`
            returns it. V2's complex form returns the same values re-interleaved; as q and k
            get the same permutation, q . k and so attention are unchanged. False: the
            "rotate half" pairs (x_i, x_{i + d/2}).
        llama3: Llama 3 frequency scaling of the plain RoPE (`Llama3Scaling`), or None.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        yarn: YarnScaling | None = None,
        interleaved: bool = False,
        llama3: Llama3Scaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.yarn, self.interleaved = head_dim, yarn, interleaved
        self.llama3 = llama3
        self.base, self.max_position = base, max_position
        cos = torch.empty(max_position, head_dim)
        if cos.is_meta:  # built on the meta device: `materialize_buffers` computes them
            sin = torch.empty(max_position, head_dim)
        else:
            cos, sin = self._cos_sin(None)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # (positions, cos, sin) of the latest call: holding `positions` keeps its id unique
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_position, head_dim] float32 (times the YaRN attention factor), made
        on `device` (None: the default device). Never computed on meta: torch's first
        arithmetic there imports its Python meta kernels (~150 MB resident)."""
        scale, head_dim = 1.0, self.head_dim
        with torch.device(device) if device is not None else contextlib.nullcontext():
            if self.yarn is None:
                exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
                inv_freq = 1.0 / (self.base**exponents)
                if self.llama3 is not None:
                    inv_freq = self.llama3.scale(inv_freq)
            else:
                inv_freq, scale = yarn_inv_freq(head_dim, self.base, self.yarn)
            pos = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
        return cos, sin

    def materialize_buffers(self, device: torch.device) -> None:
        """Compute the cos/sin caches again for a module built on the meta device
        (`models.materialize`): on the CPU, as a host-built module has them, then moved to
        `device`, so every device serves the same table."""
        cos, sin = self._cos_sin(torch.device("cpu"))
        self.cos_cache, self.sin_cache = cos.to(device), sin.to(device)
        self._last = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] -> rotated (same shapes/dtypes).

        The cos/sin rows of a `positions` tensor are looked up once and reused by the next
        calls with that same tensor object (every layer of a step shares this module).
        """
        last = self._last
        if last is not None and last[0] is positions and last[1].dtype == q.dtype:
            cos, sin = last[1], last[2]
        else:
            cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
            sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
            self._last = (positions, cos, sin)
        if self.interleaved:
            q, k = deinterleave(q), deinterleave(k)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: [x0, x2, x4, ..., x1, x3, ...], so that the interleaved pairs
    (x_2i, x_2i+1) become the rotate-half pairs (x_i, x_i+d/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x [..., d] rotated by cos, sin (broadcastable to x; a `RotaryEmbedding`'s table rows):
    rotate-half pairs (transformers `apply_rotary_pos_emb`), or with `interleaved` the pairs
    (x_2i, x_2i+1), de-interleaved first (`apply_rotary_pos_emb_interleave`)."""
    return _rotate(deinterleave(x) if interleaved else x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def partial_rotary_factor_of(hf_config) -> float:
    """The fraction of each head the rope rotates (`rope_parameters["partial_rotary_factor"]`,
    or the config's own `partial_rotary_factor`; 1.0 when neither is set).

    Raises:
        StartupError: a factor outside (0, 1].
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise StartupError(f"partial_rotary_factor {factor} must be in (0, 1]")
    return factor


def partial_rotary_dim_of(hf_config) -> int:
    """The dims of each head the rope rotates: int(head_dim x `partial_rotary_factor_of`),
    head_dim as the config states it (or hidden_size / num_attention_heads).

    Raises:
        StartupError: a factor outside (0, 1]; ValueError: an odd count or one below 2.
    """
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    factor = partial_rotary_factor_of(hf_config)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim < 2:
        raise ValueError(
            f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotary_dim} "
            f"dims; it must be an even number >= 2"
        )
    return rotary_dim


class PartialRotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` dims of each head only; the rest pass through unchanged
    (GPT-NeoX's `rotary_pct`; GLM-4.5's `partial_rotary_factor`, transformers
    `Glm4MoeRotaryEmbedding` + `apply_rotary_pos_emb`: frequencies base^(-2i / rotary_dim),
    "rotate half" within those dims).

    Args:
        head_dim: dims per head (D).
        rotary_dim: dims rotated (even, <= D), e.g. int(D * partial_rotary_factor).
        max_position: positions [0, max_position) are precomputed.
        base: the rotary base (rope_theta).

    Raises:
        ValueError: rotary_dim odd, below 2 or above head_dim.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim {rotary_dim} (head_dim x partial_rotary_factor) must be even and "
                f"in [2, head_dim = {head_dim}]"
            )
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.rope = RotaryEmbedding(rotary_dim, max_position, base)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] -> rotated (same shapes/dtypes)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return self.rope(positions, q, k)
        q_rot, k_rot = self.rope(positions, q[..., :r], k[..., :r])
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class NoRotaryEmbedding(nn.Module):
    """No positional encoding (NoPE) behind the rotary call: `forward(positions, q, k)`
    returns q and k unchanged, for attention whose rope part carries no rotation (Kimi-Linear's
    MLA layers; Jamba's, Nemotron-H's and Granite-4.0-H's attention beside Mamba layers).
    Never bound to a rope kernel (its type is not `RotaryEmbedding`).

    Args:
        head_dim: the dims a rotary would rotate (MLA: qk_rope_head_dim; 0: unstated).
    """

    def __init__(self, head_dim: int = 0) -> None:
        super().__init__()
        self.head_dim, self.yarn, self.interleaved = head_dim, None, False

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 (unused); q, k: any shapes -> (q, k) as they are."""
        return q, k


class QueryLengthScaling(nn.Module):
    """No rotation; the queries scaled by their position instead: q * (1 + (p + 1) / length)
    ** exponent, computed in float32 and rounded to q's dtype (scalable softmax, Nakanishi
    2025, "Scalable-Softmax Is Superior for Attention"; transformers `compute_attention_scaling`
    of `modeling_beam.py`, for its layers without RoPE). The keys pass unchanged.

    Args:
        length: the position scale (tokens; Beam's 2048); exponent: the power (Beam's 0.1).
    """

    def __init__(self, length: float = 2048.0, exponent: float = 0.1) -> None:
        super().__init__()
        self.length, self.exponent = length, exponent

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] -> (scaled q, k)."""
        scale = torch.exp(self.exponent * torch.log1p((positions.float() + 1) / self.length))
        return (q.float() * scale[:, None, None]).to(q.dtype), k
