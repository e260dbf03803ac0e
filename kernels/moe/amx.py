"""The fused MoE of bfloat16 experts on Intel AMX (csrc/amx_moe.cpp), where the CPU has it, or
on AVX512-BF16 (the same blocks, csrc/bf16_dot.cpp; `kernels.dense.amx.bf16_backend`).

`AmxExperts.pack` lays each expert's projections out in the VNNI pair layout of TDPBF16PS
(`kernels.dense.amx.pack_vnni`), once at bind time; `__call__` runs, in one native call, what
`kernels.moe.native.PackedExperts` runs (routing-sorted gate/up GEMMs, SwiGLU in float32, down
GEMM, weighted sum in float32) with bfloat16 tiles: the result of
`kernels.moe.reference.fused_moe_reference` within bfloat16 rounding (the SwiGLU output is rounded
once to bfloat16 to feed the down projection; the float32 kernel keeps it float32).

A bfloat16 layer on an AMX CPU binds this kernel alone, for every batch size
(`kernels.moe.backends.bind_float_experts`): from 8 rows per expert it is 2-4x the AVX2
kernel, at 1-2 rows per expert 0.85-1.3x (bench/NOTES.md section 9, "small batches"), and one
kernel for all sizes keeps a token's result independent of the batch it runs in (each output element
accumulates over K in the same order whatever the tile blocking; tests/test_amx_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.dense import amx as cpu_amx
from kernels.dense.amx import pack_vnni
from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.native import bias_args
from kernels.moe.native_args import route_args
from kernels.native.library import check_status, load_native


@dataclass(frozen=True, eq=False)
class AmxExperts:
    """One layer's bfloat16 experts packed for csrc/amx_moe.cpp (frozen: pointers are checked
    and taken once).

    Attributes:
        w13: [E, 2, ceil(I/16), ceil(H/32) * 16, 16, 2] bfloat16: gate tiles, then up tiles.
        w2: [E, ceil(H/16), ceil(I/32) * 16, 16, 2] bfloat16.
        b13: [E, 2I] float32 (gate, then up) or empty; b2: [E, H] float32 or empty.
        intermediate: I; hidden: H; activation: plain or gpt-oss's clamped SwiGLU.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor
    b2: torch.Tensor
    intermediate: int
    hidden: int
    activation: SwiGLU

    @classmethod
    def pack(cls, w13: torch.Tensor, w2: torch.Tensor, *, activation: SwiGLU = SILU_AND_MUL,
             b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> AmxExperts:
        """Pack `w13` [E, 2I, H] (gate rows then up rows) and `w2` [E, H, I], rounded to
        bfloat16 (lossless for a bfloat16 layer).

        Raises:
            ValueError: shapes that do not fit together.
        """
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] % 2:
            raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}: expected "
                             "[E, 2I, H] and [E, H, I]")
        e, two_i, h = w13.shape
        i = two_i // 2
        if w2.shape[1:] != (h, i):
            raise ValueError(f"w2 {tuple(w2.shape)} must be [E, H, I] = [{e}, {h}, {i}]")
        w13, w2 = w13.detach().to(torch.bfloat16), w2.detach().to(torch.bfloat16)
        gate_up = torch.stack([pack_vnni(w13[:, :i]), pack_vnni(w13[:, i:])], dim=1)
        pb13, pb2 = bias_args(b13, b2)
        return cls(gate_up.contiguous(), pack_vnni(w2), pb13.clone(), pb2.clone(), i, h,
                   activation)

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights and biases."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.b13, self.b2))

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, tiles: bool | None = None) -> torch.Tensor:
        """hidden [T, H] bfloat16; topk_weights [T, k] float32; topk_ids [T, k] int32/int64
        (ids outside [0, E) skipped: other ranks' experts) -> [T, H] bfloat16 (zero rows for
        tokens with no pair here). `tiles`: this process's backend (None), AMX tiles (True)
        or AVX512-BF16 (False).

        Raises:
            RuntimeError: hidden not bfloat16, shapes that do not match, or a backend that
                cannot run here.
        """
        if hidden.dtype != torch.bfloat16:
            raise RuntimeError(f"hidden must be bfloat16, got {hidden.dtype}")
        lib = load_native("moe_cpu")
        b13, b2 = self.bias_pointers
        r = route_args(hidden, topk_weights, topk_ids, self.hidden)
        act = self.activation
        out = torch.empty_like(r.hidden)
        check_status(lib.moe_amx_fused_moe(
            r.hidden.data_ptr(), r.hidden.shape[0], self.hidden, self.w13.data_ptr(),
            self.w2.data_ptr(), self.experts, self.intermediate, r.weights.data_ptr(),
            r.ids.data_ptr(), r.ids_int64, r.k, b13, b2, act.clamped, float(act.alpha or 0.0),
            act.limit is not None, float(act.limit or 0.0), out.data_ptr(),
            cpu_amx.tiles_flag(tiles), torch.get_num_threads()), "amx fused_moe")
        return out

    @cached_property
    def bias_pointers(self) -> tuple[int | None, int | None]:
        """(b13, b2) pointers or (None, None), after checking every packed tensor once.

        Raises:
            RuntimeError: packed weights or biases of another shape, dtype or layout, or no
                AMX here.
        """
        cpu_amx.require_amx()
        e, i, h = self.experts, self.intermediate, self.hidden
        it, ht, hk, ik = -(-i // 16), -(-h // 16), -(-h // 32) * 16, -(-i // 32) * 16
        for name, t, want in (("w13", self.w13, (e, 2, it, hk, 16, 2)),
                              ("w2", self.w2, (e, ht, ik, 16, 2))):
            if tuple(t.shape) != want or t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise RuntimeError(f"{name} must be packed bfloat16 {list(want)}, got "
                                   f"{t.dtype} {tuple(t.shape)}")
        if not self.b13.numel():
            return None, None
        for name, t, want in (("b13", self.b13, (e, 2 * i)), ("b2", self.b2, (e, h))):
            if tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous():
                raise RuntimeError(f"{name} must be float32 {list(want)}, got {t.dtype} "
                                   f"{tuple(t.shape)}")
        return self.b13.data_ptr(), self.b2.data_ptr()
