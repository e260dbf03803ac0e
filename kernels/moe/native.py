"""The native CPU expert path: packed expert weights and the C++ fused MoE (csrc/moe_cpu.cpp).

`PackedExperts.pack` lays each expert's projections out as tiles of 16 output columns stored
k-major (the micro-kernels' order; see csrc/moe_cpu.cpp), once at load time; `__call__` runs
routing-sorted gate/up GEMMs, the SwiGLU, the down GEMM and the weighted sum in one native call,
with the same contract and result (within float32 rounding) as `kernels.moe.reference
.fused_moe_reference`.

Float32 weights whose values are all bfloat16-representable (a bfloat16 checkpoint computed in
float32 on a CPU without native bfloat16, `moe_engine.startup.env.compute_dtype`) are packed as
bfloat16: exactly the same values, half the bytes each decode step reads.

4-bit experts (`PackedQuantExperts`: MXFP4, OCP Microscaling Formats (MX) Specification v1.0;
group-wise int4, `quant.int4`) keep their codes, 4 bits per weight, in the same 16-column
k-major tiles with a nibble order made for the decoder (`pack_q4_tiles`), and are dequantized
in registers, activations and accumulation float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.dense.amx import bf16_backend
from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.native_args import (
    INT4_SCALE_FORMATS,
    DenseWeightArgs,
    Q4WeightArgs,
    bias_pointers,
    dense_weight_args,
    q4_weight_args,
    route_args,
)
from kernels.moe.tiles import (  # noqa: F401 - TILE, Q4_*, (un)pack_* re-exported
    Q4_HIGH_COLUMNS,
    Q4_LOW_COLUMNS,
    TILE,
    gate_up_expert_tiles,
    gate_up_rows,
    pack_q4_tiles,
    pack_tiles,
    q4_expert_tiles,
    repack_library,
    unpack_q4_tiles,
    unpack_tiles,
    value_expert_tiles,
)
from kernels.native.library import check_status, load_native
from quant.int4 import SYMMETRIC_ZERO, Int4Weight
from quant.mxfp4 import MXFP4_BLOCK_SIZE
from quant.packing import pack_nibbles

#: The 4-bit experts' format bit for VDPBF16PS products on bfloat16 hidden rows (csrc/moe_cpu.cpp
#: `kDotFlag`, `RowDot`: products exact, float32 sums, the intermediate rounded once to bfloat16
#: as the bf16 experts round it, a token's result independent of its batch);
#: the kernel ignores it for float32 inputs, zero points, group sizes not a multiple of 16 and
#: the AVX2 build.
DOT_FLAG = 16


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of float32 `w` is a bfloat16 value (so packing it as bfloat16 is
    lossless)."""
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


@dataclass(frozen=True, eq=False)
class PackedExperts:
    """One layer's experts in the native kernel's layout (frozen: the kernel's pointers to
    these tensors are checked and taken once).

    Attributes:
        w13: [E, 2, ceil(I/16), H, 16] gate tiles then up tiles, float32 or bfloat16.
        w2: [E, ceil(H/16), I, 16], same dtype.
        b13: [E, 2I] float32 gate/up bias (gate, then up), or an empty tensor.
        b2: [E, H] float32 down bias, or an empty tensor.
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
        pb13, pb2 = bias_args(b13, b2)
        return cls(gate_up.contiguous(), pack_tiles(w2), pb13.clone(), pb2.clone(), i, h,
                   activation)

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
        lib = _moe_library()
        w = self.weight_args
        r = route_args(hidden, topk_weights, topk_ids, w.hidden)
        act = self.activation
        out = torch.empty_like(r.hidden)
        check_status(lib.moe_fused_moe(
            r.hidden.data_ptr(), r.hidden_bf16, r.hidden.shape[0], w.hidden, w.w13, w.w2,
            w.w_bf16, w.experts, w.intermediate, w.padded_intermediate, w.padded_hidden,
            r.weights.data_ptr(), r.ids.data_ptr(), r.ids_int64, r.k, w.b13, w.b2, act.clamped,
            float(act.alpha or 0.0), act.limit is not None, float(act.limit or 0.0),
            out.data_ptr(), torch.get_num_threads()), "fused_moe")
        return out

    @cached_property
    def weight_args(self) -> DenseWeightArgs:
        return dense_weight_args(self.w13, self.w2, self.b13, self.b2, self.intermediate)


def _moe_library():
    lib = load_native("moe_cpu")
    if lib is None:
        raise RuntimeError("the native MoE kernel is unavailable (see kernels/native/library.py)")
    return lib


def bias_args(
    b13: torch.Tensor | None, b2: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernels' bias arguments: `b13` [E, 2I] and `b2` [E, H] as contiguous float32
    (no copy when they are already), or two empty tensors when either is None."""
    if b13 is None or b2 is None:
        return _EMPTY, _EMPTY
    return b13.detach().float().contiguous(), b2.detach().float().contiguous()


_EMPTY = torch.empty(0, dtype=torch.float32)


@dataclass(frozen=True, eq=False)
class PackedQuantExperts:
    """One layer's 4-bit experts in the native kernel's layout (csrc/moe_cpu.cpp); frozen, as
    `PackedExperts`.

    Codes are `pack_q4_tiles` tiles; scales (and zero points) are `pack_tiles` tiles of the
    per-(row, block) values, so tile t, block g holds the 16 columns' values contiguously.

    - "mxfp4": OCP Microscaling Formats (MX) Specification v1.0: E2M1 codes, blocks of 32
      values along the input dimension with one E8M0 scale byte each (kept as bytes).
    - "int4": `quant.int4` group-wise codes u with float scales and zero points z (8 when
      symmetric): w = (u - z) * scale; scales are kept in their own dtype when it is float32,
      bfloat16 or float16 (a checkpoint's 16-bit scales: 4 + 16 / G bits per weight), and
      widened to float32 in registers only.

    Attributes:
        method: "mxfp4" or "int4".
        w13_codes: [E, 2, ceil(I/16), H/2, 16] uint8 (gate tiles, then up tiles).
        w13_scales: [E, 2, ceil(I/16), H/G, 16]: uint8 E8M0 (mxfp4), or `scale_dtype` (int4).
        w13_zeros: int4 asymmetric: uint8 zero points shaped like `w13_scales`; else empty.
        w2_codes: [E, ceil(H/16), I/2, 16] uint8; w2_scales, w2_zeros: [E, ceil(H/16), I/G, 16].
        intermediate: I; hidden: H; group_size: G (32 for mxfp4).
        scale_dtype: the dtype the int4 scales arrived in (`to_int4` gives it back); they are
            stored in it, or in float32 when it is none of float32, bfloat16, float16.
    """

    method: str
    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor
    intermediate: int
    hidden: int
    group_size: int
    scale_dtype: torch.dtype = torch.float32

    @classmethod
    def from_mxfp4(
        cls, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor], *,
        native: bool | None = None,
    ) -> PackedQuantExperts:
        """Pack MXFP4 experts as `quant.mxfp4` lays them out (gpt-oss `*_blocks`/`*_scales`),
        in one native pass over the blocks (`kernels.moe.tiles`); the torch reference builds
        the same bytes where the native library is unavailable.

        Args:
            w13: (blocks [E, 2I, H/32, 16], scales [E, 2I, H/32]) uint8, gate rows then up
                rows; a byte holds element 2j in its low nibble, 2j + 1 in its high nibble.
            w2: (blocks [E, H, I/32, 16], scales [E, H, I/32]) uint8.
            native: True the native repack, False the torch reference, None (default) the
                native one where the library loads.

        Raises:
            ValueError: dtypes or shapes that do not fit together.
            RuntimeError: `native=True` where the native library is unavailable.
        """
        (b13, s13), (b2, s2) = w13, w2
        half = MXFP4_BLOCK_SIZE // 2
        ok = all(t.dtype == torch.uint8 for t in (b13, s13, b2, s2))
        ok = ok and b13.dim() == 4 and b2.dim() == 4 and b13.shape[-1] == b2.shape[-1] == half
        if ok:
            e, two_i, h_blocks, _ = b13.shape
            h, i = h_blocks * MXFP4_BLOCK_SIZE, two_i // 2
            ok = (two_i % 2 == 0 and tuple(b2.shape) == (e, h, i // MXFP4_BLOCK_SIZE, half)
                  and i % MXFP4_BLOCK_SIZE == 0 and s13.shape == b13.shape[:-1]
                  and s2.shape == b2.shape[:-1])
        if not ok:
            raise ValueError(
                "mxfp4 experts: need uint8 w13 blocks [E, 2I, H/32, 16], scales [E, 2I, H/32], "
                "w2 blocks [E, H, I/32, 16], scales [E, H, I/32]; got "
                + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in (b13, s13, b2, s2)))
        lib = repack_library() if native is not False else None
        if native and lib is None:
            raise RuntimeError("the native repack is unavailable (kernels/native/library.py)")
        rows13 = b13.contiguous().view(e, two_i, h // 2).unbind(0)
        rows2 = b2.contiguous().view(e, h, i // 2).unbind(0)
        empty = torch.empty(0, dtype=torch.uint8)
        return cls(
            "mxfp4", gate_up_expert_tiles(rows13, q4_expert_tiles, lib),
            gate_up_expert_tiles(s13.unbind(0), value_expert_tiles, lib), empty,
            q4_expert_tiles(rows2, lib), value_expert_tiles(s2.unbind(0), lib), empty, i, h,
            MXFP4_BLOCK_SIZE,
        )

    @classmethod
    def from_int4(cls, w13: list[Int4Weight], w2: list[Int4Weight], *,
                  native: bool | None = None) -> PackedQuantExperts:
        """Pack int4 experts (`quant.int4` representation, one `Int4Weight` per expert), each
        expert's rows read in place by the native repack (`kernels.moe.tiles`; the torch
        reference where the library is unavailable, the same bytes).

        Args:
            w13: per expert, packed [2I, H/2] (gate rows then up rows), scales [2I, H/G],
                zeros [2I, H/G] uint8 or None (symmetric: zero point 8).
            w2: per expert, packed [H, I/2], scales [H, I/G], zeros or None.
            native: as `from_mxfp4`.

        Raises:
            ValueError: no experts, lists of different lengths, shapes or group sizes that
                differ, or a group size that is odd.
            RuntimeError: `native=True` where the native library is unavailable.
        """
        if not w13 or len(w13) != len(w2):
            raise ValueError(f"int4 experts: {len(w13)} w13 and {len(w2)} w2 weights")
        sizes = {w.group_size for w in (*w13, *w2)}
        shapes13 = {tuple(w.packed.shape) for w in w13}
        shapes2 = {tuple(w.packed.shape) for w in w2}
        if len(sizes) != 1 or len(shapes13) != 1 or len(shapes2) != 1:
            raise ValueError(f"int4 experts: group sizes {sorted(sizes)}, w13 shapes "
                             f"{sorted(shapes13)}, w2 shapes {sorted(shapes2)}: need one each")
        (group,), ((two_i, half_h),), ((h, half_i),) = sizes, shapes13, shapes2
        i = two_i // 2
        if group % 2 or two_i % 2 or h != 2 * half_h or i != 2 * half_i:
            raise ValueError(f"int4 experts: w13 packed {(two_i, half_h)} and w2 packed "
                             f"{(h, half_i)} (group size {group}) do not chain")
        scale_dtype = w13[0].scales.dtype
        stored_dtype = scale_dtype if scale_dtype in INT4_SCALE_FORMATS else torch.float32
        asym = any(w.zeros is not None for w in (*w13, *w2))

        lib = repack_library() if native is not False else None
        if native and lib is None:
            raise RuntimeError("the native repack is unavailable (kernels/native/library.py)")

        def zeros(w: Int4Weight) -> torch.Tensor:
            if w.zeros is not None:
                return w.zeros
            return torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8)

        def tiles(ws: list[Int4Weight], gate_up: bool) -> tuple[torch.Tensor, ...]:
            def pack(rows: list[torch.Tensor], kind) -> torch.Tensor:
                return gate_up_expert_tiles(rows, kind, lib) if gate_up else kind(rows, lib)

            scales = [w.scales.to(stored_dtype) for w in ws]
            return (pack([w.packed for w in ws], q4_expert_tiles),
                    pack(scales, value_expert_tiles),
                    pack([zeros(w) for w in ws], value_expert_tiles) if asym else empty)

        empty = torch.empty(0, dtype=torch.uint8)
        c13, s13, z13 = tiles(w13, gate_up=True)
        c2, s2, z2 = tiles(w2, gate_up=False)
        return cls("int4", c13, s13, z13, c2, s2, z2, i, h, group, scale_dtype)

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked codes: w13 [E, 2I, H], w2 [E, H, I] uint8."""
        i, h = self.intermediate, self.hidden
        return (gate_up_rows(self.w13_codes, i, unpack_q4_tiles),
                unpack_q4_tiles(self.w2_codes, h))

    def _per_block(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked scales or zero points: w13 [E, 2I, H/G], w2 [E, H, I/G]."""
        return (gate_up_rows(w13, self.intermediate, unpack_tiles),
                unpack_tiles(w2, self.hidden))

    def to_mxfp4(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The `from_mxfp4` arguments back, bit for bit: ((blocks, scales) of w13, of w2).

        Raises:
            ValueError: these are int4 experts.
        """
        if self.method != "mxfp4":
            raise ValueError(f"to_mxfp4 on {self.method} experts")
        out = []
        for codes, scales in zip(self._codes(), self._per_block(self.w13_scales, self.w2_scales),
                                 strict=True):
            e, n, k = codes.shape
            blocks = pack_nibbles(codes.contiguous()).reshape(e, n, k // MXFP4_BLOCK_SIZE, -1)
            out.append((blocks, scales.contiguous()))
        return out[0], out[1]

    def to_int4(self) -> tuple[list[Int4Weight], list[Int4Weight]]:
        """The `from_int4` arguments back, per expert: (w13 weights, w2 weights); scales in
        their original dtype, zero points None when the experts were symmetric (exact).

        Raises:
            ValueError: these are MXFP4 experts.
        """
        if self.method != "int4":
            raise ValueError(f"to_int4 on {self.method} experts")
        scales = self._per_block(self.w13_scales, self.w2_scales)
        zeros = (self._per_block(self.w13_zeros, self.w2_zeros) if self.w13_zeros.numel()
                 else (None, None))
        out = []
        for codes, s, z in zip(self._codes(), scales, zeros, strict=True):
            packed = pack_nibbles(codes.contiguous())
            s = s.to(self.scale_dtype)
            out.append([Int4Weight(packed[e], s[e].contiguous(),
                                   None if z is None else z[e].contiguous())
                        for e in range(len(packed))])
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (
            self.w13_codes, self.w13_scales, self.w13_zeros, self.w2_codes, self.w2_scales,
            self.w2_zeros))

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        activation: SwiGLU = SILU_AND_MUL,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mixture of SwiGLU experts on the 4-bit weights, dequantized in registers; the result
        of `kernels.moe.reference.fused_moe_reference` on the dequantized weights (exactly those
        values: E2M1 * 2^(s - 127), (u - z) * scale) within float32 rounding.

        Args:
            hidden: [T, H] float32 or bfloat16 (computed in float32).
            topk_weights: [T, k] float32; topk_ids: [T, k] int32/int64, ids outside [0, E)
                skipped (other ranks' experts).
            activation: plain SwiGLU or gpt-oss's clamped one.
            b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias.

        Returns:
            [T, H] in hidden's dtype (zero rows for tokens with no pair here).

        Raises:
            RuntimeError: the native kernel is unavailable, or shapes do not match.
        """
        lib = _moe_library()
        w = self.weight_args
        r = route_args(hidden, topk_weights, topk_ids, w.hidden)
        fb13, fb2 = bias_args(b13, b2)  # kept alive through the call
        pb13, pb2 = bias_pointers(fb13, fb2, w.experts, w.hidden, w.intermediate)
        out = torch.empty_like(r.hidden)
        check_status(lib.moe_fused_moe_q4(
            r.hidden.data_ptr(), r.hidden_bf16, r.hidden.shape[0], w.hidden, *w.pointers,
            w.format, w.group_size, w.experts, w.intermediate, w.padded_intermediate,
            w.padded_hidden, r.weights.data_ptr(), r.ids.data_ptr(), r.ids_int64, r.k, pb13, pb2,
            activation.clamped, float(activation.alpha or 0.0), activation.limit is not None,
            float(activation.limit or 0.0), out.data_ptr(), torch.get_num_threads()),
            "fused_moe_q4")
        return out

    @cached_property
    def weight_args(self) -> Q4WeightArgs:
        """The checked pointers and sizes (`q4_weight_args`), the format with `DOT_FLAG` where
        this process's bfloat16 kernels run (`kernels.dense.amx.bf16_backend`, decided and
        logged once): a bfloat16 call's products then run on VDPBF16PS (`DOT_FLAG`)."""
        args = q4_weight_args(self.method, self.w13_codes, self.w13_scales, self.w13_zeros,
                              self.w2_codes, self.w2_scales, self.w2_zeros, self.hidden,
                              self.intermediate, self.group_size)
        if bf16_backend() is not None:
            args = args._replace(format=args.format | DOT_FLAG)
        return args
