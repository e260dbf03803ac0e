"""MXFP4 weights: OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, 2023).

An MXFP4 block is 32 consecutive values along the last dimension sharing one E8M0 scale
``X`` (one unsigned biased-exponent byte ``b``, ``X = 2^(b - 127)``, ``b = 255`` is NaN) over
32 FP4 E2M1 elements ``P`` (1 sign bit, 2 exponent bits with bias 1, 1 mantissa bit;
magnitudes 0, 0.5 (the one subnormal), 1, 1.5, 2, 3, 4, 6; no Inf or NaN).
A value is ``X * P``.

Layout (what gpt-oss checkpoints store for expert weights, and what
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` reads):
``*_blocks`` uint8 ``[..., K // 32, 16]``, two E2M1 codes per byte, the low nibble holding the
even element and the high nibble the odd one; ``*_scales`` uint8 ``[..., K // 32]``.
(gpt-oss itself stores ``[E, N, K // 32, 16]`` and transformers transposes the dequantized
result to ``[E, K, N]``; these functions keep the last dimension as ``K``.)
"""

from __future__ import annotations

import torch

from quant.packing import (
    QUANT_CHUNK_ELEMENTS,
    check_uint8,
    pack_nibbles,
    row_chunks,
    unpack_nibbles,
)

MXFP4_BLOCK_SIZE = 32  # values per E8M0 scale (OCP MX v1.0: block size k = 32 for MXFP4)
E2M1_EMAX = 2  # exponent of the largest normal E2M1 value, 6 = 1.5 * 2^2 (OCP MX v1.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # bytes 0..254

# Round-to-nearest-even boundaries between neighbouring E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
# At a tie the even code (mantissa bit 0) wins: the tie rounds up only when the lower code is odd.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def _e2m1_code_value(code: int) -> float:
    """Decode one 4-bit E2M1 code by its fields (OCP MX v1.0); -0.0 for code 8."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:  # subnormal: 2^(1 - bias) * 0.m with bias 1
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


E2M1_VALUES: tuple[float, ...] = tuple(_e2m1_code_value(c) for c in range(16))


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E2M1 codes to floats.

    Args:
        codes: ``[...]`` uint8, each in ``[0, 15]`` (one code per byte, unpacked).
        dtype: output floating dtype.

    Returns:
        ``[...]`` ``dtype`` values from :data:`E2M1_VALUES` (signed zero kept).

    Raises:
        ValueError: ``codes`` is not uint8.
    """
    check_uint8("codes", codes)
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return lut[codes.long()]


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes (OCP MX v1.0, E8M0): ``2^(b - 127)``, byte 255 -> NaN.

    Args:
        scales: ``[...]`` uint8 biased exponents.

    Returns:
        ``[...]`` float32 (byte 0 is ``2^-127``, an fp32 subnormal, exact).

    Raises:
        ValueError: ``scales`` is not uint8.
    """
    check_uint8("scales", scales)
    exponent = scales.to(torch.int32) - E8M0_BIAS
    ones = torch.ones(scales.shape, dtype=torch.float32, device=scales.device)
    out = torch.ldexp(ones, exponent)
    return out.masked_fill(scales == E8M0_NAN, float("nan"))


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte: ``[..., K]`` uint8 -> ``[..., K // 2]`` uint8.

    Byte ``i`` holds element ``2i`` in its low nibble and element ``2i + 1`` in its high nibble,
    the order gpt-oss checkpoints and ``transformers`` (``blk & 0x0F`` -> even, ``blk >> 4`` ->
    odd) use. Raises ``ValueError`` for a non-uint8 tensor, an odd ``K`` or a code above 15.
    """
    return pack_nibbles(codes, "codes")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: ``[..., K // 2]`` uint8 -> ``[..., K]`` uint8 codes."""
    return unpack_nibbles(packed, "packed")


def _float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled float32 values to E2M1 codes, nearest with ties to even.

    Magnitudes above 6 saturate to 6 (the MX conversion clamps to the element's max normal);
    the sign bit follows the input's sign, so -0.0 and small negatives give code 8.
    """
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP, strict=True):
        above = magnitude >= midpoint if tie_up else magnitude > midpoint
        code += above.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_mxfp4(
    w: torch.Tensor, *, chunk_elements: int = QUANT_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4 (OCP MX v1.0 conversion), round to nearest, ties to even.

    Per block of 32 values along the last dimension: shared exponent
    ``floor(log2(amax)) - 2`` (2 = emax of E2M1), clamped to the E8M0 range ``[-127, 127]``;
    an all-zero block gets byte 0. Elements ``w / X`` round to the nearest E2M1 value; those
    above 6 in magnitude (``amax / X`` lies in ``[4, 8)``) saturate to ``±6``.

    Args:
        w: ``[..., K]`` floating weights (bf16, fp16 or fp32; computed in fp32), finite.
        chunk_elements: values quantized at a time (`quant.packing.row_chunks`): the float32
            temporaries are about 4 bytes x this, whatever ``w``'s size; the codes are the same.

    Returns:
        ``blocks``: ``[..., K // 32, 16]`` uint8, two E2M1 codes per byte, low nibble = even
        element; ``scales``: ``[..., K // 32]`` uint8 E8M0 biased exponents.

    Raises:
        ValueError: ``w`` is not a floating tensor, ``K`` is not a multiple of 32, or ``w``
            holds Inf/NaN.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() == 0:
        raise ValueError("w must be a floating tensor with at least one dimension")
    k = w.shape[-1]
    if k % MXFP4_BLOCK_SIZE:
        raise ValueError(f"w's last dimension {k} is not a multiple of the MXFP4 block size 32")
    rows = w.reshape(-1, k)
    blocks = torch.empty(rows.shape[0], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE // 2,
                         dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows.shape[0], k // MXFP4_BLOCK_SIZE, dtype=torch.uint8,
                         device=w.device)
    for part in row_chunks(rows.shape[0], k, chunk_elements):
        blocks[part], scales[part] = _quantize_rows(rows[part])
    lead = tuple(w.shape[:-1])
    return blocks.reshape(*lead, *blocks.shape[1:]), scales.reshape(*lead, scales.shape[-1])


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_mxfp4` of ``w`` [R, K], in one go (``[R, K // 32, 16]``, ``[R, K // 32]``).

    Raises:
        ValueError: ``w`` holds Inf/NaN.
    """
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w holds Inf or NaN; MXFP4 quantization needs finite weights")
    k = w.shape[-1]
    grouped = w.float().reshape(*w.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    amax = grouped.abs().amax(dim=-1)
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly.
    _, e = torch.frexp(amax)
    shared = (e - 1 - E2M1_EMAX).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    shared = torch.where(amax == 0, torch.full_like(shared, _E8M0_MIN_EXP), shared)
    scaled = torch.ldexp(grouped, -shared.unsqueeze(-1))  # exact: a power-of-two scale
    codes = _float_to_e2m1(scaled)
    blocks = pack_e2m1(codes)
    scales = (shared + E8M0_BIAS).to(torch.uint8)
    return blocks, scales


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize MXFP4 (OCP MX v1.0): ``value = 2^(scale - 127) * E2M1(code)``.

    Computed in fp32 (every product of an E2M1 value and an E8M0 scale is exact there, short of
    overflow past ``6 * 2^127``), then cast to ``dtype``; scale byte 255 gives NaN.

    Args:
        blocks: ``[..., K // 32, 16]`` uint8, two codes per byte, low nibble = even element.
        scales: ``[..., K // 32]`` uint8 E8M0.
        dtype: output floating dtype.

    Returns:
        ``[..., K]`` ``dtype``.

    Raises:
        ValueError: either tensor is not uint8, ``blocks``'s last dimension is not 16, or the
            leading shapes differ.
    """
    check_uint8("blocks", blocks)
    check_uint8("scales", scales)
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2:
        raise ValueError(f"blocks must be [..., K // 32, 16], got shape {tuple(blocks.shape)}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match blocks shape "
            f"{tuple(blocks.shape)} (expected blocks.shape[:-1])"
        )
    values = e2m1_to_float(unpack_e2m1(blocks))  # [..., K // 32, 32]
    out = values * e8m0_to_float(scales).unsqueeze(-1)
    return out.flatten(-2).to(dtype)
