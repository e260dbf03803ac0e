"""The MLA families of issue 43 against transformers 5.24 (`tests/family_check.py`): GLM-4.7-Flash
(`glm4_moe_lite`), LongCat-Flash (`longcat_flash`), Mistral-Small-4 (`mistral4`), A.X-K1
(`axk1`), each a tiny float32 checkpoint served token-exact with chunked prefill, with prefix
caching on the MLA latent blocks, and the layouts each family's variants exercise.
"""

from __future__ import annotations

import os

import pytest
import torch
from family_check import (
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)

EP_ALL = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of every family: MOE_ENGINE_FAMILY_EP=all (one family of this module runs it)",
)

#: MLA sizes every family here shares: 4 heads, q LoRA 48, latent 32 + rope 8, nope 16, v 16.
MLA = {
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 8,
}

#: GLM-4.7-Flash: 4 layers, layers 0 and 2 dense (mlp_layer_types), 16 experts in 4 groups
#: (2 kept), top-4 sigmoid with a drawn correction bias, 2 shared experts, YaRN with
#: mscale_all_dim, rope on interleaved pairs.
GLM4_MOE_LITE = {
    **MLA,
    "num_hidden_layers": 4,
    "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.8,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}


@pytest.fixture(scope="module")
def glm4_moe_lite_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "glm4_moe_lite", GLM4_MOE_LITE, tmp_path_factory.mktemp("mla"),
        drawn=("e_score_correction_bias",),
    )


def test_glm4_moe_lite_token_exact(glm4_moe_lite_ckpt):
    check_token_exact(glm4_moe_lite_ckpt)


def test_glm4_moe_lite_prefix_cache(glm4_moe_lite_ckpt):
    check_prefix_cache(glm4_moe_lite_ckpt)


@EP_ALL
def test_glm4_moe_lite_ep2(glm4_moe_lite_ckpt):
    check_ep_token_exact(glm4_moe_lite_ckpt, 2)


def test_glm4_moe_lite_refuses_a_first_k_dense_replace_transformers_ignores():
    from moe_engine.models import model_shape

    cfg = {**GLM4_MOE_LITE, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
           "architectures": ["Glm4MoeLiteForCausalLM"], "first_k_dense_replace": 2}
    with pytest.raises(ValueError, match="first_k_dense_replace 2 disagrees"):
        model_shape(cfg)
    shape = model_shape({**cfg, "first_k_dense_replace": None})
    assert shape.moe_layers == (1, 3) and shape.intermediate_size == 96


def test_glm4_moe_lite_triton_backend(glm4_moe_lite_ckpt):
    """The Triton kernels (interpreted on a CPU): fused MoE, the sigmoid router, the absorbed
    MLA decode and its prologue."""
    check_token_exact(
        glm4_moe_lite_ckpt, kernel_backend="triton", prompts=family_prompts(512, (1, 37)),
        max_new=4,
    )


#: LongCat-Flash: 2 layers (4 MLA sublayers), shortcut MoE of 8 experts + 4 zero-computation
#: (identity) experts, top-3 softmax with a drawn correction bias, scaling 6.
LONGCAT_FLASH = {
    **MLA,
    "num_layers": 2,
    "num_hidden_layers": None,
    "ffn_hidden_size": 96,
    "expert_ffn_hidden_size": 32,
    "n_routed_experts": 8,
    "zero_expert_num": 4,
    "moe_topk": 3,
    "num_experts_per_tok": None,
    "routed_scaling_factor": 6.0,
}


@pytest.fixture(scope="module")
def longcat_flash_ckpt(tmp_path_factory):
    """Scaled so that the shortcut MoE and its zero-computation experts decide the greedy ids:
    with every weight N(0, 0.5) the two dense MLPs and attentions of a layer dwarf the MoE and
    one expert takes all the routing weight; here the router's softmax is flat (about a
    quarter of the picks are identity experts, weight ~0.7 each) and the stream's other
    parts are of the MoE's size."""
    ckpt = make_family_checkpoint(
        "longcat_flash", LONGCAT_FLASH, tmp_path_factory.mktemp("mla"),
        drawn=("e_score_correction_bias",),
    )
    return _scaled(ckpt, {r"router\.classifier\.weight": 0.1, "e_score_correction_bias": 0.05,
                          r"mlps\.\d\.down_proj": 0.02, r"experts\.\d+\.down_proj": 0.05,
                          r"o_proj": 0.1})


def _scaled(ckpt, factors: dict[str, float]):
    """`ckpt` with each tensor whose name matches a pattern of `factors` (`re.search`)
    multiplied by its factor."""
    import re

    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        for pattern, factor in factors.items():
            if re.search(pattern, name):
                tensors[name] = tensor * factor
    save_file(tensors, path, metadata={"format": "pt"})
    return ckpt


def test_longcat_flash_token_exact(longcat_flash_ckpt):
    check_token_exact(longcat_flash_ckpt)


def test_longcat_flash_prefix_cache(longcat_flash_ckpt):
    check_prefix_cache(longcat_flash_ckpt)


def test_longcat_flash_ep2(longcat_flash_ckpt):
    """Zero-computation experts' slots (-1) through the all-to-all: they go to no rank."""
    check_ep_token_exact(longcat_flash_ckpt, 2)


#: Mistral-Small-4: 3 layers, layer 0 dense, direct q_proj (no q LoRA), 16 experts in 4 groups
#: (2 kept) top-4 by softmax, one shared expert; YaRN with the Llama-4 query scaling over a
#: 16-token period, so the 37/70-token prompts reach scales 1 + log(1 + floor(p / 16)) > 1
#: (q_proj scaled down in the fixture so that attention is soft enough to feel them).
MISTRAL4 = {
    **MLA,
    "q_lora_rank": None,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "head_dim": None,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 64.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 1.0,
    },
}


@pytest.fixture(scope="module")
def mistral4_ckpt(tmp_path_factory):
    """transformers 5.24 maps no config to `Mistral4ForCausalLM` in `AutoModelForCausalLM`
    (Mistral-Small-4 ships as `Mistral3ForConditionalGeneration`): registered here, for the
    checkpoint and the oracle."""
    from transformers import AutoModelForCausalLM, Mistral4Config, Mistral4ForCausalLM

    AutoModelForCausalLM.register(Mistral4Config, Mistral4ForCausalLM, exist_ok=True)
    ckpt = make_family_checkpoint("mistral4", MISTRAL4, tmp_path_factory.mktemp("mla"))
    return _scaled(ckpt, {r"self_attn\.q_proj": 0.05})


def test_mistral4_token_exact(mistral4_ckpt):
    check_token_exact(mistral4_ckpt)


def test_mistral4_prefix_cache(mistral4_ckpt):
    check_prefix_cache(mistral4_ckpt)


@EP_ALL
def test_mistral4_ep2(mistral4_ckpt):
    check_ep_token_exact(mistral4_ckpt, 2)


#: A.X-K1: 4 layers, MoE every 2nd from layer 0 (first_k_dense_replace 0, moe_layer_freq 2:
#: layers 0 and 2), each MoE output through post_mlp_layernorm (drawn), 16 experts in 4
#: groups (2 kept), top-4 sigmoid, one shared expert.
AXK1 = {
    **MLA,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 2,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
}


@pytest.fixture(scope="module")
def axk1_ckpt(tmp_path_factory):
    """As the released checkpoints hold it: a `post_mlp_layernorm` for dense layer 1 too
    (unused), and layer 2's router without `e_score_correction_bias` (zero)."""
    from safetensors.torch import load_file, save_file

    ckpt = make_family_checkpoint(
        "axk1", AXK1, tmp_path_factory.mktemp("mla"),
        drawn=("e_score_correction_bias", "post_mlp_layernorm.weight"),
    )
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    tensors["model.layers.1.post_mlp_layernorm.weight"] = torch.full((64,), 3.0)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def test_axk1_token_exact(axk1_ckpt):
    check_token_exact(axk1_ckpt)


def test_axk1_prefix_cache(axk1_ckpt):
    check_prefix_cache(axk1_ckpt)


@EP_ALL
def test_axk1_ep2(axk1_ckpt):
    check_ep_token_exact(axk1_ckpt, 2)


def test_glm4_moe_lite_int4_experts(glm4_moe_lite_ckpt, tmp_path):
    """`--quantization int4` experts against transformers on the int4 quantize-dequantize
    copy of the checkpoint."""
    from fixtures import dequantized_experts_copy, hf_greedy

    prompts = family_prompts(512, (11, 37))
    expected = hf_greedy(dequantized_experts_copy(glm4_moe_lite_ckpt, tmp_path, "int4", 32),
                         prompts, 6)
    llm = check_token_exact(glm4_moe_lite_ckpt, prompts=prompts, max_new=6, expected=expected,
                            quantization="int4", quant_group_size=32)
    assert all(m.quantized is not None for _, m in llm.engine.model.moe_layers())


# -- the shared pieces these families added ----------------------------------------------


def test_zero_experts_leave_the_routing_and_reach_no_rank():
    """`split_zero_experts`: ids >= E become -1 with weight 0, their weights summed per token;
    `ExpertPlacement.route` sends a -1 slot to the source rank's slot -1 (with and without
    replicas); the load recorder counts the real experts only."""
    from comm import ExpertPlacement
    from moe_engine.instrumentation import ExpertLoadRecorder
    from moe_engine.models.layers.routing import split_zero_experts

    weights = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]])
    ids = torch.tensor([[3, 5, 1], [6, 4, 7]], dtype=torch.int32)
    w, i, zero = split_zero_experts(weights, ids, num_experts=4)
    assert i.tolist() == [[3, -1, 1], [-1, -1, -1]] and i.dtype == torch.int32
    assert w.tolist() == [[0.5, 0.0, 0.125], [0.0, 0.0, 0.0]]
    assert zero.tolist() == [[0.25], [7.0]]
    for placement in (ExpertPlacement(4, 2), ExpertPlacement(4, 2, [[0, 1, 3], [2, 3, 0]])):
        rank, slot = placement.route(i, src_rank=1)
        assert rank[1].tolist() == [1, 1, 1] and slot[1].tolist() == [-1, -1, -1]
        assert slot[0, 1] == -1 and rank[0, 1] == 1
        assert rank[0, 2] == 0 and slot[0, 2] == 1  # expert 1: rank 0, slot 1
    recorder = ExpertLoadRecorder([0], 4)
    recorder.record(0, i, skip_negative=True)
    assert recorder.counts[0].tolist() == [0, 1, 0, 1]


def test_softmax_grouped_router_triton_equals_torch():
    """The Triton router with `scoring="softmax"` (interpreted on a CPU) picks the torch
    function's experts and weights: with a correction bias and no groups (LongCat-Flash), and
    with groups and no bias (Mistral-4)."""
    from kernels.moe.router_kernels import fused_sigmoid_grouped_topk
    from moe_engine.models.layers.routing import sigmoid_grouped_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.05
    for args in ((3, bias, 1, 1, False, 6.0), (4, None, 4, 2, True, 1.5)):
        want = sigmoid_grouped_topk(logits, *args, scoring="softmax")
        got = fused_sigmoid_grouped_topk(logits, *args, scoring="softmax")
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("zero_expert_type", "zero", "zero_expert_type 'zero' is not supported"),
    ("mla_scale_q_lora", False, "mla_scale_q_lora False is not supported"),
    ("router_bias", True, "router_bias true is not supported"),
    ("qk_head_dim", 32, "qk_head_dim 32 must be"),
])
def test_longcat_flash_refuses_what_transformers_computes_otherwise(field, value, message):
    from moe_engine.models import model_shape

    cfg = {**LONGCAT_FLASH, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
           "architectures": ["LongcatFlashForCausalLM"], field: value}
    with pytest.raises(ValueError, match=message):
        model_shape(cfg)
    shape = model_shape({**cfg, field: None})
    assert (shape.num_layers, shape.moe_layers, shape.zero_experts) == (4, (0, 2), 4)
