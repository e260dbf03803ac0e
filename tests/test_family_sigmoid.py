"""Sigmoid-routed and related MoE families (issue 43) against transformers 5.24, token-exact on
tiny float32 random checkpoints (`tests/family_check.py`): dots1, EXAONE-MoE, Cohere2-MoE,
Solar-Open, HY-V3, AFMoE, Kolibri-1, Laguna, Beam (ep 2: Cohere2-MoE; the others with
MOE_ENGINE_FAMILY_EP=all; Triton: Kolibri-1; int4 experts: dots1).

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
    family_prompts,
    make_family_checkpoint,
)
from fixtures import dequantized_experts_copy, hf_greedy

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


KOLIBRI1 = {
    "num_hidden_layers": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "norm_topk_prob": True,
    "sliding_window": 20,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}


@pytest.fixture(scope="module")
def kolibri1_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("kolibri1", KOLIBRI1, root, drawn=DRAWN)


def test_kolibri1_token_exact(kolibri1_ckpt):
    """Sandwich norms; NoPE global layers 1, 3; the biased logits choose the experts."""
    check_token_exact(kolibri1_ckpt)


def test_kolibri1_prefix_cache(kolibri1_ckpt):
    check_prefix_cache(kolibri1_ckpt)


@EP_ALL
def test_kolibri1_ep2(kolibri1_ckpt):
    check_ep_token_exact(kolibri1_ckpt, 2)


def test_logit_bias_router_kernel_matches_torch():
    """The Triton router's `scoring="logits"` variant (under the interpreter on a CPU) chooses
    and weighs as the torch function, groups and renormalisation included."""
    import torch

    from kernels.moe.router_kernels import fused_sigmoid_grouped_topk
    from moe_engine.models.layers.routing import sigmoid_grouped_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 16, generator=g)
    bias = torch.randn(16, generator=g)
    for n_group, topk_group, norm in ((1, 1, True), (4, 2, False)):
        args = (logits, 3, bias, n_group, topk_group, norm, 1.5)
        got_w, got_ids = fused_sigmoid_grouped_topk(*args, scoring="logits")
        want_w, want_ids = sigmoid_grouped_topk(*args, scoring="logits")
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w)
        # the choice differs from the biased-sigmoid rule's on these inputs
        assert not torch.equal(sigmoid_grouped_topk(*args)[1], want_ids)


def test_kolibri1_triton(kolibri1_ckpt):
    """The Triton backend (interpreted on a CPU): its fused router's biased-logit choice, the
    paged attention with NoPE and sliding layers."""
    prompts = family_prompts(512, (1, 37))
    check_token_exact(kolibri1_ckpt, kernel_backend="triton", prompts=prompts, max_new=4)


def test_dots1_int4_experts(dots1_ckpt, tmp_path):
    """4-bit routed experts (group 32) equal transformers serving the same experts quantized
    and dequantized."""
    oracle = dequantized_experts_copy(dots1_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512)
    check_token_exact(dots1_ckpt, prompts=prompts, expected=hf_greedy(oracle, prompts, 8),
                      quantization="int4", quant_group_size=32)


def test_cohere2_moe_ep2(cohere2_moe_ckpt):
    """Expert parallelism over 2 ranks: the averaged shared experts added after combine."""
    check_ep_token_exact(cohere2_moe_ckpt, 2)


def test_exaone_moe_mtp_tensors_unread(exaone_moe_ckpt):
    """K-EXAONE's `mtp.*` tensors are skipped unread, as transformers ignores them."""
    import torch
    from transformers import AutoConfig

    from moe_engine.models.exaone_moe import ExaoneMoeForCausalLM

    spec = ExaoneMoeForCausalLM.arch_spec(AutoConfig.from_pretrained(exaone_moe_ckpt))
    model = ExaoneMoeForCausalLM(spec, torch.float32)
    name = "mtp.layers.0.eh_proj.weight"
    assert not model.wants_weight(name)
    assert model.load_weights([(name, torch.zeros(2, 2))]) == set()


LAGUNA = {
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_attention_heads_per_layer": [4, 2, 4],
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 20,
    "gating": "per-head",
    "moe_routed_scaling_factor": 1.5,
}


@pytest.fixture(scope="module")
def laguna_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("laguna", LAGUNA, root, drawn=DRAWN)


def test_laguna_token_exact(laguna_ckpt):
    """Per-layer query heads (4, 2, 4), a rope per attention kind (half the head on the full
    layer), the softplus per-head output gate, the scaled routed output."""
    check_token_exact(laguna_ckpt)


def test_laguna_prefix_cache(laguna_ckpt):
    check_prefix_cache(laguna_ckpt)


@EP_ALL
def test_laguna_ep2(laguna_ckpt):
    check_ep_token_exact(laguna_ckpt, 2)


BEAM = {
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "sliding_window": 20,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "final_logit_softcapping": 30.0,
}


@pytest.fixture(scope="module")
def beam_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigmoid")
    return make_family_checkpoint("beam", BEAM, root, drawn=DRAWN + ("gate_bias",))


def test_beam_token_exact(beam_ckpt):
    """Depth-scaled residual adds with sandwich norms; sliding layers 0-2 with RoPE, global
    layer 3 with query length scaling; the biased sigmoid output gate; grouped routing; the
    soft-capped logits."""
    check_token_exact(beam_ckpt)


def test_beam_prefix_cache(beam_ckpt):
    check_prefix_cache(beam_ckpt)


@EP_ALL
def test_beam_ep2(beam_ckpt):
    check_ep_token_exact(beam_ckpt, 2)
