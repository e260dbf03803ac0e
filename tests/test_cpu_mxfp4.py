"""The MXFP4 CPU expert path (`kernels.moe.torch_mxfp4`): the table decode equals
`quant.mxfp4.dequantize_mxfp4` bit for bit, and the layer equals the float path on the
dequantized weights, on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.moe.activation import SwiGLU
from kernels.moe.reference import fused_moe_reference
from kernels.moe.torch_cpu import fused_moe_cpu
from kernels.moe.torch_mxfp4 import (
    DequantWorkspace,
    dequantize_mxfp4_experts,
    fused_moe_mxfp4_cpu,
    mxfp4_pair_table,
)
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

H, INTER, E, K = 64, 32, 8, 2
GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_table_decode_is_bit_identical_to_dequantize_mxfp4(dtype: torch.dtype):
    g = _gen()
    blocks = torch.randint(0, 256, (5, 7, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (5, 7, 3), generator=g, dtype=torch.uint8)  # every byte < 255
    scales[0, 0] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    experts = torch.tensor([4, 0, 2, 4])  # any order, repeats allowed
    got = dequantize_mxfp4_experts(blocks, scales, experts, dtype)
    want = dequantize_mxfp4(blocks[experts], scales[experts], dtype)
    assert got.dtype == dtype and got.shape == (4, 7, 96)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # signed zeros, infs too
    scales[1, 0, 0] = 255
    nan = dequantize_mxfp4_experts(blocks, scales, torch.tensor([1]), dtype)
    assert bool(torch.isnan(nan[0, 0, :32]).all()) and not bool(torch.isnan(nan[0, 0, 32:]).any())


def test_table_layout_and_errors():
    table = mxfp4_pair_table(torch.float32).view(torch.float32).view(256, 256, 2)
    assert table[127, 0x71].tolist() == [0.5, 6.0]  # low nibble = even element
    assert table[128, 0xF9].tolist() == [-1.0, -12.0]
    assert math.copysign(1.0, table[127, 0x08, 0].item()) < 0  # code 8 is -0.0
    with pytest.raises(ValueError, match="compute dtype"):
        mxfp4_pair_table(torch.int32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4_experts(
            torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.zeros(1, 2, 1), torch.tensor([0]),
            torch.float32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="K // 32, 16"):
        dequantize_mxfp4_experts(
            torch.zeros(1, 2, 16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8),
            torch.tensor([0]), torch.float32,
        )  # fmt: skip


def test_workspace_grown_under_inference_mode_is_writable_outside_it():
    """The shared workspace outlives the call that grew it: a server's step loop grows it under
    ``torch.inference_mode`` and a later plain caller (a test, an eval loop) writes into it."""
    g = _gen()
    moe = _moe(g, 5)
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    args = (moe["hidden"], *q13, *q2, moe["topk_weights"], moe["topk_ids"])
    workspace = DequantWorkspace()
    with torch.inference_mode():
        inside = fused_moe_mxfp4_cpu(*args, workspace=workspace)
    outside = fused_moe_mxfp4_cpu(*args, workspace=workspace)
    torch.testing.assert_close(outside, inside, rtol=0, atol=0)


def _moe(g: torch.Generator, tokens: int, dtype: torch.dtype = torch.float32) -> dict:
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    return {
        "hidden": (torch.randn(tokens, H, generator=g) * 3).to(dtype),
        "w13": torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
        "w2": torch.randn(E, H, INTER, generator=g) / INTER**0.5,
        "topk_weights": torch.rand(tokens, K, generator=g),
        "topk_ids": ids,
    }


def _float_path(moe: dict, q13, q2, dtype: torch.dtype, **extra) -> torch.Tensor:
    """The float CPU path on every expert dequantized (the old dequantize-everything path)."""
    w13, w2 = dequantize_mxfp4(*q13, dtype=dtype), dequantize_mxfp4(*q2, dtype=dtype)
    return fused_moe_cpu(moe["hidden"], w13, w2, moe["topk_weights"], moe["topk_ids"], **extra)


@pytest.mark.parametrize("routing", ["balanced", "skewed", "remote", "one_token", "unused"])
def test_layer_equals_dequantize_everything_path(routing: str):
    g = _gen()
    moe = _moe(g, 1 if routing == "one_token" else 13)
    ids = moe["topk_ids"]
    if routing == "skewed":
        ids[:, 0] = E - 1
        ids[:, 1] = torch.where(ids[:, 1] == E - 1, 0, ids[:, 1])
    elif routing == "remote":
        ids[::3, 1] = -1
        ids[1] = torch.tensor([-1, E])  # outside [0, E) on both sides
    elif routing == "unused":  # experts 0..3 get no token
        ids.copy_(ids % 4 + 4)
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] - 3) % 4 + 4, ids[:, 1])
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    args = (moe["hidden"], *q13, *q2, moe["topk_weights"], ids)
    want = _float_path(moe, q13, q2, torch.float32)
    torch.testing.assert_close(fused_moe_mxfp4_cpu(*args), want, rtol=1e-5, atol=1e-5)
    # chunks of one expert each, through a private workspace: the same result
    chunked = fused_moe_mxfp4_cpu(*args, workspace=DequantWorkspace(), max_workspace_bytes=1)
    torch.testing.assert_close(chunked, want, rtol=1e-5, atol=1e-5)
    if routing == "remote":
        assert bool((fused_moe_mxfp4_cpu(*args)[1] == 0).all())
    all_remote = torch.full_like(ids, -1)
    assert fused_moe_mxfp4_cpu(*args[:-1], all_remote).abs().max() == 0


def test_layer_with_clamped_activation_biases_and_bf16():
    g = _gen()
    moe = _moe(g, 9)
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)
    extra = {"activation": GPT_OSS, "b13": b13, "b2": b2}
    got = fused_moe_mxfp4_cpu(moe["hidden"], *q13, *q2, moe["topk_weights"], moe["topk_ids"],
                              **extra)  # fmt: skip
    deq13, deq2 = dequantize_mxfp4(*q13, dtype=torch.float64), dequantize_mxfp4(*q2, torch.float64)
    want = fused_moe_reference(
        moe["hidden"].double(), deq13, deq2, moe["topk_weights"], moe["topk_ids"],
        activation=GPT_OSS, b13=b13.double(), b2=b2.double(),
    )  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = fused_moe_reference(
        moe["hidden"].double(), deq13, deq2, moe["topk_weights"], moe["topk_ids"]
    )
    assert (plain - want).norm() > 0.05 * want.norm()  # the activation and biases matter here
    hidden16 = moe["hidden"].to(torch.bfloat16)
    got16 = fused_moe_mxfp4_cpu(hidden16, *q13, *q2, moe["topk_weights"], moe["topk_ids"],
                                **extra)  # fmt: skip
    want16 = _float_path(dict(moe, hidden=hidden16), q13, q2, torch.bfloat16,
                         activation=GPT_OSS, b13=b13.bfloat16(), b2=b2.bfloat16())  # fmt: skip
    assert got16.dtype == torch.bfloat16
    assert (got16.double() - want16.double()).norm() < 1e-2 * want16.double().norm()


def test_quantized_experts_mxfp4_forward_uses_the_fast_path_exactly():
    g = _gen()
    moe = _moe(g, 6)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)
    experts = QuantizedExperts(
        moe["w13"], moe["w2"], "mxfp4", 32, activation=GPT_OSS, b13=b13, b2=b2
    )
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    got = experts(moe["hidden"], moe["topk_weights"], moe["topk_ids"])
    want = _float_path(moe, q13, q2, torch.float32, activation=GPT_OSS, b13=b13, b2=b2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = QuantizedExperts(moe["w13"], moe["w2"], "mxfp4", 32)
    torch.testing.assert_close(
        plain(moe["hidden"], moe["topk_weights"], moe["topk_ids"]),
        _float_path(moe, q13, q2, torch.float32),
        rtol=1e-5,
        atol=1e-5,
    )
