"""The native one-pass expert repack (csrc/repack.cpp, `kernels.moe.tiles`) against the torch
reference, byte for byte, on fresh random inputs.

MXFP4 makes H and I multiples of 32, so its tiles never pad; int4 groups of 8 let I and H be
multiples of 8 only (here 24 and 40), which exercises the padding rows (rows past N) and rows
whose K/2 bytes are not a multiple of 16 (the repack's byte-at-a-time tail). The library must
build here (a build failure is a test failure, not a skip).
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.native import PackedQuantExperts
from kernels.moe.tiles import (
    gate_up_expert_tiles,
    pack_q4_tiles,
    pack_tiles,
    q4_expert_tiles,
    repack_library,
    value_expert_tiles,
)
from kernels.native.library import _build
from quant.int4 import Int4Weight
from quant.packing import unpack_nibbles


@pytest.fixture(scope="module")
def lib():
    return _build("repack")  # raises NativeUnavailable with the compiler's message


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _bytes(g, *shape) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("n,k", [(16, 32), (37, 50), (5, 2), (48, 96), (33, 34)])
def test_q4_tiles_match_the_torch_path(lib, n, k):
    g = _gen()
    rows = list(_bytes(g, 3, n, k // 2).unbind(0))
    want = pack_q4_tiles(unpack_nibbles(torch.stack(rows)))
    _equal_bytes(q4_expert_tiles(rows, lib), want)
    _equal_bytes(q4_expert_tiles(rows, None), want)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 3), (37, 5), (40, 90)])
def test_value_tiles_match_the_torch_path(lib, dtype, n, k):
    g = _gen()
    rows = list(_bytes(g, 4, n, k * torch.empty(0, dtype=dtype).element_size())
                .view(dtype).unbind(0))
    _equal_bytes(value_expert_tiles(rows, lib), pack_tiles(torch.stack(rows)))


def test_strided_rows_and_gate_up_halves(lib):
    """Rows that are views with a row stride (every other row of an interleaved tensor) and
    the gate/up split: the same bytes as the torch path on contiguous copies."""
    g = _gen()
    inter = _bytes(g, 2, 2 * 40, 24)  # 40 gate/up rows interleaved, 48 codes each
    rows = [t[0::2] for t in inter.unbind(0)] + [t[1::2] for t in inter.unbind(0)]
    want = pack_q4_tiles(unpack_nibbles(torch.stack([r.contiguous() for r in rows])))
    _equal_bytes(q4_expert_tiles(rows, lib), want)
    w13 = list(_bytes(g, 3, 2 * 24, 20).unbind(0))
    _equal_bytes(gate_up_expert_tiles(w13, q4_expert_tiles, lib),
                 gate_up_expert_tiles(w13, q4_expert_tiles, None))


def _packed_equal(a: PackedQuantExperts, b: PackedQuantExperts) -> None:
    for name in ("w13_codes", "w13_scales", "w13_zeros", "w2_codes", "w2_scales", "w2_zeros"):
        _equal_bytes(getattr(a, name), getattr(b, name))
    assert (a.method, a.intermediate, a.hidden, a.group_size, a.scale_dtype) == (
        b.method, b.intermediate, b.hidden, b.group_size, b.scale_dtype)


@pytest.mark.parametrize("e,h,inter", [(3, 64, 32), (2, 96, 160)])
def test_from_mxfp4_native_is_the_torch_path_and_round_trips(lib, e, h, inter):
    g = _gen()
    w13 = (_bytes(g, e, 2 * inter, h // 32, 16), _bytes(g, e, 2 * inter, h // 32))
    w2 = (_bytes(g, e, h, inter // 32, 16), _bytes(g, e, h, inter // 32))
    native = PackedQuantExperts.from_mxfp4(w13, w2, native=True)
    _packed_equal(native, PackedQuantExperts.from_mxfp4(w13, w2, native=False))
    (b13, s13), (b2, s2) = native.to_mxfp4()
    for got, want in zip((b13, s13, b2, s2), (*w13, *w2), strict=True):
        _equal_bytes(got, want)


def _int4(g, n, k, group, scale_dtype, zeros):
    scales = torch.rand(n, k // group, generator=g).to(scale_dtype)
    z = _bytes(g, n, k // group) & 0x0F if zeros else None
    return Int4Weight(_bytes(g, n, k // 2), scales, z)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros", ["none", "all", "some"])
def test_from_int4_native_is_the_torch_path_and_round_trips(lib, scale_dtype, zeros):
    """I = 24, H = 40, groups of 8: padded tiles and K/2 rows of 20 and 12 bytes."""
    g, e, h, inter, group = _gen(), 3, 40, 24, 8
    w13 = [_int4(g, 2 * inter, h, group, scale_dtype, zeros == "all" or x == 1)
           for x in range(e)]
    w2 = [_int4(g, h, inter, group, scale_dtype, zeros == "all") for _ in range(e)]
    if zeros == "none":
        w13 = [Int4Weight(w.packed, w.scales, None) for w in w13]
    native = PackedQuantExperts.from_int4(w13, w2, native=True)
    _packed_equal(native, PackedQuantExperts.from_int4(w13, w2, native=False))
    back13, back2 = native.to_int4()
    for got, want in zip((*back13, *back2), (*w13, *w2), strict=True):
        _equal_bytes(got.packed, want.packed)
        _equal_bytes(got.scales, want.scales)
        if zeros == "none":
            assert got.zeros is None
        elif want.zeros is not None:
            _equal_bytes(got.zeros, want.zeros)


def test_repack_library_loads_here():
    assert repack_library() is not None


@pytest.mark.parametrize("e,n,k", [(1, 40, 64), (2, 16, 32), (3, 7, 96)])
def test_pack_vnni_native_is_the_torch_path(lib, e, n, k):
    """The bf16 linears' packed copy (`kernels.dense.amx.pack_vnni`), N padded or not."""
    from kernels.dense.amx import pack_vnni

    w = torch.randn(e, n, k, generator=_gen()).to(torch.bfloat16)
    _equal_bytes(pack_vnni(w, native=True), pack_vnni(w, native=False))
