"""Routed experts stored as 4-bit weights (`--quantization int4|mxfp4`).

The stacked expert weights w13 [E, 2I, H] and w2 [E, H, I] are quantized once at load time,
about 3.8x less memory than bf16 (~4.25 bits per weight):
- int4 (`quant.int4`, group-wise symmetric): repacked per expert for PyTorch's packed int4 CPU
  matmul (`kernels.cpu_int4`), bfloat16 activations around it; results match the dequantized
  weights to bfloat16 precision.
- mxfp4 (`quant.mxfp4`, OCP MX v1.0): dequantized to the compute dtype before the expert GEMMs
  (exactly the dequantized weights' results; slow on CPU: a first path, kept for correctness).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import fused_moe_cpu
from kernels.cpu_int4 import fused_moe_int4_cpu, pack_int4_for_cpu
from quant.int4 import check_group_size, quantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4
from quant.packing import unpack_nibbles

#: Quantization methods `--quantization` accepts, besides "none".
QUANT_METHODS = ("int4", "mxfp4")


class QuantizedExperts(nn.Module):
    """A 4-bit copy of w13 and w2 and the expert computation over it.

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
        self.method, self.group_size = method, group_size
        self.weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, w in (("w13", w13), ("w2", w2)):
            if method == "int4":
                self.weights[name] = self._quantize_int4(w)
            else:
                self.weights[name] = self._quantize_mxfp4(name, w)

    def _quantize_int4(self, w: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        check_group_size(w.shape[-1], self.group_size)
        packed, scales, _ = quantize_int4(w, self.group_size, symmetric=True)
        codes = unpack_nibbles(packed, "packed")
        return [pack_int4_for_cpu(codes[e], scales[e], self.group_size) for e in range(len(w))]

    @staticmethod
    def _quantize_mxfp4(name: str, w: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if w.shape[-1] % MXFP4_BLOCK_SIZE:
            raise ValueError(
                f"mxfp4: the {name} input dimension {w.shape[-1]} is not a multiple of the "
                f"block size {MXFP4_BLOCK_SIZE}"
            )
        return [quantize_mxfp4(w)]

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [T, H]; topk_weights [T, k] fp32; topk_ids [T, k] int32 -> [T, H]."""
        if self.method == "int4":
            return fused_moe_int4_cpu(
                hidden,
                self.weights["w13"],
                self.weights["w2"],
                self.group_size,
                topk_weights,
                topk_ids,
            )
        w13, w2 = (dequantize_mxfp4(*self.weights[n][0], dtype=hidden.dtype) for n in ("w13", "w2"))
        return fused_moe_cpu(hidden, w13, w2, topk_weights, topk_ids)

    @property
    def nbytes(self) -> int:
        """Bytes the 4-bit weights and their scales take."""
        return sum(
            t.numel() * t.element_size() for ws in self.weights.values() for p in ws for t in p
        )
