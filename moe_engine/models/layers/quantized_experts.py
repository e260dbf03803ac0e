"""Routed experts stored as 4-bit weights (`--quantization int4|mxfp4`).

The stacked expert weights w13 [E, 2I, H] and w2 [E, H, I] are quantized once at load time
(or arrive quantized), about 3.8x less memory than bf16 (~4.25 bits per weight):
- int4 (`quant.int4`, group-wise; symmetric when quantized here, a checkpoint's may be
  asymmetric);
- mxfp4 (`quant.mxfp4`, OCP Microscaling Formats (MX) Specification v1.0).

Where the native CPU kernel builds (`kernels.native.load_native("moe_cpu")`, the default), the
codes are kept only in its tile layout (`kernels.cpu_native.PackedQuantExperts`) and decoded in
registers, float32 activations and accumulation: the dequantized weights' float32 result, for
both formats, and faster than the bf16 experts at decode sizes (bench/moe_kernel.py). With
`MOE_ENGINE_NATIVE=0` (or no AVX2 / no compiler) the torch paths run instead:
- int4: repacked per expert for PyTorch's packed int4 CPU matmul (`kernels.cpu_int4`),
  bfloat16 activations around it; results match the dequantized weights to bfloat16 precision.
- mxfp4: each step only the experts with tokens are dequantized, by table lookup into a reused
  buffer in the compute dtype, then the float GEMM path runs (`kernels.cpu_mxfp4`).
Both take the activation (plain SwiGLU or gpt-oss's clamped one) and optional expert biases.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import SILU_AND_MUL, SwiGLU
from kernels.cpu_int4 import fused_moe_int4_cpu, pack_int4_for_cpu
from kernels.cpu_mxfp4 import fused_moe_mxfp4_cpu
from kernels.cpu_native import PackedQuantExperts, native_moe_available
from kernels.native import load_native
from quant.int4 import INT4_GROUP_SIZES, Int4Weight, check_group_size, quantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, quantize_mxfp4
from quant.packing import unpack_nibbles

#: Quantization methods `--quantization` accepts, besides "none".
QUANT_METHODS = ("int4", "mxfp4")


class QuantizedExperts(nn.Module):
    """A 4-bit copy of w13 and w2 and the expert computation over it.

    Args:
        w13: [E, 2I, H] float weights (gate rows then up rows); w2: [E, H, I].
        method: "int4" or "mxfp4".
        group_size: int4 values per scale along the input dimension (32, 64 or 128).
        scale_dtype: int4 scales' storage: float32, or a 16-bit checkpoint's own dtype
            (bfloat16/float16: 4 + 16 / group_size bits per weight; the native kernel reads
            them as stored).
        activation: plain SwiGLU (default) or gpt-oss's clamped variant.
        b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias, kept unquantized
            (the three are plain attributes: set them on an instance made by `from_int4`).

    Attributes:
        native: the weights in the native kernel's layout, or None (torch paths only).
        weights: the torch paths' form (see `weights`).

    Raises:
        ValueError: a group size (int4) or 32 (mxfp4) that does not divide H or I, naming both.
    """

    activation: SwiGLU = SILU_AND_MUL
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        method: str,
        group_size: int,
        *,
        scale_dtype: torch.dtype = torch.float32,
        activation: SwiGLU = SILU_AND_MUL,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.activation, self.b13, self.b2 = activation, b13, b2
        if method not in QUANT_METHODS:
            raise ValueError(f"quantization must be one of none, {', '.join(QUANT_METHODS)}")
        self.method, self.group_size, self.scale_dtype = method, group_size, scale_dtype
        if method == "int4":
            self._set_int4(self._quantize_int4(w13), self._quantize_int4(w2))
        else:
            self._set_mxfp4(self._quantize_mxfp4("w13", w13), self._quantize_mxfp4("w2", w2))

    def _quantize_int4(self, w: torch.Tensor) -> list[Int4Weight]:
        check_group_size(w.shape[-1], self.group_size)
        packed, scales, _ = quantize_int4(
            w, self.group_size, symmetric=True, scale_dtype=self.scale_dtype
        )
        return [Int4Weight(packed[e], scales[e], None) for e in range(len(w))]

    def _set_int4(self, w13: list[Int4Weight], w2: list[Int4Weight]) -> None:
        """Keep int4 experts in the native layout when the native kernel is available, else in
        the torch int4 matmul's."""
        self.native: PackedQuantExperts | None = None
        self._weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        if native_moe_available():
            self.native = PackedQuantExperts.from_int4(w13, w2)
        else:
            self._weights = self._int4_torch_weights(w13, w2)

    def _int4_torch_weights(
        self, w13: list[Int4Weight], w2: list[Int4Weight]
    ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        return {
            name: [
                pack_int4_for_cpu(
                    unpack_nibbles(w.packed, "packed"), w.scales, self.group_size, w.zeros
                )
                for w in ws
            ]
            for name, ws in (("w13", w13), ("w2", w2))
        }

    def _set_mxfp4(
        self, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Keep MXFP4 experts (blocks, scales) in the native layout when the native kernel is
        available, else as they are (the torch path's form)."""
        self.native = None
        self._weights = None
        if native_moe_available():
            self.native = PackedQuantExperts.from_mxfp4(w13, w2)
        else:
            self._weights = {"w13": [w13], "w2": [w2]}

    @property
    def weights(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The torch paths' form of the weights: "w13"/"w2" -> per expert the
        `kernels.cpu_int4.pack_int4_for_cpu` pair (int4), or one (blocks, scales) pair for all
        experts (mxfp4). When the native layout holds the weights this is unpacked from it
        (exactly) on first use and kept, adding its bytes to `nbytes`."""
        if self._weights is None:
            assert self.native is not None
            if self.method == "int4":
                self._weights = self._int4_torch_weights(*self.native.to_int4())
            else:
                w13, w2 = self.native.to_mxfp4()
                self._weights = {"w13": [w13], "w2": [w2]}
        return self._weights

    @classmethod
    def from_int4(cls, w13: list[Int4Weight], w2: list[Int4Weight]) -> QuantizedExperts:
        """Experts from weights that are int4 already (a pre-quantized checkpoint, e.g.
        `quant.compressed_tensors`), repacked for the CPU int4 matmul; nothing is re-quantized.

        Args:
            w13: per local expert slot, gate rows then up rows: packed [2I, H // 2] uint8,
                scales [2I, H // group_size], zeros (asymmetric) or None.
            w2: per local expert slot: packed [H, I // 2], scales [H, I // group_size].

        Raises:
            ValueError: no experts, lists of different lengths, or group sizes that differ
                between weights or are not in `quant.int4.INT4_GROUP_SIZES` (names them).
        """
        if not w13 or len(w13) != len(w2):
            raise ValueError(f"int4 experts: {len(w13)} w13 and {len(w2)} w2 weights")
        group_sizes = sorted({w.group_size for w in (*w13, *w2)})
        if len(group_sizes) != 1 or group_sizes[0] not in INT4_GROUP_SIZES:
            raise ValueError(
                f"int4 experts: group sizes {group_sizes}; one of {INT4_GROUP_SIZES} is needed "
                f"for every expert weight of a layer"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.method, self.group_size = "int4", group_sizes[0]
        self._set_int4(w13, w2)
        return self

    @classmethod
    def from_mxfp4(
        cls,
        w13: tuple[torch.Tensor, torch.Tensor],
        w2: tuple[torch.Tensor, torch.Tensor],
        *,
        activation: SwiGLU = SILU_AND_MUL,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> QuantizedExperts:
        """Experts from weights that are MXFP4 already (gpt-oss `*_blocks` / `*_scales`, OCP MX
        v1.0 as `quant.mxfp4` lays it out), kept as they are: nothing is dequantized or
        re-quantized.

        Args:
            w13: (blocks [E, 2I, H // 32, 16], scales [E, 2I, H // 32]) uint8, gate rows then
                up rows.
            w2: (blocks [E, H, I // 32, 16], scales [E, H, I // 32]) uint8.
            activation, b13, b2: as in the constructor.

        Raises:
            ValueError: wrong dtypes or shapes (blocks not [E, N, K // 32, 16], scales not
                blocks.shape[:-1], or expert counts or widths that do not chain).
        """
        (w13_blocks, w13_scales), (w2_blocks, w2_scales) = w13, w2
        tensors = (w13_blocks, w13_scales, w2_blocks, w2_scales)
        half = MXFP4_BLOCK_SIZE // 2
        ok = all(t.dtype == torch.uint8 for t in tensors) and w13_blocks.dim() == 4
        if ok:
            num, two_i, h_blocks = w13_scales.shape if w13_scales.dim() == 3 else (0, 1, 0)
            i_blocks = two_i // 2 // MXFP4_BLOCK_SIZE
            ok = (
                tuple(w13_blocks.shape) == (num, two_i, h_blocks, half)
                and tuple(w2_blocks.shape) == (num, h_blocks * MXFP4_BLOCK_SIZE, i_blocks, half)
                and tuple(w2_scales.shape) == tuple(w2_blocks.shape[:-1])
                and num > 0
            )
        if not ok:
            raise ValueError(
                "mxfp4 experts: need uint8 w13 blocks [E, 2I, H // 32, 16], scales "
                "[E, 2I, H // 32], w2 blocks [E, H, I // 32, 16], scales [E, H, I // 32]; got "
                + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors)
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.method, self.group_size = "mxfp4", MXFP4_BLOCK_SIZE
        self.activation, self.b13, self.b2 = activation, b13, b2
        self._set_mxfp4((w13_blocks, w13_scales), (w2_blocks, w2_scales))
        return self

    @staticmethod
    def _quantize_mxfp4(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if w.shape[-1] % MXFP4_BLOCK_SIZE:
            raise ValueError(
                f"mxfp4: the {name} input dimension {w.shape[-1]} is not a multiple of the "
                f"block size {MXFP4_BLOCK_SIZE}"
            )
        return quantize_mxfp4(w)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [T, H]; topk_weights [T, k] fp32; topk_ids [T, k] int32 -> [T, H].

        The native kernel when it holds the weights and is enabled (`MOE_ENGINE_NATIVE` is not
        0), else the torch path of the method.
        """
        extra = {"activation": self.activation, "b13": self.b13, "b2": self.b2}
        if self.native is not None and load_native("moe_cpu") is not None:
            return self.native(hidden, topk_weights, topk_ids, **extra)
        if self.method == "int4":
            return fused_moe_int4_cpu(
                hidden,
                self.weights["w13"],
                self.weights["w2"],
                self.group_size,
                topk_weights,
                topk_ids,
                **extra,
            )
        (w13, w13_scales), (w2, w2_scales) = self.weights["w13"][0], self.weights["w2"][0]
        return fused_moe_mxfp4_cpu(
            hidden, w13, w13_scales, w2, w2_scales, topk_weights, topk_ids, **extra
        )

    @property
    def nbytes(self) -> int:
        """Bytes the 4-bit weights and their scales take (both layouts, when both are held)."""
        total = 0 if self.native is None else self.native.nbytes
        if self._weights is not None:
            total += sum(
                t.numel() * t.element_size() for ws in self._weights.values() for p in ws for t in p
            )
        return total
