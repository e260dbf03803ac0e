"""Two 4-bit codes per byte along the last dimension, shared by the MXFP4 and INT4 formats.

Nibble order (both formats, and the gpt-oss / `transformers` MXFP4 layout): byte ``i`` holds
element ``2i`` in its low nibble (bits 0-3) and element ``2i + 1`` in its high nibble (bits 4-7).
"""

from __future__ import annotations

import torch


def check_uint8(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a uint8 tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a uint8 tensor, got {got}")


def pack_nibbles(codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
    """Pack 4-bit codes two per byte.

    Args:
        codes: ``[..., K]`` uint8, each value in ``[0, 15]``; ``K`` even.
        name: what to call ``codes`` in error messages.

    Returns:
        ``[..., K // 2]`` uint8; low nibble = even element, high nibble = odd element.

    Raises:
        ValueError: ``codes`` is not uint8, has no dimensions, an odd last dimension, or a
            value above 15.
    """
    check_uint8(name, codes)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"{name} needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{name} holds {int(codes.max())}, above the 4-bit maximum 15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, name: str = "packed") -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`.

    Args:
        packed: ``[..., K // 2]`` uint8.
        name: what to call ``packed`` in error messages.

    Returns:
        ``[..., K]`` uint8 codes in ``[0, 15]``.

    Raises:
        ValueError: ``packed`` is not a uint8 tensor with at least one dimension.
    """
    check_uint8(name, packed)
    if packed.dim() == 0:
        raise ValueError(f"{name} needs at least one dimension, got a scalar")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


#: Elements of a weight quantized at a time (`row_chunks`): its float32 temporaries stay a few
#: times 4 bytes x this (8 MiB each), whatever the weight's size (a 201088 x 2880 LM head is
#: 579 M values: 2.2 GiB per whole float32 temporary).
QUANT_CHUNK_ELEMENTS = 1 << 21


def row_chunks(rows: int, row_elements: int, chunk_elements: int = QUANT_CHUNK_ELEMENTS):
    """Slices of `rows` rows of `row_elements` values each, about `chunk_elements` values per
    slice (at least one row): quantizing a weight slice by slice bounds the temporaries to one
    slice, and gives the same codes, since every block and group lies within one row.

    Raises:
        ValueError: `chunk_elements` < 1.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    step = max(1, chunk_elements // max(1, row_elements))
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]
