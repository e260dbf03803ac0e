"""The fused MoE kernels' tile layout (csrc/moe_cpu.cpp): 16 output rows per tile, k-major.

Two ways to build it, with the same bytes:
- the torch reference (`pack_tiles`, `pack_q4_tiles` on unpacked codes), kept beside the fast
  path and used where the native library is unavailable;
- the one-pass native repack (csrc/repack.cpp: `q4_expert_tiles`, `value_expert_tiles`), which
  reads the checkpoint's rows of packed nibbles / scales once and writes the tiles, threaded
  over (expert, tile), without the unpacked codes, padded or transposed temporaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels.native.library import NativeUnavailable, check_status, load_native
from quant.packing import unpack_nibbles

#: Output columns per packed tile (csrc/moe_cpu.cpp kTile).
TILE = 16


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N / 16), K, 16]: tiles of 16 output rows, k-major, N zero-padded.

    Unpacking: `packed.transpose(2, 3).reshape(E, -1, K)[:, :N]` gives `w` back exactly.
    """
    e, n, k = w.shape
    padded = -(-n // TILE) * TILE
    w = F.pad(w, (0, 0, 0, padded - n))
    return w.view(e, padded // TILE, TILE, k).transpose(2, 3).contiguous()




#: Nibble order of a 4-bit tile row (csrc/moe_cpu.cpp): per k, 8 bytes; byte i holds column
#: `Q4_LOW_COLUMNS[i]` of the tile in its low nibble (bits 0-3) and `Q4_HIGH_COLUMNS[i]` in its
#: high nibble (bits 4-7). The kernel's in-lane unpacks turn this order back into columns 0-15.
Q4_LOW_COLUMNS = (0, 1, 2, 3, 8, 9, 10, 11)
Q4_HIGH_COLUMNS = (4, 5, 6, 7, 12, 13, 14, 15)


def pack_q4_tiles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [E, N, K] (uint8 in [0, 15], K even) -> [E, ceil(N/16), K/2, 16] uint8: tiles
    of 16 output rows, k-major, 8 bytes per k in the `Q4_LOW_COLUMNS` / `Q4_HIGH_COLUMNS` nibble
    order (the bytes of k then those of k + 1 form one 16-byte row). Padding rows get code 0.

    Raises:
        ValueError: codes that are not uint8 [E, N, K] with K even, or a code above 15.
    """
    if codes.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[-1] % 2:
        raise ValueError(f"codes must be uint8 [E, N, K] with K even, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes hold {int(codes.max())}, above the 4-bit maximum 15")
    e, _, k = codes.shape
    tiles = pack_tiles(codes)  # [E, T, K, 16]
    low, high = tiles[..., list(Q4_LOW_COLUMNS)], tiles[..., list(Q4_HIGH_COLUMNS)]
    return (low | (high << 4)).reshape(e, -1, k // 2, TILE).contiguous()


def unpack_q4_tiles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_q4_tiles`: [E, T, K/2, 16] uint8 -> codes [E, n, K] uint8 (exact)."""
    e, t, half, _ = packed.shape
    k = 2 * half
    pairs = packed.reshape(e, t, k, TILE // 2)
    tiles = torch.empty(e, t, k, TILE, dtype=torch.uint8)
    tiles[..., list(Q4_LOW_COLUMNS)] = pairs & 0x0F
    tiles[..., list(Q4_HIGH_COLUMNS)] = pairs >> 4
    return tiles.transpose(2, 3).reshape(e, t * TILE, k)[:, :n]


def unpack_tiles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_tiles`: [E, T, K, 16] -> [E, n, K] (exact)."""
    e, t, k, _ = packed.shape
    return packed.transpose(2, 3).reshape(e, t * TILE, k)[:, :n]


def gate_up_tiles(w: torch.Tensor, pack) -> torch.Tensor:
    """[E, 2I, K'] (gate rows, then up rows) -> [E, 2, ceil(I/16), ...] packed by `pack`."""
    i = w.shape[1] // 2
    return torch.stack([pack(w[:, :i]), pack(w[:, i:])], dim=1).contiguous()


def gate_up_rows(w: torch.Tensor, i: int, unpack) -> torch.Tensor:
    """Inverse of `gate_up_tiles`."""
    return torch.cat([unpack(w[:, 0], i), unpack(w[:, 1], i)], dim=1)


#: Rows of one expert projection: E tensors [N, K'] (row-major rows, one row stride), or None.
ExpertRows = Sequence[torch.Tensor]


def repack_library() -> ModuleType | None:
    """The native library with the repack entry points, or None where it cannot be built or
    loaded here (the torch reference then builds the same tiles)."""
    try:
        return load_native("repack")
    except NativeUnavailable:
        return None


def q4_expert_tiles(rows: ExpertRows, lib: ModuleType | None) -> torch.Tensor:
    """Packed 4-bit rows -> `pack_q4_tiles` tiles of their codes.

    Args:
        rows: E tensors [N, K/2] uint8 (code 2j in byte j's low nibble, `quant.packing`).
        lib: `repack_library()`, or None for the torch reference.

    Returns:
        [E, ceil(N/16), K/2, 16] uint8, byte for byte `pack_q4_tiles(unpack_nibbles(rows))`.
    """
    if lib is None:
        return pack_q4_tiles(unpack_nibbles(torch.stack(list(rows))))
    return _native_tiles(rows, lib, q4=True)


def value_expert_tiles(rows: ExpertRows, lib: ModuleType | None) -> torch.Tensor:
    """Per-row values (scales, zero points) -> `pack_tiles` tiles.

    Args:
        rows: E tensors [N, K] of one dtype of 1, 2 or 4 bytes.
        lib: `repack_library()`, or None for the torch reference.

    Returns:
        [E, ceil(N/16), K, 16] of rows' dtype, byte for byte `pack_tiles(stack(rows))`.
    """
    if lib is None:
        return pack_tiles(torch.stack(list(rows)))
    return _native_tiles(rows, lib, q4=False)


def gate_up_expert_tiles(
    rows: ExpertRows, tiles: Callable[[ExpertRows, ModuleType | None], torch.Tensor],
    lib: ModuleType | None,
) -> torch.Tensor:
    """Rows [2I, K'] per expert (gate rows, then up rows) -> [E, 2, ceil(I/16), ...]: `tiles`
    of the gate halves, then of the up halves (`gate_up_tiles`)."""
    i = rows[0].shape[0] // 2
    gate, up = [r[:i] for r in rows], [r[i:] for r in rows]
    if lib is None:
        return torch.stack([tiles(gate, None), tiles(up, None)], dim=1).contiguous()
    q4 = tiles is q4_expert_tiles
    first = _native_tiles(gate, lib, q4=q4, halves=2)
    _native_tiles(up, lib, q4=q4, out=first[:, 1])
    return first


def _native_tiles(rows: ExpertRows, lib: ModuleType, *, q4: bool, halves: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """csrc/repack.cpp over `rows` into `out` (a view whose experts are contiguous), or into a
    new [E, T, K', 16] tensor ([E, halves, T, K', 16] when `halves`, this call filling
    [:, 0]); returns the tensor written (the whole one when new).

    Raises:
        ValueError: rows of different shapes or dtypes, not 2-D, or an odd K (q4).
    """
    if not rows or any(r.dim() != 2 or r.shape != rows[0].shape or r.dtype != rows[0].dtype
                       for r in rows):
        raise ValueError("expert rows: need E >= 1 tensors [N, K] of one shape and dtype, got "
                         + ", ".join(f"{r.dtype} {tuple(r.shape)}" for r in rows[:4]))
    if any(r.stride(1) != 1 or r.stride(0) != rows[0].stride(0) for r in rows):
        rows = [r.contiguous() for r in rows]
    n, k = rows[0].shape
    elem = rows[0].element_size()
    tiles = -(-n // TILE)
    tile_shape = (tiles, k, TILE)  # q4: k = K/2 bytes, a tile row per codes 2j, 2j + 1
    e = len(rows)
    whole = None
    if out is None:
        whole = torch.empty((e, halves, *tile_shape) if halves else (e, *tile_shape),
                            dtype=rows[0].dtype)
        out = whole[:, 0] if halves else whole
    addresses = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64)
    stride = rows[0].stride(0) * elem
    dst_stride = out.stride(0) * out.element_size()
    if q4:
        status = lib.moe_pack_q4_tiles(addresses.data_ptr(), e, n, 2 * k, stride,
                                       out.data_ptr(), dst_stride, torch.get_num_threads())
    else:
        status = lib.moe_pack_tiles(addresses.data_ptr(), e, n, k, elem, stride,
                                    out.data_ptr(), dst_stride, torch.get_num_threads())
    check_status(status, "pack_q4_tiles" if q4 else "pack_tiles")
    return out if whole is None else whole
