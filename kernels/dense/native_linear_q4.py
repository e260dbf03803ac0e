"""Native dense linear layers over 4-bit weights for the CPU (csrc/linear_q4_cpu.cpp).

A batch-1 decode step is bound by reading its weights; with the experts in 4 bits, the
attention projections and the LM head kept in bfloat16 are most of what a step still reads
(bench/NOTES.md section 20: 18.4 of 26 MB on the benchmark's model). `PackedQuantLinear` holds a
projection's weight as group-wise int4 (`quant.int4`, GPTQ/AWQ style) or MXFP4 (OCP Microscaling
Formats (MX) Specification v1.0) codes in the 4-bit tile layout of the experts' kernel
(`kernels.moe.native.pack_q4_tiles`), decoded in registers by the same micro-kernels, so it
reads 4 + 32 / G bits per weight (int4 with float32 scales; 4.25 for MXFP4), as llama.cpp's
Q4_0 GGUFs hold their attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.dense.amx import bf16_backend
from kernels.moe.native import TILE, pack_q4_tiles, pack_tiles, unpack_q4_tiles, unpack_tiles
from kernels.moe.native_args import INT4_SCALE_FORMATS
from kernels.native.library import check_status, dtype_flag, load_native
from quant.int4 import dequantize_int4, quantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4
from quant.packing import pack_nibbles, unpack_nibbles

#: The methods `PackedQuantLinear.quantize` takes.
METHODS = ("int4", "mxfp4")
#: The kernel's format bit for VDPBF16PS products at up to 8 bfloat16 rows
#: (csrc/linear_q4_cpu.cpp `kDotFlag`): set where this process's bfloat16 kernels run on
#: AVX512-BF16 or AMX (`kernels.dense.amx.bf16_backend`, decided and logged once); the kernel
#: ignores it for float32 inputs, more rows, group sizes not a multiple of 16 and the AVX2 build.
DOT_FLAG = 16


@dataclass(frozen=True, eq=False)
class PackedQuantLinear:
    """A linear layer's weight quantized to 4 bits, in the native kernel's layout (frozen: the
    kernel's pointers are checked and taken once).

    Attributes:
        method: "int4" (symmetric, scales in `scales`' dtype) or "mxfp4" (E8M0 scale bytes).
        codes: [ceil(N/16), K/2, 16] uint8 (`pack_q4_tiles` order).
        scales: [ceil(N/16), K/G, 16]: float32 / bfloat16 / float16 (int4) or uint8 (mxfp4).
        bias: [N] float32, or an empty tensor.
        out_features: N; in_features: K; group_size: G (32 for mxfp4).
    """

    method: str
    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor
    out_features: int
    in_features: int
    group_size: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                 group_size: int, scale_dtype: torch.dtype = torch.float32) -> PackedQuantLinear:
        """Quantize `weight` [N, K] (any float dtype; computed in float32) and pack it.

        Args:
            weight: [N, K]; bias: [N] or None.
            method: "int4" (symmetric group-wise, `quant.int4.quantize_int4`) or "mxfp4"
                (`quant.mxfp4.quantize_mxfp4`, blocks of 32).
            group_size: int4 values per scale along K (ignored for mxfp4).
            scale_dtype: the int4 scales' storage: float32, bfloat16 or float16.

        Raises:
            ValueError: an unknown method, a weight that is not 2-D or holds Inf/NaN, a bias
                whose size is not N, or a group size that does not divide K (the message names
                K and the group size).
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
        n, k = weight.shape
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        w = weight.detach()  # quantized row chunk by row chunk, in float32 (no whole copy)
        if method == "int4":
            packed, scales, _ = quantize_int4(w, group_size, symmetric=True,
                                              scale_dtype=scale_dtype)
            codes = unpack_nibbles(packed, "packed")
        else:
            blocks, scales = quantize_mxfp4(w)
            codes = unpack_nibbles(blocks.reshape(n, k // 2), "blocks")
            group_size = MXFP4_BLOCK_SIZE
        b = torch.empty(0) if bias is None else bias.detach().float().contiguous()
        return cls(method, pack_q4_tiles(codes.unsqueeze(0))[0],
                   pack_tiles(scales.unsqueeze(0))[0].contiguous(), b, n, k, group_size)

    @property
    def dequantized(self) -> torch.Tensor:
        """[N, K] float32: the values the kernel computes with, exactly (`quant.int4` /
        `quant.mxfp4` dequantization of the stored codes); made on each call."""
        n, k = self.out_features, self.in_features
        packed = pack_nibbles(unpack_q4_tiles(self.codes.unsqueeze(0), n)[0].contiguous())
        scales = unpack_tiles(self.scales.unsqueeze(0), n)[0].contiguous()
        if self.method == "int4":
            return dequantize_int4(packed, scales, None, dtype=torch.float32)
        return dequantize_mxfp4(packed.reshape(n, k // MXFP4_BLOCK_SIZE, -1), scales,
                                dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads: the packed codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 or bfloat16 -> [..., N] in x's dtype: x @ dequantized.T + bias,
        float32 accumulation.

        Raises:
            RuntimeError: the native kernel is unavailable or x's last dimension is not K.
        """
        lib = load_native("linear_q4_cpu")
        if lib is None:
            raise RuntimeError("the native 4-bit linear kernel is unavailable "
                               "(see kernels/native/library.py)")
        n, k, shape = self.out_features, self.in_features, x.shape
        if not shape or shape[-1] != k:
            raise RuntimeError(f"x [..., K] must have K = {k}, got {tuple(shape)}")
        x_bf16 = dtype_flag(x, "x")
        xc = x.contiguous()  # [M, K], kept alive through the call
        y = x.new_empty((*shape[:-1], n))
        codes, scales, fmt, bias = self.weight_args
        check_status(lib.moe_linear_q4(xc.data_ptr(), x_bf16, y.numel() // n if n else 0, k,
                                       codes, scales, None, fmt, self.group_size, n, bias,
                                       y.data_ptr(), x_bf16, torch.get_num_threads()),
                     "linear_q4")
        return y

    @cached_property
    def weight_args(self) -> tuple[int, int, int, int | None]:
        """(codes pointer, scales pointer, the kernel's format, bias pointer or None), checked
        once: format 0 MXFP4, 1 / 2 / 3 int4 with float32 / bfloat16 / float16 scales, plus
        `DOT_FLAG` where `bf16_backend()` runs the bfloat16 kernels.

        Raises:
            RuntimeError: tensors the kernel does not take.
        """
        n, k, g = self.out_features, self.in_features, self.group_size
        tiles = -(-n // TILE)
        c, s, b = self.codes, self.scales, self.bias
        if (c.dtype != torch.uint8 or tuple(c.shape) != (tiles, k // 2, TILE)
                or not c.is_contiguous() or k % g or g % 2):
            raise RuntimeError(f"codes must be uint8 [{tiles}, {k // 2}, 16] with a group size "
                               f"dividing K = {k}, got {c.dtype} {tuple(c.shape)}, G = {g}")
        fmt = 0 if self.method == "mxfp4" else INT4_SCALE_FORMATS.get(s.dtype)
        if (fmt is None or (fmt == 0 and s.dtype != torch.uint8)
                or tuple(s.shape) != (tiles, k // g, TILE) or not s.is_contiguous()):
            raise RuntimeError(f"scales must be [{tiles}, {k // g}, 16] (int4: float32, bfloat16 "
                               f"or float16; mxfp4: uint8), got {s.dtype} {tuple(s.shape)}")
        if b.numel() and (b.numel() != n or b.dtype != torch.float32 or not b.is_contiguous()):
            raise RuntimeError(f"bias must be float32 [{n}], got {b.dtype} {tuple(b.shape)}")
        if bf16_backend() is not None:
            fmt |= DOT_FLAG
        return c.data_ptr(), s.data_ptr(), fmt, b.data_ptr() if b.numel() else None
