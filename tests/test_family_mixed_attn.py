"""Families of mixed attention kinds (issue 43), served token-exact against transformers
(tests/family_check.py): Llama 4 (chunked local + NoPE full layers; prefix caching, expert
parallelism, the Triton backend), Flint (sliding RoPE + NoPE full layers with sinks; 4-bit
experts) and MiMo-V2-Flash (sliding layers of twice the KV heads with sinks, value heads
narrower than q/k heads); the refusal of Gemma 4 names what the engine lacks."""

from __future__ import annotations

import os

import pytest
from family_check import (
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)

from moe_engine.errors import StartupError
from moe_engine.models import resolve_config_dict

ALL_EP = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of this family runs with MOE_ENGINE_FAMILY_EP=all (llama4 covers the module)",
)

#: Llama 4: chunks of 16 tokens (one KV block; the 37/70-token prompts span 3-5 chunks), layers
#: 0, 1, 3 RoPE + chunked with the L2 q/k norm, layer 2 NoPE + full with the temperature
#: (floor_scale 8 so it changes within the prompts), MoE on odd layers (top-1 sigmoid,
#: weight on the input, shared expert), dense MLPs of another width on even ones.
LLAMA4 = dict(
    num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=1, intermediate_size=32,
    intermediate_size_mlp=48, attention_chunk_size=16, interleave_moe_layer_step=2,
    no_rope_layers=[1, 1, 0, 1], floor_scale=8, attn_scale=0.5, rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory):
    return make_family_checkpoint("llama4_text", LLAMA4, tmp_path_factory.mktemp("llama4"))


def test_llama4_token_exact(llama4_ckpt):
    llm = check_token_exact(llama4_ckpt)
    kinds = [g.spec.kind for g in llm.engine.runner.kv_groups]
    assert kinds.count("chunked_attention") == 3 and kinds.count("full_attention") == 1


@pytest.mark.parametrize("block_size", [16, 8])
def test_llama4_prefix_cache(llama4_ckpt, block_size):
    """Blocks of 16: the 32-token hit ends on a chunk boundary (the chunked group needs no
    block); of 8: the 40-token hit needs the cached block of its chunk (positions 32-39)."""
    check_prefix_cache(llama4_ckpt, block_size=block_size)


#: The other Llama 4 variants: top_k 2 (each (token, expert) pair its own scaled row), Llama 3
#: RoPE scaling (as Scout's; a 32-token original context so that the tiny head's frequencies are
#: divided and smoothed), no q/k norm (as Maverick), no temperature tuning.
LLAMA4_VARIANTS = {
    **LLAMA4, "num_experts_per_tok": 2, "rope_theta": None, "use_qk_norm": False,
    "attn_temperature_tuning": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
}


@pytest.fixture(scope="module")
def llama4_variants_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "llama4_text", LLAMA4_VARIANTS, tmp_path_factory.mktemp("llama4v"), name="llama4-variants"
    )


def test_llama4_variants_block_size_8(llama4_variants_ckpt):
    """The variants with chunks of two 8-token blocks."""
    check_token_exact(llama4_variants_ckpt, block_size=8)


def test_llama4_chunk_not_a_block_multiple_is_refused(llama4_ckpt):
    with pytest.raises(ValueError, match="attention_chunk_size 16 must be a positive multiple"):
        check_token_exact(llama4_ckpt, block_size=32, expected=[])


def test_llama4_triton_backend(llama4_variants_ckpt):
    """Triton: the chunks' virtual batches on the paged kernel, the rope prologue writing the
    chunked layers' cache (no q/k norm: the prologue takes the interleaved rope)."""
    llm = check_token_exact(llama4_variants_ckpt, kernel_backend="triton",
                            prompts=family_prompts(512, (1, 37)), max_new=4)
    assert llm.engine.model.model.layers[0].self_attn.prologue is not None


def test_llama4_ep2(llama4_ckpt):
    check_ep_token_exact(llama4_ckpt, 2)


#: Flint: sliding RoPE layers (window 24) and NoPE full layers, sinks in both, a dense first
#: layer, sigmoid top-2 routing renormalised with an ungated shared expert; norms drawn.
FLINT = dict(
    num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, intermediate_size=64, mlp_only_layers=[0],
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=24, rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def flint_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "flint", FLINT, tmp_path_factory.mktemp("flint"), drawn=("norm.weight",)
    )


def test_flint_token_exact(flint_ckpt):
    check_token_exact(flint_ckpt)


def test_flint_prefix_cache(flint_ckpt):
    check_prefix_cache(flint_ckpt)


@ALL_EP
def test_flint_ep2(flint_ckpt):
    check_ep_token_exact(flint_ckpt, 2)


#: MiMo-V2-Flash: full layers 0 and 3 with 1 KV head, sliding layers (window 20) with 2 and
#: sinks; q/k heads of 48 dims (16 rotated, a theta per layer type), values of 32 scaled by
#: 0.6; a dense first layer, then DeepSeek-V3 routing over 2 groups with a scaling factor;
#: q/k/v biases and the correction bias drawn.
MIMO = dict(
    num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=64, num_key_value_heads=1, head_dim=48, v_head_dim=32,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=20, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, attention_bias=True, attention_value_scale=0.6,
)


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "mimo_v2_flash", MIMO, tmp_path_factory.mktemp("mimo"), drawn=("bias",)
    )


def test_mimo_v2_flash_token_exact(mimo_ckpt):
    llm = check_token_exact(mimo_ckpt)
    full = llm.engine.model.model.layers[0].self_attn
    assert (full.layer_kv_heads, full.kv_repeat, full.v_head_dim) == (1, 2, 32)


def test_mimo_v2_flash_prefix_cache(mimo_ckpt):
    check_prefix_cache(mimo_ckpt)


@ALL_EP
def test_mimo_v2_flash_ep2(mimo_ckpt):
    check_ep_token_exact(mimo_ckpt, 2)


def test_gemma4_refused_with_what_the_engine_lacks():
    fields = dict(enable_moe_block=True, hidden_activation="gelu_pytorch_tanh")
    with pytest.raises(StartupError, match="hidden_activation=gelu_pytorch_tanh"):
        resolve_config_dict({"architectures": ["Gemma4ForCausalLM"], **fields})


def test_flint_int4_experts(flint_ckpt, tmp_path):
    """4-bit experts (int4, groups of 32) equal transformers serving the same experts
    quantized and dequantized."""
    from fixtures import dequantized_experts_copy, hf_greedy

    prompts = family_prompts(512, (11, 37))
    expected = hf_greedy(dequantized_experts_copy(flint_ckpt, tmp_path, "int4", 32), prompts, 6)
    llm = check_token_exact(flint_ckpt, prompts=prompts, max_new=6, expected=expected,
                            quantization="int4", quant_group_size=32)
    assert all(m.quantized is not None for _, m in llm.engine.model.moe_layers())
