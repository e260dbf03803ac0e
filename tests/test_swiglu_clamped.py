"""gpt-oss's clamped SwiGLU and expert biases on the CPU expert paths, against Hugging Face
`transformers`' own `GptOssExperts` (the semantics' source), on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.reference import fused_moe_reference
from kernels.moe.torch_cpu import fused_moe_cpu
from kernels.moe.torch_int4 import fused_moe_int4_cpu, pack_int4_for_cpu
from quant.int4 import dequantize_int4, quantize_int4
from quant.packing import unpack_nibbles

H, INTER, E, K = 32, 32, 6, 2


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _inputs(g: torch.Generator, tokens: int, dtype=torch.float64) -> dict:
    """Activations scaled so that gate/up often pass the limit 7 (the clamp cuts)."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    return {
        "hidden": (torch.randn(tokens, H, generator=g) * 6).to(dtype),
        "w13": (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype),
        "w2": (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype),
        "topk_weights": torch.softmax(torch.randn(tokens, K, generator=g), dim=-1),
        "topk_ids": ids,
        "b13": torch.randn(E, 2 * INTER, generator=g).to(dtype),
        "b2": torch.randn(E, H, generator=g).to(dtype),
    }


def _hf_gpt_oss_experts(inp: dict) -> torch.Tensor:
    """`transformers`' GptOssExperts on the same weights in its layout: gate_up_proj
    [E, H, 2I] with gate and up columns interleaved (gate even, up odd), down_proj [E, I, H]."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    experts = gpt_oss.GptOssExperts(config).double()
    gate, up = inp["w13"].double().chunk(2, dim=1)  # [E, I, H] each
    interleaved = torch.stack([gate, up], dim=2).reshape(E, 2 * INTER, H)  # rows g0 u0 g1 u1
    b_gate, b_up = inp["b13"].double().chunk(2, dim=1)
    with torch.no_grad():
        experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([b_gate, b_up], dim=2).reshape(E, -1))
        experts.down_proj.copy_(inp["w2"].double().transpose(1, 2))
        experts.down_proj_bias.copy_(inp["b2"].double())
        return experts(
            inp["hidden"].double(), inp["topk_ids"].long(), inp["topk_weights"].double()
        )


GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)


def test_reference_and_cpu_path_match_transformers_gpt_oss_experts():
    g = _gen()
    inp = _inputs(g, 11)
    want = _hf_gpt_oss_experts(inp)
    ref = fused_moe_reference(**inp, activation=GPT_OSS)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    batched = fused_moe_cpu(**inp, activation=GPT_OSS)  # balanced: the padded bmm path
    torch.testing.assert_close(batched, want, rtol=1e-10, atol=1e-10)
    skewed = dict(inp, topk_ids=inp["topk_ids"].clone())
    skewed["topk_ids"][:, 0] = 2
    second = skewed["topk_ids"][:, 1]
    skewed["topk_ids"][:, 1] = torch.where(second == 2, 3, second)
    torch.testing.assert_close(  # every token on expert 2: the per-expert loop path
        fused_moe_cpu(**skewed, activation=GPT_OSS),
        _hf_gpt_oss_experts(skewed),
        rtol=1e-10,
        atol=1e-10,
    )
    # the clamp, the variant and the biases each change the result on these inputs
    no_clamp = fused_moe_reference(**inp, activation=SwiGLU(alpha=1.702))
    assert (no_clamp - want).norm() > 0.05 * want.norm()
    plain = fused_moe_reference(**inp, activation=SILU_AND_MUL)
    assert (plain - want).norm() > 0.05 * want.norm()


def test_skipped_slots_stay_zero_with_biases():
    g = _gen()
    inp = _inputs(g, 5)
    inp["topk_ids"][1] = -1  # token 1 has no expert on this rank: no bias reaches it either
    for fn in (fused_moe_reference, fused_moe_cpu):
        out = fn(**inp, activation=GPT_OSS)
        assert bool((out[1] == 0).all())


def test_activation_defaults_and_validation():
    x = torch.randn(4, 2 * INTER, dtype=torch.float64)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SwiGLU()(x), torch.nn.functional.silu(gate) * up)
    want = (up.clamp(-7, 7) + 1) * gate.clamp(max=7) * torch.sigmoid(1.702 * gate.clamp(max=7))
    torch.testing.assert_close(GPT_OSS(x), want)
    assert not SwiGLU().clamped and GPT_OSS.clamped
    with pytest.raises(ValueError, match="alpha"):
        SwiGLU(limit=7.0)
    with pytest.raises(ValueError, match="positive"):
        SwiGLU(alpha=1.0, limit=0.0)


def test_int4_cpu_path_with_clamped_activation_and_biases():
    """The int4 CPU path (bfloat16 activations into the packed matmul) against the float64
    reference on the dequantized weights: within bfloat16 precision."""
    g = _gen()
    inp = _inputs(g, 9, dtype=torch.float32)
    inp["topk_ids"][0, 1] = -1
    packed13, s13, _ = quantize_int4(inp["w13"], 32)
    packed2, s2, _ = quantize_int4(inp["w2"], 32)
    w13 = [pack_int4_for_cpu(c, s, 32) for c, s in zip(unpack_nibbles(packed13), s13, strict=True)]
    w2 = [pack_int4_for_cpu(c, s, 32) for c, s in zip(unpack_nibbles(packed2), s2, strict=True)]
    got = fused_moe_int4_cpu(
        inp["hidden"], w13, w2, 32, inp["topk_weights"], inp["topk_ids"],
        activation=GPT_OSS, b13=inp["b13"], b2=inp["b2"],
    )  # fmt: skip
    deq = dict(
        inp,
        w13=dequantize_int4(packed13, s13, None, dtype=torch.float64),
        w2=dequantize_int4(packed2, s2, None, dtype=torch.float64),
        hidden=inp["hidden"].double(),
        b13=inp["b13"].double(),
        b2=inp["b2"].double(),
    )
    want = fused_moe_reference(**deq, activation=GPT_OSS)
    assert ((got.double() - want).norm() / want.norm()) < 2e-2
    plain = fused_moe_reference(**deq)
    assert ((got.double() - plain).norm() / want.norm()) > 5e-2  # the activation was applied
