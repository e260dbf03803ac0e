"""dots3's text decoder (`dots3_note_text`, HF `Dots3NoteForCausalLM`) against transformers
5.24 (`tests/family_check.py`): a tiny float32 checkpoint whose every layer is MLA with a
DeepSeek Sparse Attention indexer (`index_topk` 8, below the prompts' lengths), the latent
scales, the k_pe norm and the per-head output gate; token-exact with chunked prefill, with
prefix caching, ep 2, the Triton backend; the sliding-window MLA layers transformers makes
by default are refused with the reason.
"""

from __future__ import annotations

import pytest
from family_check import (
    COMMON,
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)
from fixtures import dequantized_experts_copy, hf_greedy

#: 3 layers (0 dense by mlp_layer_types), all "indexed_attention": 4 heads, q LoRA 48, latent
#: 32 + rope 8 (head_dim 32: rope factor 1/4), nope 16, v 16; indexer of 8 heads x 16 dims
#: keeping 8 keys; 8 experts in 2 groups (1 kept), one shared expert of width 24.
DOTS3 = {
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 32,
    "index_topk": 8,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_experts_intermediate_size": 24,
    "routed_scaling_factor": 1.5,
    "num_hidden_layers": 3,
    "mlp_layer_types": ["dense", "sparse", "sparse"],
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "use_sliding_window": False,
    "rope_theta": 10000.0,
}

#: transformers' sliding-window MLA sizes (`swa_*`) at the tiny scale (its defaults are 64 heads).
SWA = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 48,
       "swa_kv_lora_rank": 32, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16,
       "swa_v_head_dim": 16}

#: Parameters transformers initialises to zero / one whose paths the tests must exercise.
DRAWN = ("e_score_correction_bias", "k_norm.weight", "k_norm.bias",
         "k_rope_only_layernorm.weight", "kv_a_layernorm.weight")


@pytest.fixture(scope="module")
def dots3_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "dots3_note_text", DOTS3, tmp_path_factory.mktemp("dots3"), drawn=DRAWN
    )


def test_dots3_token_exact(dots3_ckpt):
    check_token_exact(dots3_ckpt)


def test_dots3_prefix_cache(dots3_ckpt):
    check_prefix_cache(dots3_ckpt)


def test_dots3_ep2(dots3_ckpt):
    check_ep_token_exact(dots3_ckpt, 2)


def test_dots3_int4_experts(dots3_ckpt, tmp_path):
    ref = dequantized_experts_copy(dots3_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512, (37,))
    check_token_exact(dots3_ckpt, prompts=prompts, expected=hf_greedy(ref, prompts, 8),
                      quantization="int4", quant_group_size=32)


def test_dots3_triton_backend(dots3_ckpt):
    check_token_exact(dots3_ckpt, kernel_backend="triton", prompts=family_prompts(512, (1, 37)),
                      max_new=4)


@pytest.mark.parametrize("extra, match", [
    ({"use_sliding_window": True, **SWA}, r"sliding_attention.*sliding-window MLA"),
    ({"use_dsa": False}, r"full_attention"),
])
def test_dots3_refuses_sliding_and_dense_mla_layers(extra, match):
    from transformers import AutoConfig

    from moe_engine.models.dots3_note import Dots3NoteForCausalLM

    fields = {**COMMON, **DOTS3, **extra, "num_hidden_layers": 6, "mlp_layer_types": None}
    cfg = AutoConfig.for_model("dots3_note_text", **fields)
    with pytest.raises(ValueError, match=match):
        Dots3NoteForCausalLM.arch_spec(cfg)


def test_dots3_multimodal_config_reads_its_text_config():
    """A "dots3_note" config.json (the published layout, which AutoModelForCausalLM also
    builds as Dots3NoteForCausalLM, saving a "dots3_note_text" config) gives the spec of its
    text config."""
    from transformers import AutoConfig

    from moe_engine.models.dots3_note import Dots3NoteForCausalLM

    fields = {**COMMON, **DOTS3}
    composite = AutoConfig.for_model("dots3_note", **fields, vision_config={"adapter_out_dim": 64},
                                     audio_config={"adapter_out_dim": 64})
    text = AutoConfig.for_model("dots3_note_text", **fields)
    assert Dots3NoteForCausalLM.arch_spec(composite) == Dots3NoteForCausalLM.arch_spec(text)
