"""The native CPU expert path: packed expert weights and the C++ fused MoE (csrc/moe_cpu.cpp).

`PackedExperts.pack` lays each expert's projections out as tiles of 16 output columns stored
k-major (the micro-kernels' order; see csrc/moe_cpu.cpp), once at load time; `__call__` runs
routing-sorted gate/up GEMMs, the SwiGLU, the down GEMM and the weighted sum in one native call,
with the same contract and result (within float32 rounding) as `kernels.reference
.fused_moe_reference`.

Float32 weights whose values are all bfloat16-representable (a bfloat16 checkpoint computed in
float32 on a CPU without native bfloat16, `moe_engine.config.compute_dtype`) are packed as
bfloat16: exactly the same values, half the bytes each decode step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import SILU_AND_MUL, SwiGLU
from kernels.native import load_native

#: Output columns per packed tile (csrc/moe_cpu.cpp kTile).
TILE = 16


def native_moe_available() -> bool:
    """Whether the native MoE kernel is usable in this process (built on first call)."""
    return load_native("moe_cpu") is not None


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N / 16), K, 16]: tiles of 16 output rows, k-major, N zero-padded.

    Unpacking: `packed.transpose(2, 3).reshape(E, -1, K)[:, :N]` gives `w` back exactly.
    """
    e, n, k = w.shape
    padded = -(-n // TILE) * TILE
    w = F.pad(w, (0, 0, 0, padded - n))
    return w.view(e, padded // TILE, TILE, k).transpose(2, 3).contiguous()


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of float32 `w` is a bfloat16 value (so packing it as bfloat16 is
    lossless)."""
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


@dataclass
class PackedExperts:
    """One layer's experts in the native kernel's layout.

    Attributes:
        w13: [E, 2, ceil(I/16), H, 16] gate tiles then up tiles, float32 or bfloat16.
        w2: [E, ceil(H/16), I, 16], same dtype.
        b13: [E, 2, ceil(I/16) * 16] float32 gate/up bias (zero-padded), or an empty tensor.
        b2: [E, ceil(H/16) * 16] float32 down bias, or an empty tensor.
        intermediate: I (tokens' rows of the activation); hidden: H.
        activation: plain or gpt-oss's clamped SwiGLU.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor
    b2: torch.Tensor
    intermediate: int
    hidden: int
    activation: SwiGLU

    @classmethod
    def pack(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        activation: SwiGLU = SILU_AND_MUL,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> PackedExperts:
        """Pack `w13` [E, 2I, H] (gate rows then up rows) and `w2` [E, H, I].

        bfloat16 weights stay bfloat16; float32 weights become bfloat16 only when that is
        exact (`bf16_exact`), else stay float32. Other dtypes are converted to float32.

        Raises:
            ValueError: shapes that do not fit together.
        """
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
            raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}: expected "
                             f"[E, 2I, H] and [E, H, I]")
        e, two_i, h = w13.shape
        i = two_i // 2
        if two_i % 2 or w2.shape[1:] != (h, i):
            raise ValueError(f"w2 {tuple(w2.shape)} must be [E, H, I] = [{e}, {h}, {i}] for "
                             f"w13 {tuple(w13.shape)}")
        dtype = w13.dtype
        if dtype == torch.float32 and bf16_exact(w13) and bf16_exact(w2):
            dtype = torch.bfloat16
        elif dtype not in (torch.float32, torch.bfloat16):
            dtype = torch.float32
        w13, w2 = w13.detach().to(dtype), w2.detach().to(dtype)
        gate_up = torch.stack([pack_tiles(w13[:, :i]), pack_tiles(w13[:, i:])], dim=1)
        ip, hp = gate_up.shape[2] * TILE, -(-h // TILE) * TILE
        empty = torch.empty(0, dtype=torch.float32)
        pb13, pb2 = empty, empty
        if b13 is not None and b2 is not None:
            pb13 = torch.stack([F.pad(b13[:, :i].float(), (0, ip - i)),
                                F.pad(b13[:, i:].float(), (0, ip - i))], dim=1).contiguous()
            pb2 = F.pad(b2.float(), (0, hp - h)).contiguous()
        return cls(gate_up.contiguous(), pack_tiles(w2), pb13, pb2, i, h, activation)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights and biases."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.b13, self.b2))

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H] float32 or bfloat16; topk_weights [T, k] float32; topk_ids [T, k]
        int32/int64 (ids outside [0, E) skipped: other ranks' experts) -> [T, H] in hidden's
        dtype (zero rows for tokens with no pair here).

        Raises:
            RuntimeError: the native kernel is unavailable, or shapes do not match.
        """
        ext = load_native("moe_cpu")
        if ext is None:
            raise RuntimeError("the native MoE kernel is unavailable (see kernels/native.py)")
        act = self.activation
        return ext.fused_moe(
            hidden.contiguous(), self.w13, self.w2, topk_weights, topk_ids, self.b13, self.b2,
            self.intermediate, act.clamped, float(act.alpha or 0.0), act.limit is not None,
            float(act.limit or 0.0),
        )
