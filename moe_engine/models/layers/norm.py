"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as the Hugging Face reference does, and
LayerNorm (Ba et al., 2016) for the families that keep it (PhiMoE, DBRX, Cohere2-MoE)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.plan import KernelPlan


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last dimension.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square.
        dtype: weight dtype (the model's).
        weight_in_float32: multiply by the weight in float32 and round once to x's dtype
            (gpt-oss in transformers, `GptOssRMSNorm`, which also keeps the weight in
            float32); by default the normalised x is rounded to its dtype first (Llama, Qwen).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        weight_in_float32: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        #: Bound by `bind_kernels`: the fused kernel (`KernelPlan.rms_norm`), None: torch ops.
        self.kernel: Callable[..., torch.Tensor] | None = None
        #: Bound by `bind_kernels`: the residual add fused with this norm
        #: (`KernelPlan.add_rms_norm`), None: the add, then `forward`.
        self.add_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's "rms_norm" kernels for this weight (`KernelPlan.rms_norm`,
        `KernelPlan.add_rms_norm`)."""
        self.kernel = plan.rms_norm(self.weight)
        self.add_kernel = plan.add_rms_norm(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., dim] any float dtype -> same shape and dtype; or, with `residual` (the
        pre-norm block's residual add fused into its norm, vLLM's `RMSNorm(x, residual)`):
        residual' = x + residual (x's dtype, as torch's add rounds), returns (norm(residual'),
        residual').

        Bound to fused kernels, inputs of the weight's dtype and up to 3 dimensions go through
        them (`kernels.dense.ops.rms_norm`, `kernels.dense.triton_norm`: same rounding), one
        call instead of six torch ops (the add included, where `KernelPlan.add_rms_norm` gave
        one).
        """
        if residual is not None:
            return self._add_norm(x, residual)
        kernel = self.kernel
        if kernel is not None and x.dim() <= 3 and x.dtype == self.weight.dtype and (
            x.stride(-1) == 1
        ):
            return kernel(x, self.weight, self.eps, self.weight_in_float32)
        dtype = x.dtype
        h = _normalized(x, self.eps)
        if self.weight_in_float32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)

    def _add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = self.add_kernel
        if kernel is not None and x.dim() <= 3 and x.dtype == self.weight.dtype == (
            residual.dtype
        ) and x.stride(-1) == 1 and residual.stride(-1) == 1 and x.shape == residual.shape:
            return kernel(x, residual, self.weight, self.eps, self.weight_in_float32)
        residual = residual + x
        return self.forward(residual), residual


class LayerNorm(nn.Module):
    """y = weight * (x - mean(x)) / sqrt(var(x) + eps) (+ bias), over the last dimension:
    `torch.nn.functional.layer_norm` as `nn.LayerNorm` computes it (PhiMoE's norms with a
    bias, DBRX's `nn.LayerNorm(bias=False)`). Same call as `RMSNorm`, so it is a decoder
    layer's norm wherever one is; no fused kernel (the native decode step refuses it).
    With `float32_math`, x and the weight are taken to float32 and the result rounded once to
    x's dtype (transformers `CohereLayerNorm` / `Cohere2LayerNorm`).

    Args:
        dim: size of the last dimension; eps: added to the variance; bias: hold a bias [dim];
        dtype: parameter dtype; float32_math: Cohere's rounding (above).

    Checkpoint names: `weight`, `bias`.
    """

    def __init__(
        self, dim: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype = torch.float32,
        *, float32_math: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if bias else None
        self.eps = eps
        self.float32_math = float32_math

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., dim] -> same shape and dtype; with `residual`: residual' = x + residual,
        returns (norm(residual'), residual') (as `RMSNorm`)."""
        if residual is not None:
            residual = residual + x
            return self.forward(residual), residual
        if self.float32_math:
            bias = None if self.bias is None else self.bias.float()
            h = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps)
            return h.to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """y = (1 + weight) * x / sqrt(mean(x^2) + eps), computed in float32 and rounded once to
    x's dtype (Qwen3-Next, transformers `Qwen3NextRMSNorm`: the stored weight is centred on
    zero, initialised to zeros).

    Args:
        dim: size of the last dimension; eps: added to the mean square; dtype: weight dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., dim] -> same shape and dtype; with `residual`: residual' = x + residual,
        returns (norm(residual'), residual') (as `RMSNorm`, no fused kernel)."""
        if residual is not None:
            residual = residual + x
            return self.forward(residual), residual
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """y = (weight * rmsnorm(x)) * silu(gate): the norm before a Gated DeltaNet layer's
    output projection (transformers `Qwen3NextRMSNormGated`: the normalised x is rounded to
    its dtype, times the weight, times silu(gate) in float32, rounded once more).

    Args:
        dim: size of the last dimension; eps: added to the mean square; dtype: weight dtype.
        sigmoid_gate: y = (weight * rmsnorm(x)) * sigmoid(gate), all in float32 and rounded
            once (transformers `KimiLinearRMSNormGated`, FLA's gated norm).
        weight_in_float32: the weight multiplies the float32 normalised x and the silu gate is
            applied before the one rounding (transformers `LaraMiniRMSNormGated`).
    """

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 sigmoid_gate: bool = False, weight_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.sigmoid_gate = sigmoid_gate
        self.weight_in_float32 = weight_in_float32

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        if self.sigmoid_gate:
            h = self.weight.float() * _normalized(x, self.eps)
            return (h * torch.sigmoid(gate.float())).to(x.dtype)
        if self.weight_in_float32:
            h = self.weight.float() * _normalized(x, self.eps)
            return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
        h = self.weight * _normalized(x, self.eps).to(x.dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """y = weight * rmsnorm_per_group(x * silu(gate)): Mamba-2's gated norm before its output
    projection, the gate applied before the norm (`norm_before_gate=False`) and the mean
    square taken over each of `dim / group_size` groups (transformers
    `GraniteMoeHybridRMSNormGated` / `NemotronHRMSNormGated`: float32 inside, rounded to x's
    dtype before the weight).

    Args:
        dim: size of the last dimension; group_size: features per group (dim a multiple of
            it; dim for one group); eps: added to the mean square; dtype: weight dtype.

    Raises:
        ValueError: dim not a multiple of group_size.
    """

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"gated norm: dim {dim} is not a multiple of group_size {group_size}")
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps, self.group_size = eps, group_size

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [T, dim] -> [T, dim] in x's dtype."""
        h = x.float() * torch.nn.functional.silu(gate.float())
        h = _normalized(h.view(*h.shape[:-1], -1, self.group_size), self.eps).view(h.shape)
        return self.weight * h.to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in float32."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
