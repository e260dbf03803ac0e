"""The routed-expert kernel of each backend, made once at bind time from a layer's weights.

`FusedMoE.bind_kernels` / `QuantizedExperts.bind_kernels` (moe_engine/models/layers) read the
backend of their op from the `kernels.registry.KernelPlan` ("fused_moe" for float experts,
"fused_moe_int4", "fused_moe_mxfp4") and call `bind_float_experts`, `bind_int4_experts` or
`bind_mxfp4_experts` here once: the weights are converted into that backend's layout then, and
each forward calls the returned `BoundExperts` with no probe of device or availability.

Per backend (float / int4 / mxfp4):
- native-cpu: `cpu_native.PackedExperts` / `PackedQuantExperts` / `PackedQuantExperts`.
- torch: on a CPU `cpu.fused_moe_cpu` / `cpu_int4` (torch's packed int4 matmul) /
  `cpu_mxfp4` (table dequantization); on other devices the `reference` loop, the 4-bit
  formats after dequantizing the experts that have tokens (correct, slow).
- triton: `fused_moe.fused_moe` / `fused_moe_int4` / `fused_moe_mxfp4`.

The canonical 4-bit layouts (what construction and checkpoints give, and what the triton
kernels read directly) are `Int4Experts` (stacked `quant.int4`) and `Mxfp4Experts` (stacked
`quant.mxfp4`, gpt-oss's blocks/scales).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from kernels.dense import amx as cpu_amx
from kernels.moe.activation import SILU_AND_MUL, SquaredReLU, SwiGLU
from kernels.moe.reference import fused_moe_reference
from quant.int4 import SYMMETRIC_ZERO, Int4Weight, dequantize_int4
from quant.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4

NATIVE_CPU, TORCH, TRITON = "native-cpu", "torch", "triton"  # kernels.registry's names



#: The fallback of non-gated experts on the native-cpu and Triton backends, as the startup
#: plan prints it (`bind_float_experts`).
NON_GATED_FALLBACK = ("non-gated (relu^2) experts, Nemotron-H's: the torch expert path (this "
                      "backend's fused MoE kernel computes SwiGLU only)")


def native_float_variants() -> tuple[str, ...]:
    """Which native kernel float experts run (chosen at bind time per layer, never per batch,
    so a token's result never depends on the batch around it), as the startup plan prints
    it."""
    bf16 = cpu_amx.bf16_backend()
    if bf16 is None:
        return (f"every layer: the AVX2/AVX-512 kernel (no bf16 kernel here: "
                f"{cpu_amx.amx_unavailable_reason()})", NON_GATED_FALLBACK)
    return (f"bfloat16 experts: the bf16 kernel on {bf16}, every batch size; float32 "
            f"experts: the AVX2/AVX-512 kernel", NON_GATED_FALLBACK)
EXPERT_BACKENDS = (NATIVE_CPU, TORCH, TRITON)

#: (hidden [T, H], topk_weights [T, k] fp32, topk_ids [T, k] int32, **extras) -> [T, H]; the
#: 4-bit kernels take `ExpertExtras.as_kwargs()` per call, the float ones took them at bind.
ExpertFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ExpertExtras:
    """What every expert kernel takes besides the weights: the activation (plain SwiGLU or
    gpt-oss's clamped one) and optional biases b13 [E, 2I] (gate, up) and b2 [E, H], held by
    reference (a bias reloaded in place is seen by the kernels that read it per call)."""

    activation: SwiGLU | SquaredReLU = SILU_AND_MUL
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def as_kwargs(self) -> dict:
        return {"activation": self.activation, "b13": self.b13, "b2": self.b2}


@dataclass(frozen=True)
class Int4Experts:
    """Stacked int4 experts in `quant.int4`'s layout (the triton kernel's too).

    Attributes:
        w13_packed: [E, 2I, H/2] uint8 (gate rows, then up rows; low nibble = even k).
        w13_scales: [E, 2I, H/G] float32, bfloat16 or float16 (as the checkpoint stores them).
        w13_zeros: [E, 2I, H/G] uint8 zero points, or None (symmetric: zero point 8).
        w2_packed: [E, H, I/2]; w2_scales: [E, H, I/G]; w2_zeros: like w2_scales or None.
    """

    w13_packed: torch.Tensor
    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor | None
    w2_packed: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return 2 * self.w13_packed.shape[-1] // self.w13_scales.shape[-1]

    @classmethod
    def stack(cls, w13: list[Int4Weight], w2: list[Int4Weight]) -> Int4Experts:
        """From one `Int4Weight` per expert (all with one group size; scales cast to the first
        one's dtype; a symmetric expert beside asymmetric ones gets its zero point 8 made
        explicit)."""
        scale_dtype = w13[0].scales.dtype
        asym = any(w.zeros is not None for w in (*w13, *w2))

        def zeros(w: Int4Weight) -> torch.Tensor:
            if w.zeros is not None:
                return w.zeros
            return torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8,
                              device=w.scales.device)

        def one(ws: list[Int4Weight]) -> tuple:
            return (torch.stack([w.packed for w in ws]),
                    torch.stack([w.scales.to(scale_dtype) for w in ws]),
                    torch.stack([zeros(w) for w in ws]) if asym else None)

        return cls(*one(w13), *one(w2))

    def per_expert(self) -> tuple[list[Int4Weight], list[Int4Weight]]:
        """One `Int4Weight` per expert for w13 and for w2 (views, no copy)."""
        def split(p, s, z):
            return [Int4Weight(p[e], s[e], None if z is None else z[e]) for e in range(len(p))]
        return (split(self.w13_packed, self.w13_scales, self.w13_zeros),
                split(self.w2_packed, self.w2_scales, self.w2_zeros))

    def dequantize(self, experts: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(w13 [U, 2I, H], w2 [U, H, I]) of `experts` ([U] int64) in `dtype`."""
        def one(p, s, z):
            return dequantize_int4(p[experts], s[experts], None if z is None else z[experts],
                                   dtype=dtype)
        return (one(self.w13_packed, self.w13_scales, self.w13_zeros),
                one(self.w2_packed, self.w2_scales, self.w2_zeros))


@dataclass(frozen=True)
class Mxfp4Experts:
    """Stacked MXFP4 experts (OCP MX v1.0, `quant.mxfp4`; gpt-oss's *_blocks / *_scales).

    Attributes:
        w13_blocks: [E, 2I, H/32, 16] uint8, two E2M1 codes per byte (low nibble = even
            element); w13_scales: [E, 2I, H/32] uint8 E8M0.
        w2_blocks: [E, H, I/32, 16]; w2_scales: [E, H, I/32].
    """

    w13_blocks: torch.Tensor
    w13_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor

    group_size = MXFP4_BLOCK_SIZE

    def dequantize(self, experts: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(w13 [U, 2I, H], w2 [U, H, I]) of `experts` ([U] int64) in `dtype`."""
        return (dequantize_mxfp4(self.w13_blocks[experts], self.w13_scales[experts], dtype),
                dequantize_mxfp4(self.w2_blocks[experts], self.w2_scales[experts], dtype))


def tensors_of(weights: Int4Experts | Mxfp4Experts) -> list[torch.Tensor]:
    """The tensors of a canonical layout (zero points only where present)."""
    return [t for t in (getattr(weights, f.name) for f in fields(weights)) if t is not None]


@dataclass(frozen=True, eq=False)
class BoundExperts:
    """A layer's experts bound to one backend: call it as the expert computation.

    Attributes:
        backend: "native-cpu", "torch" or "triton".
        run: the computation (`ExpertFn`).
        held: the tensors this kernel's layout holds (for `nbytes`; may be the canonical ones).
        restore: gives the canonical 4-bit layout back exactly, or None where the layout cannot
            (the torch CPU int4 layout rounds scales to bfloat16) or for float experts (their
            float parameters stay the canonical copy).
        takes_addend: the call takes ``addend=`` ([T, H] in hidden's dtype, e.g. the shared
            experts' output), added in its last launch exactly as ``out + addend`` would
            (triton float experts: `kernels.moe.sum_kernels.moe_sum`).
    """

    backend: str
    run: ExpertFn
    held: tuple[torch.Tensor, ...] = ()
    restore: Callable[[], Int4Experts | Mxfp4Experts] | None = None
    takes_addend: bool = False

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        **extras,
    ) -> torch.Tensor:
        """hidden [T, H]; topk_weights [T, k] fp32; topk_ids [T, k] int32 (ids outside
        [0, E): other ranks' experts, skipped) -> [T, H] in hidden's dtype. 4-bit kernels
        take `activation`, `b13`, `b2` here (`ExpertExtras.as_kwargs`); float ones none."""
        return self.run(hidden, topk_weights, topk_ids, **extras)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the layout holds."""
        return sum(t.numel() * t.element_size() for t in self.held)


def _check_backend(backend: str, op: str) -> None:
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; backends: {EXPERT_BACKENDS}")


def _check_cpu(backend: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise RuntimeError(f"{backend} experts need CPU weights, got weights on {t.device}")


def bind_float_experts(
    backend: str, w13: torch.Tensor, w2: torch.Tensor, extras: ExpertExtras
) -> BoundExperts:
    """Float experts (w13 [E, 2I, H], w2 [E, H, I], the layer's parameters) on `backend`.

    native-cpu packs a copy, once (the activation and biases are taken at pack time, so a
    reload needs a new bind): bfloat16 experts on a CPU that runs the AMX kernels
    (`cpu_amx.amx_fits`) in the AMX tile layout (`cpu_amx_moe.AmxExperts`, for every batch
    size, so that a token's result never depends on the batch around it), others for the
    AVX2/AVX-512 kernel (`PackedExperts.pack`: 16-column k-major tiles); torch and triton
    read `w13`/`w2` and the biases in place.

    Raises:
        ValueError: an unknown backend. RuntimeError: native-cpu with weights not on a CPU.
    """
    _check_backend(backend, "fused_moe")
    kw = extras.as_kwargs()
    if not extras.activation.gated:  # w13 [E, I, H]: the SwiGLU kernels cannot take it
        backend = TORCH
    if backend == NATIVE_CPU:
        from kernels.moe.native import PackedExperts

        _check_cpu(backend, w13)
        if cpu_amx.amx_fits(w13) and cpu_amx.amx_fits(w2):
            from kernels.moe.amx import AmxExperts

            amx = AmxExperts.pack(w13, w2, **kw)
            return BoundExperts(backend, amx, (amx.w13, amx.w2, amx.b13, amx.b2))
        packed = PackedExperts.pack(w13, w2, **kw)
        return BoundExperts(backend, packed, (packed.w13, packed.w2, packed.b13, packed.b2))
    if backend == TRITON:
        from kernels.moe.fused_moe import fused_moe

        def run(h, tw, ti, addend=None):
            return fused_moe(h, w13, w2, tw, ti, addend=addend, **kw)

        return BoundExperts(backend, run, takes_addend=True)
    if w13.device.type == "cpu":
        from kernels.moe.torch_cpu import fused_moe_cpu

        return BoundExperts(backend, lambda h, tw, ti: fused_moe_cpu(h, w13, w2, tw, ti, **kw))
    return BoundExperts(backend, lambda h, tw, ti: fused_moe_reference(h, w13, w2, tw, ti, **kw))


def bind_int4_experts(backend: str, weights: Int4Experts) -> BoundExperts:
    """Int4 experts on `backend`, from the canonical layout (which the caller may then drop
    unless it is what the kernel holds: triton, and torch off the CPU). The kernel takes the
    activation and biases per call.

    - native-cpu: `PackedQuantExperts.from_int4` (codes decoded in registers, float32
      activations and accumulation; scales kept in their 16-bit dtype).
    - torch on a CPU: per expert `pack_int4_for_cpu` for torch's packed int4 CPU matmul
      (bfloat16 activations around it; results match the dequantized weights to bfloat16
      precision). That matmul (`torch._weight_int4pack_mm_for_cpu`) is CPU-only, so torch on
      any other device dequantizes the experts that have tokens each call and runs the float
      loop: correct, and slow (use triton there).
    - triton: `fused_moe_int4` on the canonical layout (fp32/bf16/fp16 scales, zero points).

    Raises:
        ValueError: an unknown backend. RuntimeError: native-cpu with weights not on a CPU.
    """
    _check_backend(backend, "fused_moe_int4")
    if backend == NATIVE_CPU:
        from kernels.moe.native import PackedQuantExperts

        _check_cpu(backend, weights.w13_packed)
        packed = PackedQuantExperts.from_int4(*weights.per_expert())
        return BoundExperts(backend, packed, _packed_tensors(packed),
                            lambda: Int4Experts.stack(*packed.to_int4()))
    held = tuple(tensors_of(weights))
    if backend == TRITON:
        from kernels.moe.fused_moe import fused_moe_int4

        w = weights

        def run(h, tw, ti, **kw):
            return fused_moe_int4(h, w.w13_packed, w.w13_scales, w.w2_packed, w.w2_scales,
                                  tw, ti, w.w13_zeros, w.w2_zeros, **kw)

        return BoundExperts(backend, run, held, lambda: weights)
    if weights.w13_packed.device.type != "cpu":
        return BoundExperts(backend, _dequantizing(weights), held, lambda: weights)
    from kernels.moe.torch_int4 import fused_moe_int4_cpu, pack_int4_for_cpu
    from quant.packing import unpack_nibbles

    group = weights.group_size
    w13, w2 = (
        [pack_int4_for_cpu(unpack_nibbles(w.packed), w.scales, group, w.zeros) for w in ws]
        for ws in weights.per_expert()
    )
    held = tuple(t for pair in (*w13, *w2) for t in pair)
    return BoundExperts(
        backend, lambda h, tw, ti, **kw: fused_moe_int4_cpu(h, w13, w2, group, tw, ti, **kw),
        held,
    )


def bind_mxfp4_experts(backend: str, weights: Mxfp4Experts) -> BoundExperts:
    """MXFP4 experts on `backend`, from the canonical layout; the kernel takes the activation
    and biases per call.

    - native-cpu: `PackedQuantExperts.from_mxfp4` (decoded in registers, float32).
    - torch on a CPU: `fused_moe_mxfp4_cpu` (the experts with tokens dequantized by table
      lookup into a reused buffer, then the float GEMMs); on any other device the experts with
      tokens are dequantized by `quant.mxfp4.dequantize_mxfp4` and the float loop runs
      (correct, slow: use triton there).
    - triton: `fused_moe_mxfp4` on the canonical layout.

    Raises:
        ValueError: an unknown backend. RuntimeError: native-cpu with weights not on a CPU.
    """
    _check_backend(backend, "fused_moe_mxfp4")
    w = weights
    if backend == NATIVE_CPU:
        from kernels.moe.native import PackedQuantExperts

        _check_cpu(backend, w.w13_blocks)
        packed = PackedQuantExperts.from_mxfp4((w.w13_blocks, w.w13_scales),
                                               (w.w2_blocks, w.w2_scales))

        def restore() -> Mxfp4Experts:
            (b13, s13), (b2, s2) = packed.to_mxfp4()
            return Mxfp4Experts(b13, s13, b2, s2)

        return BoundExperts(backend, packed, _packed_tensors(packed), restore)
    held = tuple(tensors_of(weights))
    if backend == TRITON:
        from kernels.moe.fused_moe import fused_moe_mxfp4

        def run(h, tw, ti, **kw):
            return fused_moe_mxfp4(h, w.w13_blocks, w.w13_scales, w.w2_blocks, w.w2_scales,
                                   tw, ti, **kw)

        return BoundExperts(backend, run, held, lambda: weights)
    if w.w13_blocks.device.type != "cpu":
        return BoundExperts(backend, _dequantizing(weights), held, lambda: weights)
    from kernels.moe.torch_mxfp4 import fused_moe_mxfp4_cpu

    def run_cpu(h, tw, ti, **kw):
        return fused_moe_mxfp4_cpu(h, w.w13_blocks, w.w13_scales, w.w2_blocks, w.w2_scales,
                                   tw, ti, **kw)

    return BoundExperts(backend, run_cpu, held, lambda: weights)


def _packed_tensors(packed) -> tuple[torch.Tensor, ...]:
    return (packed.w13_codes, packed.w13_scales, packed.w13_zeros, packed.w2_codes,
            packed.w2_scales, packed.w2_zeros)


def _dequantizing(weights: Int4Experts | Mxfp4Experts) -> ExpertFn:
    """The torch path off the CPU: per call, dequantize the experts that have tokens (in the
    activations' dtype) and run `fused_moe_reference` on them, ids renumbered to those."""
    num_experts = tensors_of(weights)[0].shape[0]

    def run(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
            activation: SwiGLU = SILU_AND_MUL, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None) -> torch.Tensor:
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        used = torch.unique(ids[valid])
        slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=ids.device)
        slot_of[used] = torch.arange(used.numel(), device=ids.device)
        local = slot_of[torch.where(valid, ids, num_experts)].to(torch.int32)
        w13, w2 = weights.dequantize(used, hidden.dtype)
        b13, b2 = (None if b is None else b[used].to(hidden.dtype) for b in (b13, b2))
        return fused_moe_reference(hidden, w13, w2, topk_weights, local,
                                   activation=activation, b13=b13, b2=b2)

    return run
