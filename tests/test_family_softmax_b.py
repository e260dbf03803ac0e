"""Token-exactness against `transformers` of the families of issue 43's "softmax-b" group:
MiniMax-M2, HunYuan-MoE-V1, ERNIE-4.5-MoE, Mellum, Aria (text), and the refusals of ZAYA and
Doge (`tests/family_check.py` is the harness; each checkpoint is a tiny random one).

Each config exercises its family's variants: MiniMax-M2's q/k norms over the whole
projection, partial rotary and sigmoid routing with a correction bias (drawn non-zero);
HunYuan's q/k norms after the rope, float32 router and shared MLP; ERNIE's dense-first layers,
MoE every 2nd layer, softmax routing with a correction bias, shared experts and biases
everywhere (lm_head included); Mellum's sliding/full mix with a rope base per kind and dense
layers by `mlp_layer_types`; Aria's top-k-then-softmax routing, [E, in, out] experts and
shared experts.
"""

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

ALL_EP = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of this family: set MOE_ENGINE_FAMILY_EP=all (MiniMax-M2 runs it always)",
)

MINIMAX_M2 = {
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "rotary_dim": 8,  # half of head_dim 16
}


@pytest.fixture(scope="module")
def minimax_m2_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "minimax_m2", MINIMAX_M2, tmp_path_factory.mktemp("minimax_m2"),
        drawn=("e_score_correction_bias", "norm.weight"),
    )


def test_minimax_m2_token_exact(minimax_m2_ckpt):
    check_token_exact(minimax_m2_ckpt)


def test_minimax_m2_prefix_cache(minimax_m2_ckpt):
    check_prefix_cache(minimax_m2_ckpt)


def test_minimax_m2_ep2(minimax_m2_ckpt):
    check_ep_token_exact(minimax_m2_ckpt, 2)


def test_minimax_m2_triton(minimax_m2_ckpt):
    check_token_exact(
        minimax_m2_ckpt, kernel_backend="triton", prompts=family_prompts(512, (1, 37)), max_new=4
    )


HUNYUAN_V1_MOE = {
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "num_experts": 8,
    "moe_topk": 2,
    "attention_bias": True,
    # the static NTK-alpha base (transformers' "ntk_alpha"), as Hunyuan-A13B ships it
    "rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 1e4},
}


@pytest.fixture(scope="module")
def hunyuan_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "hunyuan_v1_moe", HUNYUAN_V1_MOE, tmp_path_factory.mktemp("hunyuan_v1_moe"),
        drawn=("layernorm.weight", "bias"),
    )


def test_hunyuan_v1_moe_token_exact(hunyuan_ckpt):
    check_token_exact(hunyuan_ckpt)


def test_hunyuan_v1_moe_prefix_cache(hunyuan_ckpt):
    check_prefix_cache(hunyuan_ckpt)


@ALL_EP
def test_hunyuan_v1_moe_ep2(hunyuan_ckpt):
    check_ep_token_exact(hunyuan_ckpt, 2)


ERNIE4_5_MOE = {
    "num_hidden_layers": 4,  # layer 0 dense (start index 1), then MoE every 2nd: 1 and 3
    "intermediate_size": 48,
    "moe_intermediate_size": 32,
    "moe_num_experts": 8,
    "moe_k": 2,
    "moe_layer_start_index": 1,
    "moe_layer_interval": 2,
    "moe_num_shared_experts": 2,
    "use_bias": True,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def ernie_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "ernie4_5_moe", ERNIE4_5_MOE, tmp_path_factory.mktemp("ernie4_5_moe"),
        drawn=("e_score_correction_bias", "bias"),
    )


def test_ernie4_5_moe_token_exact(ernie_ckpt):
    check_token_exact(ernie_ckpt)


def test_ernie4_5_moe_prefix_cache(ernie_ckpt):
    check_prefix_cache(ernie_ckpt)


@ALL_EP
def test_ernie4_5_moe_ep2(ernie_ckpt):
    check_ep_token_exact(ernie_ckpt, 2)


MELLUM = {
    "num_hidden_layers": 3,
    "intermediate_size": 48,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "sliding_window": 24,  # < the 37- and 70-token prompts
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse"],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
}


@pytest.fixture(scope="module")
def mellum_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "mellum", MELLUM, tmp_path_factory.mktemp("mellum"), drawn=("norm.weight",)
    )


def test_mellum_token_exact(mellum_ckpt):
    check_token_exact(mellum_ckpt)


def test_mellum_prefix_cache(mellum_ckpt):
    check_prefix_cache(mellum_ckpt)


@ALL_EP
def test_mellum_ep2(mellum_ckpt):
    check_ep_token_exact(mellum_ckpt, 2)


ARIA_TEXT = {
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "moe_num_experts": 8,
    "moe_topk": 2,
    "moe_num_shared_experts": 2,
    "mlp_bias": True,
    "attention_bias": True,
}


@pytest.fixture(scope="module")
def aria_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "aria_text", ARIA_TEXT, tmp_path_factory.mktemp("aria_text"), drawn=("bias",)
    )


def test_aria_text_token_exact(aria_ckpt):
    check_token_exact(aria_ckpt)


def test_aria_text_prefix_cache(aria_ckpt):
    check_prefix_cache(aria_ckpt)


@ALL_EP
def test_aria_text_ep2(aria_ckpt):
    check_ep_token_exact(aria_ckpt, 2)


@pytest.mark.parametrize(
    "architecture, fields, lacks",
    [
        ("ZayaForCausalLM", {"cca_time0": 2, "cca_time1": 2},
         "Compressed Convolutional Attention is not implemented"),
        ("DogeForCausalLM", {"keep_window_size": 2048},
         "dynamic-mask attention is not implemented"),
    ],
)
def test_refused_with_what_the_engine_lacks(architecture, fields, lacks):
    """ZAYA and Doge are refused at startup, naming what the engine lacks."""
    from moe_engine.errors import StartupError
    from moe_engine.models import resolve_config_dict

    with pytest.raises(StartupError, match=lacks) as info:
        resolve_config_dict({"architectures": [architecture], **fields})
    assert "?" not in str(info.value)  # every field the message names was read


def test_ernie4_5_moe_int4_experts(ernie_ckpt, tmp_path):
    """4-bit experts (quantized at load, group 32) equal transformers on the same weights
    quantized and dequantized."""
    from fixtures import dequantized_experts_copy, hf_greedy

    prompts = family_prompts(512, (37,))
    reference = dequantized_experts_copy(ernie_ckpt, tmp_path, "int4", 32)
    llm = check_token_exact(
        ernie_ckpt, prompts=prompts, max_new=6, expected=hf_greedy(reference, prompts, 6),
        quantization="int4", quant_group_size=32,
    )
    assert all(m.quantized is not None for _, m in llm.engine.model.moe_layers())
