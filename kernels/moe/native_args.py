"""Argument checks of the native fused-MoE calls (csrc/moe_engine_cpu.h `moe_fused_moe`,
`moe_fused_moe_q4`): the C kernels take raw pointers and trust them, so every shape, dtype and
layout they rely on is checked here first, each failure a RuntimeError naming the argument.

Packed weights are checked once per `PackedExperts` / `PackedQuantExperts` (they are frozen);
the routing arguments on every call, with as few tensor operations as possible (a decode step
makes one call per MoE layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.native.library import dtype_flag

#: Output columns per packed tile (csrc/gemm_avx2.h kTile).
TILE = 16


class RouteArgs(NamedTuple):
    """The per-call arguments: hidden [T, H] contiguous (`hidden_bf16`: 0 float32, 1
    bfloat16), topk_weights [T, k] float32 and topk_ids [T, k] int32/int64 (`ids_int64`),
    contiguous."""

    hidden: torch.Tensor
    hidden_bf16: int
    weights: torch.Tensor
    ids: torch.Tensor
    ids_int64: int
    k: int


def route_args(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               hidden_size: int) -> RouteArgs:
    """Check and convert (only when needed) the routing arguments of a native MoE call whose
    experts have `hidden_size` columns.

    Raises:
        RuntimeError: hidden not [T, hidden_size] float32/bfloat16, or topk tensors not
            [T, k] alike.
    """
    if hidden.dim() != 2:
        raise RuntimeError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    if hidden.shape[1] != hidden_size:
        raise RuntimeError(f"hidden [T, {hidden.shape[1]}] does not match the experts' "
                           f"hidden size {hidden_size}")
    hidden_bf16 = dtype_flag(hidden, "hidden")
    shape = topk_ids.shape
    if len(shape) != 2 or shape[0] != hidden.shape[0]:
        raise RuntimeError(f"topk_ids must be [T, k] = [{hidden.shape[0]}, k], got "
                           f"{tuple(shape)}")
    if topk_weights.shape != shape:
        raise RuntimeError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                           f"{tuple(shape)}")
    if topk_ids.dtype == torch.int32:
        ids_int64 = 0
    else:
        ids_int64 = 1
        if topk_ids.dtype != torch.int64:
            topk_ids = topk_ids.long()
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    return RouteArgs(hidden.contiguous(), hidden_bf16, topk_weights.contiguous(),
                     topk_ids.contiguous(), ids_int64, shape[1])


def bias_pointers(b13: torch.Tensor | None, b2: torch.Tensor | None, e: int, h: int,
                  i: int) -> tuple[int | None, int | None]:
    """The kernel's bias pointers: b13 [E, 2I] and b2 [E, H] float32 contiguous, or (None,
    None) when either is None or both are empty.

    Raises:
        RuntimeError: biases of another dtype, layout or size.
    """
    if b13 is None or b2 is None or (not b13.numel() and not b2.numel()):
        return None, None
    if (b13.dtype != torch.float32 or b2.dtype != torch.float32 or not b13.is_contiguous()
            or not b2.is_contiguous()):
        raise RuntimeError("biases must be contiguous float32")
    if b13.numel() != e * 2 * i or b2.numel() != e * h:
        raise RuntimeError(f"biases must be b13 [E, 2I] = [{e}, {2 * i}] and b2 [E, H] = "
                           f"[{e}, {h}], got {tuple(b13.shape)} and {tuple(b2.shape)}")
    return b13.data_ptr(), b2.data_ptr()


class DenseWeightArgs(NamedTuple):
    """Checked packed float32/bfloat16 experts: pointers, dtype flag and sizes."""

    w13: int
    w2: int
    w_bf16: int
    experts: int
    hidden: int
    intermediate: int
    padded_intermediate: int
    padded_hidden: int
    b13: int | None
    b2: int | None


def dense_weight_args(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor,
                      b2: torch.Tensor, intermediate: int) -> DenseWeightArgs:
    """Check `PackedExperts` tensors: w13 [E, 2, Ip/16, H, 16], w2 [E, Hp/16, I, 16], one
    dtype (float32 or bfloat16), contiguous; biases as `bias_pointers`.

    Raises:
        RuntimeError: a shape, dtype or layout the kernel does not take.
    """
    if w13.dim() != 5 or w13.shape[1] != 2 or w13.shape[4] != TILE or not w13.is_contiguous():
        raise RuntimeError(f"w13 must be packed [E, 2, Ip/16, H, 16], got {tuple(w13.shape)}")
    if w2.dim() != 4 or w2.shape[3] != TILE or not w2.is_contiguous():
        raise RuntimeError(f"w2 must be packed [E, Hp/16, I, 16], got {tuple(w2.shape)}")
    if w13.dtype != w2.dtype:
        raise RuntimeError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must share a dtype")
    w_bf16 = dtype_flag(w13, "weights")
    e, h, i = w13.shape[0], w13.shape[3], intermediate
    ip, hp = w13.shape[2] * TILE, w2.shape[1] * TILE
    if w2.shape[0] != e or w2.shape[2] != i or not (h <= hp < h + TILE and i <= ip < i + TILE):
        raise RuntimeError(f"packed weight shapes w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                           f"do not fit together with intermediate {i}")
    pb13, pb2 = bias_pointers(b13, b2, e, h, i)
    return DenseWeightArgs(w13.data_ptr(), w2.data_ptr(), w_bf16, e, h, i, ip, hp, pb13, pb2)


#: The kernel's `format` for int4 scales of each dtype (csrc/moe_cpu.cpp `Q4`; 0 is MXFP4).
INT4_SCALE_FORMATS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class Q4WeightArgs(NamedTuple):
    """Checked packed 4-bit experts: the six pointers (zero points None when symmetric or
    MXFP4), the format (0 MXFP4; int4 with float32, bfloat16 or float16 scales: 1, 2, 3,
    `INT4_SCALE_FORMATS`) and sizes."""

    pointers: tuple[int | None, ...]
    format: int
    group_size: int
    experts: int
    hidden: int
    intermediate: int
    padded_intermediate: int
    padded_hidden: int


def q4_weight_args(method: str, codes13: torch.Tensor, scales13: torch.Tensor,
                   zeros13: torch.Tensor, codes2: torch.Tensor, scales2: torch.Tensor,
                   zeros2: torch.Tensor, h: int, i: int, g: int) -> Q4WeightArgs:
    """Check `PackedQuantExperts` tensors (layouts in its docstring) for hidden size `h`,
    intermediate size `i` and group size `g`.

    Raises:
        RuntimeError: a method, group size, shape, dtype or layout the kernel does not take.
    """
    if method not in ("mxfp4", "int4"):
        raise RuntimeError(f"method must be mxfp4 or int4, got {method!r}")
    mxfp4 = method == "mxfp4"
    if g < 2 or g % 2 or h % g or i % g or (mxfp4 and g != 32):
        raise RuntimeError(f"group size {g} must be even and divide H = {h} and I = {i} "
                           "(MXFP4: 32)")
    c13, c2 = codes13, codes2
    if (c13.dim() != 5 or c13.shape[1] != 2 or c13.shape[3] * 2 != h or c13.shape[4] != TILE
            or c13.dtype != torch.uint8 or not c13.is_contiguous()):
        raise RuntimeError(f"codes13 must be uint8 [E, 2, Ip/16, H/2, 16], got {c13.dtype} "
                           f"{tuple(c13.shape)}")
    e, ip = c13.shape[0], c13.shape[2] * TILE
    if (c2.dim() != 4 or c2.shape[0] != e or c2.shape[2] * 2 != i or c2.shape[3] != TILE
            or c2.dtype != torch.uint8 or not c2.is_contiguous()):
        raise RuntimeError(f"codes2 must be uint8 [E, Hp/16, I/2, 16], got {c2.dtype} "
                           f"{tuple(c2.shape)}")
    hp = c2.shape[1] * TILE
    if not (i <= ip < i + TILE and h <= hp < h + TILE):
        raise RuntimeError("packed tiles do not match hidden [T, H] and intermediate")
    s13, s2 = scales13, scales2
    ok_dtype = s13.dtype == torch.uint8 if mxfp4 else s13.dtype in INT4_SCALE_FORMATS
    if (not ok_dtype or s2.dtype != s13.dtype or not s13.is_contiguous()
            or not s2.is_contiguous()):
        raise RuntimeError("scales must be contiguous and of one dtype (MXFP4: uint8 E8M0, "
                           f"int4: float32, bfloat16 or float16), got {s13.dtype}, {s2.dtype}")
    if (s13.numel() != e * 2 * (ip // TILE) * (h // g) * TILE
            or s2.numel() != e * (hp // TILE) * (i // g) * TILE):
        raise RuntimeError("scales must be [E, 2, Ip/16, H/G, 16] and [E, Hp/16, I/G, 16]")
    asym = zeros13.numel() > 0
    if mxfp4 and asym:
        raise RuntimeError("MXFP4 has no zero points")
    if asym and (zeros13.dtype != torch.uint8 or zeros2.dtype != torch.uint8
                 or not zeros13.is_contiguous() or not zeros2.is_contiguous()
                 or zeros13.numel() != s13.numel() or zeros2.numel() != s2.numel()):
        raise RuntimeError("zero points must be uint8 shaped like the scales")
    pointers = (c13.data_ptr(), s13.data_ptr(), zeros13.data_ptr() if asym else None,
                c2.data_ptr(), s2.data_ptr(), zeros2.data_ptr() if asym else None)
    fmt = 0 if mxfp4 else INT4_SCALE_FORMATS[s13.dtype]
    return Q4WeightArgs(pointers, fmt, g, e, h, i, ip, hp)
