"""Fused small CPU ops of the decoder layer (csrc/ops_cpu.cpp): one native call each.

torch's per-op dispatch costs about 8-10 us on the project's machine, so an RMSNorm written as
six torch ops costs more than the arithmetic it does at decode batch sizes.
"""

from __future__ import annotations

import torch

from kernels.native import check_status, dtype_flag, load_native


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension (Zhang & Sennrich 2019), statistics in float32, rounded
    as transformers' Qwen3/Mixtral `RMSNorm` (normalised value cast to x's dtype, then times the
    weight) or, with `weight_in_float32`, as gpt-oss's (product in float32, cast once).

    Args:
        x: [D], [A, D] or [A, B, D] float32 or bfloat16, last dimension contiguous (other
            strides free, e.g. the query heads sliced out of a fused QKV output).
        weight: [D], x's dtype.
        eps: added to the mean square.

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Raises:
        RuntimeError: the native ops are unavailable, or shapes/dtypes that do not fit.
    """
    lib = load_native("ops_cpu")
    if lib is None:
        raise RuntimeError("the native CPU ops are unavailable (see kernels/native.py)")
    shape, strides = x.shape, x.stride()
    nd = len(shape)
    if not 1 <= nd <= 3 or strides[-1] != 1:
        raise RuntimeError(f"x must be [D], [A, D] or [A, B, D] with a contiguous last "
                           f"dimension, got shape {tuple(shape)} strides {strides}")
    if x.dtype != weight.dtype:
        raise RuntimeError(f"weight ({weight.dtype}) must have x's dtype ({x.dtype})")
    d = shape[-1]
    if weight.numel() != d or not weight.is_contiguous():
        raise RuntimeError(f"weight must be contiguous [D] = [{d}], got {tuple(weight.shape)}")
    bf16 = dtype_flag(x, "x")
    # rows (a, b) at a * sa + b * sb elements: [D] is one row, [A, D] is A x 1
    a, sa = (shape[0], strides[0]) if nd >= 2 else (1, d)
    b, sb = (shape[1], strides[1]) if nd == 3 else (1, d)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_status(lib.moe_rms_norm(x.data_ptr(), a, b, d, sa, sb, weight.data_ptr(), eps,
                                  weight_in_float32, bf16, y.data_ptr(),
                                  torch.get_num_threads()), "rms_norm")
    return y
