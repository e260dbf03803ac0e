"""MXFP4 (OCP MX v1.0): code tables, nibble order, round trips and error bounds, fresh each run."""

from __future__ import annotations

import math

import pytest
import torch

from quant.mxfp4 import (
    E2M1_VALUES,
    dequantize_mxfp4,
    e2m1_to_float,
    e8m0_to_float,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

# OCP MX v1.0 §5.3.3, FP4 E2M1, written out by hand: code = sign | exponent(2) | mantissa(1).
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def test_all_16_e2m1_codes_decode_to_the_spec_table_with_signed_zero():
    decoded = e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == SPEC_E2M1 and list(E2M1_VALUES) == SPEC_E2M1
    assert not math.copysign(1.0, decoded[0].item()) < 0
    assert math.copysign(1.0, decoded[8].item()) < 0  # code 8 is -0.0
    assert decoded[1].item() == 0.5 and decoded[9].item() == -0.5  # the subnormal


def test_e8m0_bytes_decode_to_powers_of_two_and_255_is_nan():
    s = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert s[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(s[6].item())
    every = e8m0_to_float(torch.arange(255, dtype=torch.uint8)).double()
    assert torch.equal(every, torch.exp2(torch.arange(-127, 128, dtype=torch.float64)))


def test_pack_unpack_round_trip_fresh_random_codes():
    g = _gen()
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(pack_e2m1(unpack_e2m1(packed)), packed)


def test_nibble_order_low_nibble_is_the_even_element():
    packed = pack_e2m1(torch.tensor([0x1, 0xA], dtype=torch.uint8))
    assert packed.tolist() == [0xA1]
    assert unpack_e2m1(torch.tensor([0x7F], dtype=torch.uint8)).tolist() == [0xF, 0x7]


def test_pack_rejects_codes_above_15_odd_length_and_wrong_dtype():
    with pytest.raises(ValueError, match="15"):
        pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(torch.zeros(4, dtype=torch.int32))


def test_matches_transformers_dequantization_exactly():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = _gen()
    e, n, groups = 2, 3, 4
    blocks = torch.randint(0, 256, (e, n, groups, 16), generator=g, dtype=torch.uint8)
    # Moderate exponents keep every product exactly representable in bf16 and fp32.
    scales = torch.randint(100, 150, (e, n, groups), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = mx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, N, K]
        assert torch.equal(ours.transpose(1, 2), theirs)


def _half_step(magnitude: torch.Tensor) -> torch.Tensor:
    """Half the gap between E2M1 neighbours around ``magnitude`` (in units of the scale)."""
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return step.double() / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_error_within_half_an_e2m1_step(dtype):
    g = _gen()
    w = (torch.randn(4, 6, 128, generator=g) * torch.rand(4, 6, 1, generator=g) * 10).to(dtype)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 6, 4, 16) and scales.shape == (4, 6, 4)
    deq = dequantize_mxfp4(blocks, scales, torch.float64)
    x = e8m0_to_float(scales).double().repeat_interleave(32, dim=-1)
    ref = w.double()
    scaled = ref.abs() / x
    saturated = scaled > 6.0
    err = (deq - ref).abs()
    inside = ~saturated
    assert torch.all(err[inside] <= _half_step(scaled[inside]) * x[inside])
    assert torch.all(deq[saturated].abs() == 6.0 * x[saturated])  # clamped to ±6·X
    amax = ref.abs().reshape(4, 6, 4, 32).amax(-1)
    # OCP §6.3: X = 2^(floor(log2 amax) - 2), so amax / X lies in [4, 8).
    ratio = amax / e8m0_to_float(scales).double()
    assert torch.all((ratio >= 4) & (ratio < 8))


def test_representable_values_round_trip_exactly_and_ties_go_to_even():
    g = _gen()
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    codes[:, 0] = 7  # a 6 in every block pins the scale: amax = 6·X
    exps = torch.randint(-20, 20, (5, 2, 1), generator=g).float()
    w = (e2m1_to_float(codes).reshape(5, 2, 32) * torch.exp2(exps)).reshape(5, 64)
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), w)
    assert torch.equal(scales, (exps.squeeze(-1) + 127).to(torch.uint8))
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 7.9] + [0.0] * 22)
    deq = dequantize_mxfp4(*quantize_mxfp4(ties[None]), torch.float32)[0]
    assert deq[:10].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]


def test_zero_block_and_errors():
    blocks, scales = quantize_mxfp4(torch.zeros(2, 32))
    assert scales.tolist() == [[0], [0]] and not blocks.any()
    with pytest.raises(ValueError, match="48.*32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="Inf or NaN"):
        quantize_mxfp4(torch.tensor([float("inf")] + [0.0] * 31))
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks"):
        dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
