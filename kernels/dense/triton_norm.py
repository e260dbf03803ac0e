"""RMSNorm in Triton, alone or fused with the residual add before it: the "rms_norm" op of the
triton backend (`KernelPlan.rms_norm`, `KernelPlan.add_rms_norm`), one launch each where the
torch path is six to eight.

RMSNorm (Zhang & Sennrich 2019) over the last dimension with the statistics in float32, rounded
as transformers' `Qwen3RMSNorm` / `MixtralRMSNorm` (the normalised value cast to x's dtype, then
times the weight in that dtype) or, with `weight_in_float32`, as `GptOssRMSNorm` (the product
in float32, cast once). The fused form is vLLM's `fused_add_rms_norm` (an independent
implementation): residual' = x + residual (rounded to the dtype, as torch's add rounds), then
the norm of residual', both written by one program per row; here into new tensors rather than
in place, so no caller's tensor changes under it.

One program per row holds the whole row (`BLOCK_D` = next power of two >= D; 8192 wide rows
take 16 warps; under the interpreter one program takes every row, as its cost is per
program). The row sum differs in order from torch's `mean`, so results match the torch path to
float32 rounding, not bit for bit. Under Triton's interpreter (tests on a CPU) bfloat16
casts truncate, so `round_to` rounds to nearest even first, as compiled code does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import interpreting, round_to

#: Row widths up to this many values take one program per row (whole row in registers).
MAX_ROW = 65536


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, num_rows, inner, dim, eps,
    stride_xa, stride_xb, stride_ra, stride_rb,
    HAS_RESIDUAL: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """BLOCK_ROWS rows, row (a, b) = divmod(row, inner): out = norm(x [+ residual]) and, with
    a residual, residual_out = x + residual; outputs are contiguous [rows, dim]."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    a = (row // inner).to(tl.int64)[:, None]
    b = (row % inner).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (row < num_rows)[:, None] & (cols < dim)
    dest = row.to(tl.int64)[:, None] * dim + cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + a * stride_ra + b * stride_rb + cols, mask=mask, other=0.0)
        z = round_to(x + r.to(tl.float32), dtype, ROUND_BF16)
        tl.store(residual_out_ptr + dest, z, mask=mask)
        x = z.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 1) / dim + eps)[:, None]
    h = x * inv_rms
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    if WEIGHT_IN_FP32:
        y = w * h
    else:
        y = w * round_to(h, dtype, ROUND_BF16).to(tl.float32)
    tl.store(out_ptr + dest, round_to(y, dtype, ROUND_BF16), mask=mask)


def _rows(x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(A, B, stride_a, stride_b) of x viewed as A x B rows of its last dimension.

    Raises:
        ValueError: more than 3 dimensions, or a last dimension that is not dense.
    """
    if not 1 <= x.dim() <= 3 or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [D], [A, D] or [A, B, D] with a dense last "
            f"dimension, got shape {tuple(x.shape)} strides {x.stride()}"
        )
    d = x.shape[-1]
    a, sa = (x.shape[0], x.stride(0)) if x.dim() >= 2 else (1, d)
    b, sb = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, d)
    return a, b, sa, sb


def _launch(
    x, residual, weight, eps, weight_in_float32, block_rows
) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, sxa, sxb = _rows(x, "x")
    d = x.shape[-1]
    if weight.numel() != d or not weight.is_contiguous() or not weight.is_floating_point():
        raise ValueError(f"weight must be a dense float [D] = [{d}], got {tuple(weight.shape)}")
    if not weight_in_float32 and weight.dtype != x.dtype:
        raise ValueError(
            f"weight ({weight.dtype}) must have x's dtype ({x.dtype}) unless weight_in_float32"
        )
    if d > MAX_ROW:
        raise ValueError(f"rows of {d} values: at most {MAX_ROW}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out, sra, srb = out, 0, 0
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must be x's {tuple(x.shape)} {x.dtype}, got "
                f"{tuple(residual.shape)} {residual.dtype}"
            )
        _, _, sra, srb = _rows(residual, "residual")
        res_out = torch.empty_like(out)
    if out.numel() == 0:
        return out, res_out
    block_d = triton.next_power_of_2(d)
    rows = a * b
    if block_rows is None:  # one row a program on a GPU; all in one under the interpreter
        block_rows = 1
        if interpreting():  # its cost is per program
            block_rows = min(triton.next_power_of_2(rows), max(1, MAX_ROW // block_d))
    rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, x if residual is None else residual, weight, out, res_out, rows, b, d, eps,
        sxa, sxb, sra, srb, HAS_RESIDUAL=residual is not None,
        WEIGHT_IN_FP32=weight_in_float32, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        ROUND_BF16=interpreting() and x.dtype == torch.bfloat16,
        num_warps=min(16, max(1, block_d // 512)),
    )  # fmt: skip
    return out, res_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool = False,
    *,
    block_rows: int | None = None,
) -> torch.Tensor:
    """RMSNorm of every row of x, one launch (the contract of `kernels.dense.ops.rms_norm`).

    Args:
        x: [D], [A, D] or [A, B, D] float32/bfloat16/float16, last dimension dense (other
            strides free, e.g. heads sliced out of a fused QKV output).
        weight: [D] dense, x's dtype (any float dtype with `weight_in_float32`).
        eps: added to the mean square.
        weight_in_float32: gpt-oss's rounding (product in float32, one cast) instead of
            Qwen3's (normalised value cast first, product in x's dtype).
        block_rows: rows per program (a power of two; tests); None: 1 on a GPU, all under
            the interpreter.

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    return _launch(x, None, weight, eps, weight_in_float32, block_rows)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_float32: bool = False,
    *,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual and RMSNorm(residual'), one launch (vLLM's
    `fused_add_rms_norm`, out of place).

    Args:
        x: a sublayer's output, [D], [A, D] or [A, B, D], last dimension dense.
        residual: the residual stream, x's shape and dtype, last dimension dense.
        weight, eps, weight_in_float32, block_rows: as `rms_norm`.

    Returns:
        (normed, residual'): new contiguous tensors of x's shape and dtype; residual' is
        bit-identical to torch's `x + residual`.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    return _launch(x, residual, weight, eps, weight_in_float32, block_rows)
