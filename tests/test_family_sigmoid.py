"""Sigmoid-routed and related MoE families (issue 43) against transformers 5.24, token-exact on
tiny float32 random checkpoints (`tests/family_check.py`): dots1, EXAONE-MoE, Cohere2-MoE,
Solar-Open, HY-V3.

Each checkpoint's config exercises the family's variants: dense-first layers, sliding/global
mixes with windows (<= 32 tokens) shorter than the 37/70-token prompts, NoPE global layers,
shared experts, group-limited routing, the parallel block with LayerNorm and logit scale.
Parameters transformers initialises to zero or one (correction biases, norms) are drawn.
"""

from __future__ import annotations

import os

import pytest
from family_check import (
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    make_family_checkpoint,
)

#: Every norm weight and router correction bias, drawn rather than left at 1 / 0.
DRAWN = ("norm.weight", "layernorm.weight", "e_score_correction_bias")

EP_ALL = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of the other families of this module runs with MOE_ENGINE_FAMILY_EP=all",
)

DOTS1 = {
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "attention_bias": True,
    "sliding_window": 24,
    "max_window_layers": 1,
}


@pytest.fixture(scope="module")
def dots1_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("dots1", DOTS1, root, drawn=DRAWN + ("bias",))


def test_dots1_token_exact(dots1_ckpt):
    check_token_exact(dots1_ckpt)


def test_dots1_prefix_cache(dots1_ckpt):
    check_prefix_cache(dots1_ckpt)


@EP_ALL
def test_dots1_ep2(dots1_ckpt):
    check_ep_token_exact(dots1_ckpt, 2)


EXAONE_MOE = {
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "sliding_window": 20,
    "sliding_window_pattern": 2,
}


@pytest.fixture(scope="module")
def exaone_moe_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("exaone_moe", EXAONE_MOE, root, drawn=DRAWN)


def test_exaone_moe_token_exact(exaone_moe_ckpt):
    """Sliding layers 0, 2 with rope; global layers 1, 3 without (NoPE)."""
    check_token_exact(exaone_moe_ckpt)


def test_exaone_moe_prefix_cache(exaone_moe_ckpt):
    check_prefix_cache(exaone_moe_ckpt)


@EP_ALL
def test_exaone_moe_ep2(exaone_moe_ckpt):
    check_ep_token_exact(exaone_moe_ckpt, 2)


COHERE2_MOE = {
    "num_hidden_layers": 4,
    "intermediate_size": 32,
    "prefix_dense_intermediate_size": 96,
    "first_k_dense_replace": 1,
    "num_experts": 8,
    "num_shared_experts": 1,
    "shared_expert_combination_strategy": "average",
    "expert_selection_fn": "sigmoid",
    "norm_topk_prob": True,
    "sliding_window": 20,
    "sliding_window_pattern": 2,
    "logit_scale": 0.5,
    "attention_bias": True,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": None,  # LayerNorm of layer_norm_eps
    "layer_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def cohere2_moe_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("cohere2_moe", COHERE2_MOE, root, drawn=DRAWN + ("bias",))


def test_cohere2_moe_token_exact(cohere2_moe_ckpt):
    """Parallel blocks with LayerNorm; dense layer 0 global with rope, sliding layers 1, 3 with
    interleaved rope, global layer 2 NoPE; sigmoid routing; shared experts averaged; tied
    embeddings; logits scaled."""
    check_token_exact(cohere2_moe_ckpt)


def test_cohere2_moe_prefix_cache(cohere2_moe_ckpt):
    check_prefix_cache(cohere2_moe_ckpt)


@EP_ALL
def test_cohere2_moe_ep2(cohere2_moe_ckpt):
    check_ep_token_exact(cohere2_moe_ckpt, 2)


SOLAR_OPEN = {
    "num_hidden_layers": 2,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "attention_bias": True,
}


@pytest.fixture(scope="module")
def solar_open_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("solar_open", SOLAR_OPEN, root, drawn=DRAWN + ("bias",))


def test_solar_open_token_exact(solar_open_ckpt):
    check_token_exact(solar_open_ckpt)


def test_solar_open_prefix_cache(solar_open_ckpt):
    check_prefix_cache(solar_open_ckpt)


@EP_ALL
def test_solar_open_ep2(solar_open_ckpt):
    check_ep_token_exact(solar_open_ckpt, 2)


HY_V3 = {
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_shared_experts": 2,
    "router_scaling_factor": 2.5,
    "mlp_bias": True,
    "attention_bias": True,
}


@pytest.fixture(scope="module")
def hy_v3_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("hy_v3", HY_V3, root, drawn=DRAWN + ("bias",))


def test_hy_v3_token_exact(hy_v3_ckpt):
    """Dense layer 0 and shared experts with biases (`mlp_bias`); the hub's router names."""
    check_token_exact(hy_v3_ckpt)


def test_hy_v3_prefix_cache(hy_v3_ckpt):
    check_prefix_cache(hy_v3_ckpt)


@EP_ALL
def test_hy_v3_ep2(hy_v3_ckpt):
    check_ep_token_exact(hy_v3_ckpt, 2)


AFMOE = {
    "num_hidden_layers": 4,
    "num_dense_layers": 1,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_shared_experts": 1,
    "route_scale": 1.5,
    "global_attn_every_n_layers": 2,
    "sliding_window": 20,
    "mup_enabled": True,
}


@pytest.fixture(scope="module")
def afmoe_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    # transformers initialises the router weight to zeros and the expert bias to zeros
    drawn = DRAWN + ("expert_bias", "router.gate.weight")
    return make_family_checkpoint("afmoe", AFMOE, root, drawn=drawn)


def test_afmoe_token_exact(afmoe_ckpt):
    """Sandwich norms, gated attention, NoPE global layers 1, 3, muP embedding scale."""
    check_token_exact(afmoe_ckpt)


def test_afmoe_prefix_cache(afmoe_ckpt):
    check_prefix_cache(afmoe_ckpt)


@EP_ALL
def test_afmoe_ep2(afmoe_ckpt):
    check_ep_token_exact(afmoe_ckpt, 2)
