"""INT4 group-wise weights for w4a16 GEMMs (weights 4-bit, activations bf16/fp16).

The scheme of GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers") and AWQ (Lin et al., 2023) without their calibration:
each row of ``w [..., N, K]`` is cut into groups of ``group_size`` consecutive values along
``K`` (the reduction dimension), each group with its own scale, and, when asymmetric, its own
zero point. Quantization here is plain round-to-nearest (``torch.round``: ties to even).

Storage (one packing for both variants):

- ``packed``: ``[..., N, K // 2]`` uint8, two unsigned 4-bit codes ``u`` per byte, low nibble =
  even ``k``, high nibble = odd ``k`` (the MXFP4 order, :mod:`quant.packing`).
- ``scales``: ``[..., N, K // group_size]`` float32, or a 16-bit float (bfloat16/float16: a
  checkpoint's own scale dtype, 4 + 16 / group_size bits per weight instead of 4 + 32 /
  group_size).
- ``zeros``: ``[..., N, K // group_size]`` uint8 in ``[0, 15]`` (asymmetric), or ``None``
  (symmetric, where the zero point is the implicit constant 8).

Dequantized value: ``(u - zero) * scale``.

- Symmetric: ``q = clamp(round(w / scale), -8, 7)`` with ``scale = amax / 7`` (so ``-8`` is
  never produced and nothing clips), stored offset-binary as ``u = q + 8``.
- Asymmetric: the group's range ``[min(w_min, 0), max(w_max, 0)]`` (0 included so the zero
  point lies in ``[0, 15]``) maps onto ``[0, 15]``: ``scale = (hi - lo) / 15``,
  ``zero = round(-lo / scale)``, ``u = clamp(round(w / scale) + zero, 0, 15)``.

With 16-bit scales the scale is rounded up to its dtype first (at most 2^-8 relative for
bfloat16, 2^-10 for float16) and the codes are computed with the stored scale, so nothing
clips and the bound below holds for the scale actually stored.

Either way ``|w - dequantized| <= scale / 2`` per element, up to fp32 rounding.
An all-zero group stores scale 0 and dequantizes to zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant.packing import (
    QUANT_CHUNK_ELEMENTS,
    check_uint8,
    pack_nibbles,
    row_chunks,
    unpack_nibbles,
)

INT4_GROUP_SIZES = (32, 64, 128)  # the sizes the kernels and tests cover
SYMMETRIC_ZERO = 8  # implicit zero point of symmetric groups (offset-binary int4)


def check_group_size(k: int, group_size: int) -> None:
    """Raise ``ValueError`` naming both numbers unless ``group_size`` is even and divides ``k``."""
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size {group_size} must be a positive even number")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[..., K]`` -> ``[..., K // group_size, group_size]`` float32."""
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """A divisor: all-zero groups (scale 0) divide by 1 and so quantize to the zero point."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _stored_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (float32) rounded up to a value of ``scale_dtype``, as float32: never below the
    exact scale, so the group's range still fits its 15 steps."""
    stored = scale.to(scale_dtype)
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(stored.float() < scale, up, stored).float()


def _quantize_symmetric(
    g: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _stored_scale(g.abs().amax(dim=-1) / 7.0, scale_dtype)
    q = torch.round(g / _safe(scale).unsqueeze(-1)).clamp(-8, 7)
    return (q + SYMMETRIC_ZERO).to(torch.uint8), scale


def _quantize_asymmetric(
    g: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = _stored_scale((hi - lo) / 15.0, scale_dtype)
    safe = _safe(scale)
    zero = torch.round(-lo / safe).clamp(0, 15)
    u = (torch.round(g / safe.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15)
    return u.to(torch.uint8), scale, zero.to(torch.uint8)


#: Scale dtypes `quantize_int4` writes.
INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_int4(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    *,
    chunk_elements: int = QUANT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``w`` group-wise along its last dimension to packed 4-bit codes.

    Args:
        w: ``[..., N, K]`` floating weights (bf16, fp16 or fp32; computed in fp32), finite;
            ``K`` is the reduction dimension of ``x @ w.T``.
        group_size: values per scale along ``K`` (32, 64 or 128 in practice; any positive even
            divisor of ``K`` is accepted).
        symmetric: int4 in ``[-8, 7]`` with ``scale = amax / 7`` and no zero points if True;
            uint4 in ``[0, 15]`` with a zero point per group if False.
        scale_dtype: float32, bfloat16 or float16: the scales' storage (the codes are
            computed with the scales rounded to it).
        chunk_elements: values quantized at a time (`quant.packing.row_chunks`): the float32
            temporaries are about 4 bytes x this, whatever ``w``'s size; the codes are the same.

    Returns:
        ``packed``: ``[..., N, K // 2]`` uint8 (low nibble = even ``k``);
        ``scales``: ``[..., N, K // group_size]`` ``scale_dtype``;
        ``zeros``: ``[..., N, K // group_size]`` uint8, or ``None`` when ``symmetric``.

    Raises:
        ValueError: ``w`` is not a floating tensor of at least 2 dimensions or holds Inf/NaN,
            or ``group_size`` does not divide ``K`` (the message names both numbers), or
            ``scale_dtype`` is another dtype or cannot hold a scale (float16 above 65504).
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        raise ValueError("w must be a floating tensor [..., N, K]")
    if scale_dtype not in INT4_SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {INT4_SCALE_DTYPES}, got {scale_dtype}")
    k = w.shape[-1]
    check_group_size(k, group_size)
    rows = w.reshape(-1, k)
    r, groups = rows.shape[0], k // group_size
    packed = torch.empty(r, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(r, groups, dtype=scale_dtype, device=w.device)
    zeros = None if symmetric else torch.empty(r, groups, dtype=torch.uint8, device=w.device)
    for part in row_chunks(r, k, chunk_elements):
        packed[part], scales[part], z = _quantize_rows(rows[part], group_size, symmetric,
                                                       scale_dtype)
        if zeros is not None:
            zeros[part] = z
    lead = tuple(w.shape[:-1])
    return (packed.reshape(*lead, k // 2), scales.reshape(*lead, groups),
            None if zeros is None else zeros.reshape(*lead, groups))


def _quantize_rows(
    w: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantize_int4` of ``w`` [R, K] in one go.

    Raises:
        ValueError: ``w`` holds Inf/NaN, or a scale overflows ``scale_dtype``.
    """
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w holds Inf or NaN; INT4 quantization needs finite weights")
    g = _grouped(w, group_size)
    if symmetric:
        u, scales = _quantize_symmetric(g, scale_dtype)
        zeros = None
    else:
        u, scales, zeros = _quantize_asymmetric(g, scale_dtype)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"a group's scale overflows {scale_dtype}; use float32 scales")
    return pack_nibbles(u.flatten(-2), "codes"), scales.to(scale_dtype), zeros


def _check_dequantize_args(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
) -> int:
    """Validate shapes and dtypes; return the group size."""
    check_uint8("packed", packed)
    if packed.dim() < 2:
        raise ValueError(f"packed must be [..., N, K // 2], got shape {tuple(packed.shape)}")
    if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
        raise ValueError("scales must be a floating tensor [..., N, K // group_size]")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] == 0:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not fit packed shape {tuple(packed.shape)}"
        )
    k, num_groups = 2 * packed.shape[-1], scales.shape[-1]
    if k % num_groups:
        raise ValueError(f"scales has {num_groups} groups, which do not divide K = {k}")
    if zeros is not None:
        check_uint8("zeros", zeros)
        if zeros.shape != scales.shape:
            raise ValueError(
                f"zeros shape {tuple(zeros.shape)} does not match scales shape "
                f"{tuple(scales.shape)}"
            )
    return k // num_groups


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize :func:`quantize_int4` output: ``(u - zero) * scale``, in fp32, cast to ``dtype``.

    Args:
        packed: ``[..., N, K // 2]`` uint8, low nibble = even ``k``.
        scales: ``[..., N, K // group_size]`` floating; the group size is inferred from it.
        zeros: ``[..., N, K // group_size]`` uint8 zero points, or ``None`` for symmetric
            (implicit zero point 8).
        dtype: output floating dtype.

    Returns:
        ``[..., N, K]`` ``dtype``.

    Raises:
        ValueError: a tensor has the wrong dtype or a shape that does not fit ``packed``
            (the message names the tensor).
    """
    group_size = _check_dequantize_args(packed, scales, zeros)
    u = _grouped(unpack_nibbles(packed, "packed"), group_size)
    zero = (
        torch.full_like(scales, float(SYMMETRIC_ZERO), dtype=torch.float32)
        if zeros is None
        else zeros.float()
    )
    out = (u - zero.unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return out.flatten(-2).to(dtype)


class Int4Weight(NamedTuple):
    """One weight matrix in this module's int4 representation (see the module docstring).

    Attributes:
        packed: ``[N, K // 2]`` uint8, low nibble = even ``k``.
        scales: ``[N, K // group_size]`` floating (fp32 from :func:`quantize_int4`; a loaded
            checkpoint keeps its own scale dtype).
        zeros: ``[N, K // group_size]`` uint8 zero points in ``[0, 15]``, or ``None``
            (symmetric: implicit zero point 8).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the dequantized matrix."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def group_size(self) -> int:
        """Input values per scale."""
        return 2 * self.packed.shape[-1] // self.scales.shape[-1]
