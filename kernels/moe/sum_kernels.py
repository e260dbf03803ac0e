"""`moe_sum`: the fused MoE's tail, the k weighted expert rows of each token summed, one launch.

GEMM2 of `kernels.moe.fused_moe` writes each token-expert pair's weighted down projection into
an uninitialised ``[T, k, H]`` buffer (rows of dropped pairs are never written); this kernel
reads the k rows of a token in fp32, skips the dropped ones (ids outside ``[0, E)``), adds
them in slot order (deterministic) and writes ``[T, H]`` in the hidden dtype: vLLM's `moe_sum`
with the dropped-pair mask, where the torch tail took a zeroed buffer, an fp32 copy, a sum and
a cast. The plain torch version is ``x.masked_fill(dropped, 0).float().sum(1).to(dtype)``.

An optional addend (the shared experts' output of the same tokens) is added in the same launch
as torch adds two tensors of the dtype: the fp32 sum is rounded to the dtype first, then the sum
and the addend are added in fp32 and rounded again, so ``moe_sum(x, ids, E, addend)`` equals
``moe_sum(x, ids, E) + addend`` bit for bit (the torch path's order: combine, then the add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_H = 512


@triton.jit
def round_bf16_bits(x):
    """fp32 ``x`` rounded to the nearest-even bfloat16 value, still fp32 (finite x). Triton's
    interpreter truncates fp32 -> bf16 casts where compiled Triton rounds; a cast of the
    result is exact in both."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def moe_sum_kernel(
    x_ptr, topk_ids_ptr, addend_ptr, out_ptr, hidden_size, num_experts,
    stride_xt, stride_xk, stride_it, stride_ik, stride_at, stride_ot,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
):  # fmt: skip
    """Program (token t, column block): ``out[t, cols] = sum_j x[t, j, cols]`` over kept j
    (``+ addend[t, cols]`` after rounding the sum to the dtype, with ``HAS_ADDEND``)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + t * stride_it + j * stride_ik)
        kept = (expert >= 0) & (expert < num_experts)
        take = in_row & (tl.zeros([BLOCK_H], dtype=tl.int32) + kept.to(tl.int32) != 0)
        row = tl.load(x_ptr + t * stride_xt + j * stride_xk + cols, mask=take, other=0.0)
        acc += row.to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16_bits(acc)
    if HAS_ADDEND:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # exact after the rounding
        acc += tl.load(addend_ptr + t * stride_at + cols, mask=in_row, other=0.0).to(tl.float32)
        if ROUND_BF16:
            acc = round_bf16_bits(acc)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def moe_sum(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum each token's k expert rows in fp32, dropped pairs skipped (plus `addend`): one launch.

    Args:
        x: ``[T, k, H]`` bf16, fp16 or fp32 (the last dimension contiguous): row ``(t, j)`` is
            the weighted expert output of pair ``t * k + j``; rows of dropped pairs may hold
            anything (they are never read).
        topk_ids: ``[T, k]`` integer expert ids; ids outside ``[0, num_experts)`` are dropped.
        num_experts: ``E``, experts of this rank.
        addend: optional ``[T, H]`` in x's dtype (last dimension contiguous), added after the
            sum is rounded: the result equals ``moe_sum(x, topk_ids, E) + addend`` exactly.

    Returns:
        ``[T, H]`` in ``x``'s dtype (fp32 sums rounded once to nearest; with an addend, the
        rounded sum plus the addend rounded once more).

    Raises:
        ValueError: shapes or dtypes that disagree or a non-contiguous last dimension.
    """
    num_tokens, top_k, hidden_size = x.shape
    if tuple(topk_ids.shape) != (num_tokens, top_k) or x.stride(2) != 1:
        raise ValueError(
            f"x {tuple(x.shape)} (last stride {x.stride(2)}) and topk_ids "
            f"{tuple(topk_ids.shape)} must be [T, k, H] (contiguous rows) and [T, k]"
        )
    if addend is not None and (
        tuple(addend.shape) != (num_tokens, hidden_size)
        or addend.dtype != x.dtype
        or addend.stride(1) != 1
    ):
        raise ValueError(
            f"addend {tuple(addend.shape)} {addend.dtype} (strides {addend.stride()}) must be "
            f"[{num_tokens}, {hidden_size}] {x.dtype} with contiguous rows"
        )
    out = torch.empty(num_tokens, hidden_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(hidden_size))
    grid = (num_tokens, triton.cdiv(hidden_size, block_h))
    has_addend = addend is not None
    moe_sum_kernel[grid](
        x, topk_ids, addend if has_addend else out, out, hidden_size, num_experts,
        x.stride(0), x.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        addend.stride(0) if has_addend else 0, out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h,
        ROUND_BF16=x.dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret),
        HAS_ADDEND=has_addend, num_warps=4,
    )  # fmt: skip
    return out
