"""Native dense linear layers for the CPU (csrc/linear_cpu.cpp): y = x W^T + b.

torch's float32 GEMM (MKL) reaches about half of a core's FMA rate at decode batch sizes on
the project's machine (a [8, 512] x [512, 512] product: 38 GFLOP/s on one or two cores), and a
bfloat16 checkpoint computed in float32 reads twice the bytes it needs. `PackedLinear` holds the
weight once, packed as 16-column tiles (`kernels.moe.native.pack_tiles`), in bfloat16 when that
is exact, and runs the shared micro-kernels (csrc/gemm.h: AVX2, or AVX-512 in that build).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.moe.native import TILE, bf16_exact, pack_tiles
from kernels.native.library import check_status, dtype_flag, load_native


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """A linear layer's weight in the native layout (frozen: the kernel's pointers to these
    tensors are checked and taken once).

    Attributes:
        weight: [ceil(N/16), K, 16] float32 or bfloat16 tiles.
        bias: [N] float32, or an empty tensor.
        out_features: N; in_features: K.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight and bias."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias))

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        """Pack `weight` [N, K] (and `bias` [N]). float32 weights whose values are all
        bfloat16 values are packed as bfloat16 (lossless); other dtypes become float32.

        Raises:
            ValueError: a weight that is not 2-D, or a bias whose size is not N.
        """
        if weight.dim() != 2:
            raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
        n, k = weight.shape
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        w = weight.detach()
        if w.dtype == torch.float32 and bf16_exact(w):
            w = w.to(torch.bfloat16)
        elif w.dtype not in (torch.float32, torch.bfloat16):
            w = w.float()
        packed = pack_tiles(w.unsqueeze(0))[0]
        b = torch.empty(0) if bias is None else bias.detach().float().contiguous()
        return cls(packed, b, n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 or bfloat16 -> [..., N] in x's dtype (float32 accumulation).

        Raises:
            RuntimeError: the native kernel is unavailable or x's last dimension is not K.
        """
        lib = load_native("linear_cpu")
        if lib is None:
            raise RuntimeError(
                "the native linear kernel is unavailable (see kernels/native/library.py)"
            )
        w_ptr, w_bf16, bias_ptr = self.weight_args
        n, k, shape = self.out_features, self.in_features, x.shape
        if not shape or shape[-1] != k:
            raise RuntimeError(f"x [..., K] must have K = {k}, got {tuple(shape)}")
        x_bf16 = dtype_flag(x, "x")
        # [..., K] contiguous is [M, K]; kept alive through the call
        xf = (x.float() if x_bf16 else x).contiguous()
        y = x.new_empty((*shape[:-1], n))
        check_status(lib.moe_linear(xf.data_ptr(), y.numel() // n if n else 0, k, w_ptr, w_bf16,
                                    n, bias_ptr, y.data_ptr(), x_bf16, torch.get_num_threads()),
                     "linear")
        return y

    @cached_property
    def weight_args(self) -> tuple[int, int, int | None]:
        """(weight pointer, its dtype flag, bias pointer or None), checked once.

        Raises:
            RuntimeError: a weight or bias the kernel does not take.
        """
        w, n, k, bias = self.weight, self.out_features, self.in_features, self.bias
        if (w.dim() != 3 or w.shape[2] != TILE or not w.is_contiguous() or w.shape[1] != k
                or not n <= w.shape[0] * TILE < n + TILE):
            raise RuntimeError(f"w must be packed [ceil(N/16), K, 16] = [{-(-n // TILE)}, {k}, "
                               f"16], got {tuple(w.shape)}")
        if bias.numel() and (bias.numel() != n or bias.dtype != torch.float32
                             or not bias.is_contiguous()):
            raise RuntimeError(f"bias must be float32 [N] = [{n}], got {bias.dtype} "
                               f"{tuple(bias.shape)}")
        return w.data_ptr(), dtype_flag(w, "w"), bias.data_ptr() if bias.numel() else None


assert TILE == 16  # csrc/gemm_avx2.h and gemm_avx512.h kTile
