"""The CPU expert path for MXFP4 weights: dequantize only the experts that have tokens, then GEMM.

This is the torch backend (`--kernel-backend fused_moe_mxfp4=torch`, or no native build):
where the native kernel
builds, `QuantizedExperts` runs `kernels.moe.native.PackedQuantExperts` instead, which decodes
the codes in registers without materialising the weights.

Triton does not run compiled on a CPU and PyTorch has no MXFP4 matmul, so each step the experts
that received tokens are dequantized into a reused workspace, in the compute dtype, and the
float path (`kernels.moe.torch_cpu.fused_moe_cpu`: batched or per-expert GEMMs) runs on those
experts only,
with the routing ids renumbered to them. Experts without tokens cost nothing.

The decode is one table lookup per packed byte. The table is indexed by ``scale_byte << 8 |
packed_byte`` (65,536 entries) and holds both values of the byte (low nibble = even element,
OCP MX v1.0 / gpt-oss order, `quant.mxfp4`), already multiplied by the block's E8M0 scale in
fp32 and cast to the compute dtype, so a lookup is exactly `quant.mxfp4.dequantize_mxfp4`'s
value. The pair is stored as one element of twice the width (two fp32 in an int64), so a single
`torch.index_select` writes the dequantized weights. Measured on the bench-qwen3-moe expert shape
(w13 [1024, 512], 2 AVX2 cores): 0.3 ms per expert, against 0.7-0.8 ms for a 256-entry byte table
followed by a broadcast scale multiply, and 3 ms for `dequantize_mxfp4` (unpack, 16-entry lookup,
multiply, fresh allocations). Buffers are reused: fresh multi-megabyte allocations each step cost
page faults comparable to the decode itself.

This is still a materialising path: per expert it writes (and the GEMM reads back) the dense
weights, so at decode sizes it is slower than a GEMM straight from 4-bit weights would be.
"""

from __future__ import annotations

import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.torch_cpu import fused_moe_cpu
from quant.mxfp4 import E2M1_VALUES, MXFP4_BLOCK_SIZE, e8m0_to_float

#: The float dtype whose width is two elements of the compute dtype (one table entry).
_PAIR_DTYPE = {
    torch.float32: torch.int64,
    torch.bfloat16: torch.int32,
    torch.float16: torch.int32,
    torch.float64: torch.complex128,
}
#: Default bound on the workspace (dequantized weights + lookup indices); more experts than fit
#: are processed in chunks.
DEFAULT_WORKSPACE_BYTES = 64 * 2**20

_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def mxfp4_pair_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The lookup table: entry ``s * 256 + b`` holds the two values of packed byte ``b`` under
    E8M0 scale byte ``s``.

    Args:
        dtype: compute dtype, one of float32, bfloat16, float16, float64.
        device: where the table lives.

    Returns:
        ``[65536]`` tensor of the pair dtype (``int64`` for float32, ``int32`` for 16-bit
        floats, ``complex128`` for float64) whose ``.view(dtype)`` is ``[65536 * 2]``:
        ``E2M1(b & 15) * 2^(s - 127)`` then ``E2M1(b >> 4) * 2^(s - 127)``, each product in
        fp32 then cast to ``dtype`` (scale byte 255: NaN). Cached per dtype and device.

    Raises:
        ValueError: an unsupported dtype.
    """
    if dtype not in _PAIR_DTYPE:
        raise ValueError(f"mxfp4 CPU path: compute dtype {dtype} is not one of {list(_PAIR_DTYPE)}")
    key = (dtype, torch.device(device))
    if key not in _TABLES:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        pair = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)  # [256, 2]
        scales = e8m0_to_float(torch.arange(256, dtype=torch.uint8))  # [256]
        table = (scales[:, None, None] * pair[None]).to(dtype)  # [256 s, 256 b, 2]
        _TABLES[key] = table.reshape(-1).view(_PAIR_DTYPE[dtype]).to(device)
    return _TABLES[key]


class DequantWorkspace:
    """Reused buffers for the dequantized experts: allocating (and page-faulting) megabytes per
    layer and step costs as much as the decode. One is shared by all layers (they run one after
    the other); it grows to the largest request and stays there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat ``[numel]`` view of buffer ``name`` (contents undefined).

        Buffers are allocated as normal (not inference) tensors even under
        ``torch.inference_mode``: the shared workspace outlives the call that grew it, and a later
        caller outside inference mode must still be able to write into it.
        """
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


DEFAULT_WORKSPACE = DequantWorkspace()


def _check_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{name}: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2:
        raise ValueError(f"{name}: blocks must be [E, N, K // 32, 16], got {tuple(blocks.shape)}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{name}: scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}"
        )


def dequantize_mxfp4_experts(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    experts: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    index_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize some experts of a stacked MXFP4 weight (OCP MX v1.0, `quant.mxfp4` layout).

    Args:
        blocks: ``[E, N, K // 32, 16]`` uint8, two E2M1 codes per byte, low nibble = even k.
        scales: ``[E, N, K // 32]`` uint8 E8M0.
        experts: ``[U]`` int64 expert ids to dequantize, in the order wanted.
        dtype: output dtype (float32, bfloat16, float16 or float64).
        out: optional contiguous ``[U, N, K]`` ``dtype`` buffer to write into.
        index_buffer: optional contiguous int32 buffer of ``U * N * K // 2`` elements.

    Returns:
        ``[U, N, K]`` ``dtype``, bit-identical to ``dequantize_mxfp4(blocks[experts],
        scales[experts], dtype)``.

    Raises:
        ValueError: wrong dtypes or shapes, or an unsupported ``dtype``.
    """
    _check_mxfp4("mxfp4 weight", blocks, scales)
    table = mxfp4_pair_table(dtype, blocks.device)
    num, n, groups, half = experts.numel(), blocks.shape[1], blocks.shape[2], blocks.shape[3]
    if out is None:
        out = torch.empty(num, n, groups * 2 * half, dtype=dtype, device=blocks.device)
    if index_buffer is None:
        index_buffer = torch.empty(num * n * groups * half, dtype=torch.int32)
    index = index_buffer[: num * n * groups * half].view(num, n, groups, half)
    index.copy_(blocks.index_select(0, experts))
    index.add_((scales.index_select(0, experts).to(torch.int32) << 8).unsqueeze(-1))
    torch.index_select(table, 0, index.view(-1), out=out.view(-1).view(table.dtype))
    return out


def fused_moe_mxfp4_cpu(
    hidden: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    workspace: DequantWorkspace | None = None,
    max_workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> torch.Tensor:
    """Mixture of SwiGLU experts on MXFP4 weights; equals
    `kernels.moe.reference.fused_moe_reference`
    on the dequantized weights up to GEMM rounding (the dequantized values are exact).

    Args:
        hidden: ``[T, H]`` activations, the compute dtype (float32, bfloat16, float16, float64).
        w13_blocks: ``[E, 2I, H // 32, 16]`` uint8, w13_scales: ``[E, 2I, H // 32]`` uint8
            (`quant.mxfp4.quantize_mxfp4` of ``w13``, gate rows then up rows).
        w2_blocks: ``[E, H, I // 32, 16]`` uint8, w2_scales: ``[E, H, I // 32]`` uint8.
        topk_weights: ``[T, k]`` float32; topk_ids: ``[T, k]`` int32, ids outside ``[0, E)``
            skipped.
        activation: plain SwiGLU (default) or gpt-oss's clamped variant.
        b13: optional ``[E, 2I]`` bias, b2: optional ``[E, H]`` bias (compute dtype).
        workspace: buffers to reuse; ``None``: the module's shared `DEFAULT_WORKSPACE`.
        max_workspace_bytes: experts are dequantized in chunks of at most this many bytes
            (at least one expert per chunk).

    Returns:
        ``[T, H]`` in hidden's dtype.

    Raises:
        ValueError: wrong weight dtypes or shapes.
    """
    _check_mxfp4("w13", w13_blocks, w13_scales)
    _check_mxfp4("w2", w2_blocks, w2_scales)
    num_experts = w13_blocks.shape[0]
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    used = torch.unique(ids[valid])  # sorted
    if used.numel() == 0:
        return torch.zeros_like(hidden)
    workspace = workspace or DEFAULT_WORKSPACE
    dtype, device = hidden.dtype, hidden.device
    n13, k13 = w13_blocks.shape[1], w13_blocks.shape[2] * MXFP4_BLOCK_SIZE
    n2, k2 = w2_blocks.shape[1], w2_blocks.shape[2] * MXFP4_BLOCK_SIZE
    per_expert = n13 * k13 + n2 * k2
    bytes_per_expert = per_expert * (hidden.element_size() + 2)  # weights + int32 per byte
    chunk = max(1, min(used.numel(), max_workspace_bytes // bytes_per_expert))
    # Local slot of each expert id; -1 (skipped) for experts outside the chunk or this rank.
    slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int32, device=device)
    key = torch.where(valid, ids, num_experts)
    out = None
    for start in range(0, used.numel(), chunk):
        experts = used[start : start + chunk]
        num = experts.numel()
        buf = workspace.get("weights", num * per_expert, dtype, device)
        index = workspace.get("index", num * per_expert // 2, torch.int32, device)
        w13 = buf[: num * n13 * k13].view(num, n13, k13)
        w2 = buf[num * n13 * k13 :].view(num, n2, k2)
        dequantize_mxfp4_experts(w13_blocks, w13_scales, experts, dtype, w13, index)
        dequantize_mxfp4_experts(w2_blocks, w2_scales, experts, dtype, w2, index)
        slot_of.fill_(-1)
        slot_of[experts] = torch.arange(num, dtype=torch.int32, device=device)
        part = fused_moe_cpu(
            hidden,
            w13,
            w2,
            topk_weights,
            slot_of[key],
            activation=activation,
            b13=None if b13 is None else b13.index_select(0, experts).to(dtype),
            b2=None if b2 is None else b2.index_select(0, experts).to(dtype),
        )
        out = part if out is None else out.add_(part)
    return out
