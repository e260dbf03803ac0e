"""`silu_and_mul` in Triton: SwiGLU's activation of a merged gate/up projection, one launch.

``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]`` (vLLM's `silu_and_mul`, an independent
implementation), rounded as the torch path ``F.silu(gate) * up`` rounds in x's dtype: silu in
float32 (``g / (1 + exp(-g))``, IEEE division and libdevice's ``expf``, as torch's CUDA kernel
computes it), rounded to the dtype, then the product in float32 (exact for bf16/fp16 factors)
rounded once more. Under Triton's interpreter (tests on a CPU) bfloat16 casts truncate, so
`round_to` rounds to nearest even first, as compiled code does.

The layer that uses it: `moe_engine.models.layers.shared_experts.SharedExperts` (handed out by
`kernels.plan.KernelPlan.silu_and_mul`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.triton_common import round_to

#: Columns per program.
BLOCK_SIZE_N = 1024


@triton.jit
def silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_xt, stride_ot,
    BLOCK_SIZE_N: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Program (token t, column block): out[t, cols] = silu(x[t, cols]) * x[t, I + cols]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:  # the interpreter has no libdevice; numpy's exp stands in
        exp = tl.exp(-gate)
    else:
        exp = libdevice.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp)
    silu = round_to(silu, dtype, ROUND_BF16).to(tl.float32)
    out = round_to(silu * up, dtype, ROUND_BF16)
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a merged projection, one launch.

    Args:
        x: ``[T, 2I]`` bf16, fp16 or fp32, gate columns then up columns (last dimension
            contiguous).

    Returns:
        ``[T, I]`` contiguous, x's dtype: equal to ``F.silu(x[:, :I]) * x[:, I:]`` (see the
        module docstring for the rounding).

    Raises:
        ValueError: x not 2-D, an odd width or a non-contiguous last dimension.
    """
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul takes x [T, 2I] with contiguous rows, got {tuple(x.shape)} "
            f"(strides {x.stride()})"
        )
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_n = min(BLOCK_SIZE_N, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block_n))
    interpret = bool(triton.knobs.runtime.interpret)
    silu_and_mul_kernel[grid](
        x, out, inter, x.stride(0), out.stride(0), BLOCK_SIZE_N=block_n,
        ROUND_BF16=x.dtype == torch.bfloat16 and interpret, INTERPRET=interpret,
    )  # fmt: skip
    return out
