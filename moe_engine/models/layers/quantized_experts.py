"""Routed experts stored as 4-bit weights (`--quantization int4|mxfp4`).

The stacked expert weights w13 [E, 2I, H] and w2 [E, H, I] are quantized once at load time
(or arrive quantized), about 3.8x less memory than bf16 (~4.25 bits per weight):
- int4 (`quant.int4`, group-wise; symmetric when quantized here, a checkpoint's may be
  asymmetric; scales float32 or the checkpoint's 16-bit dtype, kept as stored);
- mxfp4 (`quant.mxfp4`, OCP Microscaling Formats (MX) Specification v1.0).

Until `bind_kernels` the weights are held once, in the canonical stacked layout
(`kernels.moe.backends.Int4Experts` / `Mxfp4Experts`, as non-persistent buffers, so that the
module moves with `.to(device)`; never `.to(dtype)` it, which would cast the int4 scales too).
`bind_kernels(plan)` takes the kernel of "fused_moe_int4" or "fused_moe_mxfp4" from the plan
(`KernelPlan.quantized_experts`), which converts the weights once into that backend's layout
(`kernels.moe.backends`: native-cpu's `PackedQuantExperts`, decoded in registers; torch's
packed int4 CPU matmul or MXFP4 table dequantization, off the CPU a
dequantize-the-active-experts float path; triton's `fused_moe_int4` / `fused_moe_mxfp4`, on
the canonical layout itself); the canonical copy is
dropped when the bound layout is another one. Forward then calls the bound kernel, with the
activation (plain SwiGLU or gpt-oss's clamped one) and the optional expert biases.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.backends import (
    BoundExperts,
    Int4Experts,
    Mxfp4Experts,
    tensors_of,
)
from kernels.plan import TORCH, KernelPlan
from quant.int4 import INT4_GROUP_SIZES, Int4Weight, check_group_size, quantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, quantize_mxfp4

#: Quantization methods `--quantization` accepts, besides "none".
QUANT_METHODS = ("int4", "mxfp4")

class QuantizedExperts(nn.Module):
    """A 4-bit copy of w13 and w2 and the expert computation over it.

    Args:
        w13: [E, 2I, H] float weights (gate rows then up rows); w2: [E, H, I].
        method: "int4" or "mxfp4".
        group_size: int4 values per scale along the input dimension (32, 64 or 128).
        scale_dtype: int4 scales' storage: float32, or a 16-bit checkpoint's own dtype
            (bfloat16/float16: 4 + 16 / group_size bits per weight; every backend reads them
            as stored).
        activation: plain SwiGLU (default) or gpt-oss's clamped variant.
        b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias, kept unquantized
            (the three are plain attributes, read on every forward).

    Attributes:
        bound: the `kernels.moe.backends.BoundExperts` that forward calls; None before
            `bind_kernels`.

    Raises:
        ValueError: a group size (int4) or 32 (mxfp4) that does not divide H or I, naming both.
    """

    activation: SwiGLU = SILU_AND_MUL
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    #: The plan the weights were last bound by (`bind_kernels`).
    _bound_plan: KernelPlan | None = None

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
        self.method, self.group_size = method, group_size
        if method == "int4":
            self._hold(Int4Experts(*self._quantize_int4(w13, scale_dtype),
                                   *self._quantize_int4(w2, scale_dtype)))
        else:
            q13, q2 = self._quantize_mxfp4("w13", w13), self._quantize_mxfp4("w2", w2)
            self._hold(Mxfp4Experts(*q13, *q2))

    def _quantize_int4(self, w: torch.Tensor, scale_dtype: torch.dtype) -> tuple:
        check_group_size(w.shape[-1], self.group_size)
        return quantize_int4(w, self.group_size, symmetric=True, scale_dtype=scale_dtype)

    def _hold(self, weights: Int4Experts | Mxfp4Experts | None) -> None:
        """Keep `weights` as the canonical layout, as non-persistent buffers named after its
        fields (state_dict unchanged; `nbytes` counts them); None drops it."""
        if weights is not None:
            self._layout = type(weights)
        for name in self._layout.__dataclass_fields__:
            value = None if weights is None else getattr(weights, name)
            if name in self._buffers:
                self._buffers[name] = value
            else:
                self.register_buffer(name, value, persistent=False)
        self._held = weights is not None
        if not hasattr(self, "bound"):
            self.bound: BoundExperts | None = None

    def canonical(self) -> Int4Experts | Mxfp4Experts:
        """The weights in the canonical stacked layout: the held copy, or given back exactly
        by the bound layout (native-cpu unpacks its tiles).

        Raises:
            RuntimeError: the bound layout cannot give it back (torch's int4 CPU layout rounds
                the scales to bfloat16); quantize or load the experts again instead.
        """
        if self._held:
            names = self._layout.__dataclass_fields__
            return self._layout(*(self._buffers[n] for n in names))
        if self.bound is None or self.bound.restore is None:
            backend = None if self.bound is None else self.bound.backend
            raise RuntimeError(
                f"{self.method} experts bound to {backend} cannot give the canonical layout "
                "back (torch's int4 CPU layout rounds the scales to bfloat16); quantize or "
                "load them again"
            )
        return self.bound.restore()

    @property
    def backend(self) -> str | None:
        """The bound backend ("native-cpu", "torch", "triton"), None before `bind_kernels`."""
        return None if self.bound is None else self.bound.backend

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Convert the weights once into the layout of `plan`'s backend for this method's op
        ("fused_moe_int4" / "fused_moe_mxfp4") and make forward call it. Binding again
        rebuilds the layout from the canonical one (restored from the bound layout when it was
        dropped); binding the torch int4 CPU layout again to torch is a no-op (it holds what
        it held: nothing changes 4-bit codes in place). The same plan object again is a no-op.

        Raises:
            RuntimeError: another backend after torch's int4 CPU layout (see `canonical`), or
                native-cpu with weights not on a CPU.
            ValueError: an unknown backend.
        """
        if self._bound_plan is plan:
            return  # bound already by this plan (FusedMoE binds it, then the model walk)
        self._bound_plan = plan
        if not self._held and plan.keeps_experts(self.method, self.bound):
            return
        weights = self.canonical()
        self.bound = plan.quantized_experts(self.method, weights)
        held = {id(t) for t in self.bound.held}
        self._hold(weights if all(id(t) in held for t in tensors_of(weights)) else None)

    @classmethod
    def from_int4(cls, w13: list[Int4Weight], w2: list[Int4Weight]) -> QuantizedExperts:
        """Experts from weights that are int4 already (a pre-quantized checkpoint, e.g.
        `quant.compressed_tensors`), stacked as they are (scales in their own dtype);
        nothing is re-quantized.

        Args:
            w13: per local expert slot, gate rows then up rows: packed [2I, H // 2] uint8,
                scales [2I, H // group_size], zeros (asymmetric) or None.
            w2: per local expert slot: packed [H, I // 2], scales [H, I // group_size].

        Raises:
            ValueError: no experts, lists of different lengths, shapes that differ between
                experts or do not chain, or group sizes that differ between weights or are not
                in `quant.int4.INT4_GROUP_SIZES` (names them).
        """
        if not w13 or len(w13) != len(w2):
            raise ValueError(f"int4 experts: {len(w13)} w13 and {len(w2)} w2 weights")
        group_sizes = sorted({w.group_size for w in (*w13, *w2)})
        if len(group_sizes) != 1 or group_sizes[0] not in INT4_GROUP_SIZES:
            raise ValueError(
                f"int4 experts: group sizes {group_sizes}; one of {INT4_GROUP_SIZES} is needed "
                f"for every expert weight of a layer"
            )
        shapes13, shapes2 = ({tuple(w.shape) for w in ws} for ws in (w13, w2))
        if len(shapes13) != 1 or len(shapes2) != 1:
            raise ValueError(f"int4 experts: w13 shapes {sorted(shapes13)}, w2 shapes "
                             f"{sorted(shapes2)}: need one each")
        (two_i, h), = shapes13
        if two_i % 2 or shapes2 != {(h, two_i // 2)}:
            raise ValueError(f"int4 experts: w13 {(two_i, h)} and w2 {sorted(shapes2)[0]} do "
                             f"not chain (w2 must be [H, I] = {(h, two_i // 2)})")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.method, self.group_size = "int4", group_sizes[0]
        self._hold(Int4Experts.stack(w13, w2))
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
        self._hold(Mxfp4Experts(w13_blocks, w13_scales, w2_blocks, w2_scales))
        return self

    @classmethod
    def from_layout(
        cls,
        weights: Int4Experts | Mxfp4Experts,
        *,
        activation: SwiGLU = SILU_AND_MUL,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> QuantizedExperts:
        """Experts over weights already in the canonical layout (a weight update's
        re-quantized copy, `moe_engine.weight_update.staging`), held as they are."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.method = "int4" if isinstance(weights, Int4Experts) else "mxfp4"
        self.group_size = weights.group_size
        self.activation, self.b13, self.b2 = activation, b13, b2
        self._hold(weights)
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
        """hidden: [T, H]; topk_weights [T, k] fp32; topk_ids [T, k] int32 -> [T, H] in
        hidden's dtype: the bound kernel.

        Unbound (a module built outside the engine, which always binds), the first call binds
        torch, as for every kernel-using layer.
        """
        if self.bound is None:
            self.bind_kernels(KernelPlan.uniform(TORCH, hidden.device.type))
        return self.bound(hidden, topk_weights, topk_ids, activation=self.activation,
                          b13=self.b13, b2=self.b2)

    @property
    def nbytes(self) -> int:
        """Bytes the 4-bit weights and their scales take (the canonical layout while held,
        plus the bound layout's tensors that are not the same ones)."""
        tensors = {id(t): t for t in self._buffers.values() if t is not None}
        if self.bound is not None:
            tensors.update((id(t), t) for t in self.bound.held)
        return sum(t.numel() * t.element_size() for t in tensors.values())
