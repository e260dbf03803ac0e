"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as the Hugging Face reference does."""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_ops import native_ops_available, rms_norm


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
        self._native_built: bool | None = None  # the fused kernel is usable (asked once)

    def _native(self) -> bool:
        if self._native_built is None:
            self._native_built = native_ops_available()
        return self._native_built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] any float dtype -> same shape and dtype.

        On a CPU, float32/bfloat16 inputs of up to 3 dimensions go through the fused native
        kernel (`kernels.cpu_ops.rms_norm`, same rounding), one call instead of six torch ops.
        """
        if (
            x.device.type == "cpu"
            and x.dim() <= 3
            and x.dtype == self.weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.stride(-1) == 1
            and self._native()
        ):
            return rms_norm(x, self.weight, self.eps, self.weight_in_float32)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)
