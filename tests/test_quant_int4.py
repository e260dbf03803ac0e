"""INT4 group-wise (w4a16): packing, symmetric and asymmetric error bounds, errors; fresh inputs."""

from __future__ import annotations

import pytest
import torch

from quant.int4 import dequantize_int4, quantize_int4
from quant.packing import pack_nibbles, unpack_nibbles


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _per_element(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.double().repeat_interleave(group_size, dim=-1)


def test_pack_unpack_round_trip_and_low_nibble_is_even_k():
    g = _gen()
    codes = torch.randint(0, 16, (2, 7, 128), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (2, 7, 64)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([[3, 12]], dtype=torch.uint8)).tolist() == [[0xC3]]


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_error_at_most_half_a_scale_per_element(group_size, symmetric):
    g = _gen()
    n, k = 6, 256
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    if not symmetric:
        w[0] = w[0].abs() + 0.5  # an all-positive row: the range still includes 0
    packed, scales, zeros = quantize_int4(w, group_size, symmetric)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == (n, k // group_size) and scales.dtype == torch.float32
    assert (zeros is None) == symmetric
    if zeros is not None:
        assert zeros.shape == scales.shape and zeros.dtype == torch.uint8
        assert int(zeros.max()) <= 15
    deq = dequantize_int4(packed, scales, zeros, torch.float64)
    err = (deq - w.double()).abs()
    # fp32 division before rounding may land a hair past a tie: allow 1e-5 of a scale.
    assert torch.all(err <= _per_element(scales, group_size) * (0.5 + 1e-5))


def test_symmetric_codes_stay_in_int4_and_amax_is_exact():
    g = _gen()
    w = torch.randn(4, 64, generator=g)
    packed, scales, _ = quantize_int4(w, 32, True)
    q = unpack_nibbles(packed).int() - 8
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    torch.testing.assert_close(scales, w.reshape(4, 2, 32).abs().amax(-1) / 7)


@pytest.mark.parametrize("symmetric", [True, False])
def test_representable_values_round_trip_exactly(symmetric):
    g = _gen()
    n, k, gs = 3, 128, 64
    scale = torch.exp2(torch.randint(-6, 3, (n, k // gs, 1), generator=g).float())
    if symmetric:
        q = torch.randint(-7, 8, (n, k // gs, gs), generator=g).float()
        q[..., 0] = 7  # pins amax / 7 to the scale
    else:
        q = torch.randint(-5, 11, (n, k // gs, gs), generator=g).float()
        q[..., 0], q[..., 1] = -5, 10  # range [-5, 10]·scale: 15 steps, zero point 5
    w = (q * scale).reshape(n, k)
    deq = dequantize_int4(*quantize_int4(w, gs, symmetric), torch.float32)
    assert torch.equal(deq, w)


def test_zero_group_dequantizes_to_zero_and_bf16_input_works():
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    w[1, 32:] = 1.0
    for symmetric in (True, False):
        deq = dequantize_int4(*quantize_int4(w, 32, symmetric), torch.bfloat16)
        assert torch.equal(deq, w)


def test_group_size_that_does_not_divide_k_names_both_numbers():
    with pytest.raises(ValueError, match=r"group_size 128 does not divide K = 320"):
        quantize_int4(torch.zeros(4, 320), 128)
    with pytest.raises(ValueError, match="group_size 7"):
        quantize_int4(torch.zeros(4, 320), 7)


def test_wrong_shapes_and_dtypes_name_the_tensor():
    packed, scales, zeros = quantize_int4(torch.randn(4, 64), 32, symmetric=False)
    with pytest.raises(ValueError, match="w must be"):
        quantize_int4(torch.zeros(4, 64, dtype=torch.int32), 32)
    with pytest.raises(ValueError, match="w must be"):
        quantize_int4(torch.zeros(64), 32)
    with pytest.raises(ValueError, match="packed"):
        dequantize_int4(packed.int(), scales, zeros)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int4(packed, scales[:3], zeros)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int4(packed, scales.to(torch.uint8), zeros)
    with pytest.raises(ValueError, match="zeros"):
        dequantize_int4(packed, scales, zeros.float())
    with pytest.raises(ValueError, match="zeros"):
        dequantize_int4(packed, scales, zeros[:, :1])
    with pytest.raises(ValueError, match="Inf or NaN"):
        quantize_int4(torch.full((2, 32), float("nan")), 32)
