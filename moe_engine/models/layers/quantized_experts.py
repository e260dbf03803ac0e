"""Routed experts stored as 4-bit weights (`--quantization int4|mxfp4`).

The stacked expert weights w13 [E, 2I, H] and w2 [E, H, I] are quantized once at load time with
`quant.int4` (group-wise, symmetric) or `quant.mxfp4` (OCP MX v1.0, 32 values per scale), about
3.8x less memory than bf16 (both ~4.25 bits per weight at int4 group 128 and MXFP4). This first
CPU path dequantizes the weights to the compute dtype just before the expert GEMMs (the
semantics the Triton kernels and a packed-int4 CPU matmul must reproduce), so results equal
serving the dequantized weights exactly; it trades speed for memory.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.int4 import check_group_size, dequantize_int4, quantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4

#: Quantization methods `--quantization` accepts, besides "none".
QUANT_METHODS = ("int4", "mxfp4")


class QuantizedExperts(nn.Module):
    """Holds one 4-bit copy of w13 and w2 and gives back dequantized tensors.

    Args:
        w13: [E, 2I, H] float weights (gate rows then up rows); w2: [E, H, I].
        method: "int4" or "mxfp4".
        group_size: int4 values per scale along the input dimension (32, 64 or 128).

    Raises:
        ValueError: a group size (int4) or 32 (mxfp4) that does not divide H or I, naming both.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, method: str, group_size: int) -> None:
        super().__init__()
        if method not in QUANT_METHODS:
            raise ValueError(f"quantization must be one of none, {', '.join(QUANT_METHODS)}")
        self.method = method
        for name, w in (("w13", w13), ("w2", w2)):
            k = w.shape[-1]
            if method == "int4":
                check_group_size(k, group_size)
                packed, scales, _ = quantize_int4(w, group_size, symmetric=True)
            else:
                if k % MXFP4_BLOCK_SIZE:
                    raise ValueError(
                        f"mxfp4: the {name} input dimension {k} is not a multiple of the "
                        f"block size {MXFP4_BLOCK_SIZE}"
                    )
                packed, scales = quantize_mxfp4(w)
            self.register_buffer(f"{name}_packed", packed, persistent=False)
            self.register_buffer(f"{name}_scales", scales, persistent=False)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in `dtype`, from the 4-bit copy."""
        return self._dequantize("w13", dtype), self._dequantize("w2", dtype)

    def _dequantize(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        packed, scales = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scales")
        if self.method == "int4":
            return dequantize_int4(packed, scales, None, dtype=dtype)
        return dequantize_mxfp4(packed, scales, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the 4-bit weights and their scales take."""
        return sum(b.numel() * b.element_size() for b in self.buffers())
