"""OLMoE, FlexOlmo, PhiMoE, GraniteMoE, GraniteMoeShared and DBRX against transformers 5.24
on tiny float32 random checkpoints (`tests/family_check.py`): greedy ids token-exact with
chunked prefill (prompts of 1-70 tokens over a 16-token budget), with prefix caching, under
--ep-size 2 (one family here, the others with MOE_ENGINE_FAMILY_EP=all), with 4-bit experts
(against the dequantized checkpoint) and on the Triton backend (under the interpreter).
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
    reason="ep 2 of every family costs ~8 s each: set MOE_ENGINE_FAMILY_EP=all",
)

#: OLMoE: 2 layers, 8 experts of width 32, renormalised top-2, a clamp the random weights
#: reach (the q/k norms make |q|, |k| ~ 1 and more).
OLMOE = dict(num_hidden_layers=2, num_experts=8, intermediate_size=32, norm_topk_prob=True,
             clip_qkv=1.5)
#: FlexOlmo: 3 post-norm layers, 8 experts, top-2 not renormalised.
FLEX_OLMO = dict(num_hidden_layers=3, num_experts=8, intermediate_size=32,
                 norm_topk_prob=False)

#: PhiMoE: 2 layers, 8 experts, a 24-token window over every layer (the 37/70-token prompts
#: exceed it), q/k/v/o and LM head biases, a wide SparseMixer margin so both experts' weights
#: mix several logits.
PHIMOE = dict(num_hidden_layers=2, num_local_experts=8, intermediate_size=32, sliding_window=24,
              attention_bias=True, lm_head_bias=True, router_jitter_noise=0.5)
#: Parameters transformers initialises to zero or one, drawn: every bias, the LayerNorms' weights.
PHIMOE_DRAWN = ("bias", "layernorm.weight", "norm.weight")

#: Granite MoE: 2 layers, 8 experts, every multiplier away from 1, q/k/v/o biases.
GRANITE = dict(num_hidden_layers=2, num_local_experts=8, intermediate_size=32,
               embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5,
               logits_scaling=3.0, attention_bias=True)
#: GraniteMoeShared: 3 layers, 16 experts, a shared MLP of width 48.
GRANITE_SHARED = dict(GRANITE, num_hidden_layers=3, num_local_experts=16,
                      shared_intermediate_size=48)

#: DBRX: 3 layers, 8 experts of width 32, top-2 renormalised, a clamp of the fused q/k/v
#: output the random weights reach (transformers 5.24 reads attn_config.rope_theta to build
#: DBRX's attention, though its rotary takes rope_parameters).
#: DBRX's own keys replace COMMON's aliases of them (set after its sub-configs are sized).
DBRX = dict(n_layers=3, d_model=64, n_heads=4, max_seq_len=1024,
            attn_config=dict(kv_n_heads=2, clip_qkv=3.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
            hidden_size=None, num_attention_heads=None, num_key_value_heads=None, head_dim=None,
            num_experts_per_tok=None, max_position_embeddings=None)

#: JetMoE: 2 layers, 8 attention and 8 MLP experts, top-2 (4 query heads over 2 KV heads
#: of 16 dims), the attention's and MLP's output biases drawn.
JETMOE = dict(num_hidden_layers=2, num_local_experts=8, intermediate_size=32, kv_channels=16,
              num_key_value_heads=2, head_dim=None)


@pytest.fixture(scope="module")
def olmoe_ckpt(tmp_path_factory):
    return make_family_checkpoint("olmoe", OLMOE, tmp_path_factory.mktemp("olmoe"))


@pytest.fixture(scope="module")
def flex_olmo_ckpt(tmp_path_factory):
    return make_family_checkpoint("flex_olmo", FLEX_OLMO, tmp_path_factory.mktemp("flex_olmo"))


# -- OLMoE ------------------------------------------------------------------------------------


def test_olmoe_token_exact(olmoe_ckpt):
    check_token_exact(olmoe_ckpt)


def test_olmoe_prefix_cache(olmoe_ckpt):
    check_prefix_cache(olmoe_ckpt)


def test_olmoe_int4_experts(olmoe_ckpt, tmp_path):
    """Experts quantized to int4 at load (group 32) serve the greedy ids transformers gives
    on the checkpoint whose experts went through the same quantize -> dequantize."""
    from fixtures import dequantized_experts_copy, hf_greedy

    oracle = dequantized_experts_copy(olmoe_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512)
    llm = check_token_exact(olmoe_ckpt, prompts=prompts, expected=hf_greedy(oracle, prompts, 8),
                            quantization="int4", quant_group_size=32)
    assert llm.engine.model_info().expert_weight_format == "int4"


@ALL_EP
def test_olmoe_ep2(olmoe_ckpt):
    check_ep_token_exact(olmoe_ckpt, 2)


# -- FlexOlmo ---------------------------------------------------------------------------------


def test_flex_olmo_token_exact(flex_olmo_ckpt):
    check_token_exact(flex_olmo_ckpt)


def test_flex_olmo_prefix_cache(flex_olmo_ckpt):
    check_prefix_cache(flex_olmo_ckpt)


@ALL_EP
def test_flex_olmo_ep2(flex_olmo_ckpt):
    check_ep_token_exact(flex_olmo_ckpt, 2)


# -- PhiMoE -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phimoe_ckpt(tmp_path_factory):
    return make_family_checkpoint("phimoe", PHIMOE, tmp_path_factory.mktemp("phimoe"),
                                  drawn=PHIMOE_DRAWN)


def test_phimoe_token_exact(phimoe_ckpt):
    check_token_exact(phimoe_ckpt)


def test_phimoe_prefix_cache(phimoe_ckpt):
    check_prefix_cache(phimoe_ckpt)


def test_phimoe_ep2(phimoe_ckpt):
    """The family with the most new MoE code here (SparseMixer routing) runs ep 2 always."""
    check_ep_token_exact(phimoe_ckpt, 2)


# -- Granite MoE ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def granitemoe_ckpt(tmp_path_factory):
    return make_family_checkpoint("granitemoe", GRANITE, tmp_path_factory.mktemp("granitemoe"),
                                  drawn=("bias",))


@pytest.fixture(scope="module")
def granitemoeshared_ckpt(tmp_path_factory):
    return make_family_checkpoint("granitemoeshared", GRANITE_SHARED,
                                  tmp_path_factory.mktemp("granitemoeshared"), drawn=("bias",))


def test_granitemoe_token_exact_and_logits_scaled(granitemoe_ckpt):
    """Greedy ids exact; the last position's logits (divided by `logits_scaling`, which
    greedy ids cannot see) within 1e-4 of transformers'."""
    from fixtures import hf_last_logits

    from moe_engine import SamplingParams

    llm = check_token_exact(granitemoe_ckpt)
    model = llm.engine.model
    captured = []
    compute = model.compute_logits
    model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    prompt = family_prompts(512, (23,), seed=5)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    ours, ref = captured[-1][0], hf_last_logits(granitemoe_ckpt, prompt)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4


def test_granitemoe_prefix_cache(granitemoe_ckpt):
    check_prefix_cache(granitemoe_ckpt)


@ALL_EP
def test_granitemoe_ep2(granitemoe_ckpt):
    check_ep_token_exact(granitemoe_ckpt, 2)


def test_granitemoeshared_token_exact(granitemoeshared_ckpt):
    check_token_exact(granitemoeshared_ckpt)


def test_granitemoeshared_prefix_cache(granitemoeshared_ckpt):
    check_prefix_cache(granitemoeshared_ckpt)


def test_granitemoeshared_triton_backend(granitemoeshared_ckpt):
    """The Triton kernels (under the interpreter here): attention, top-k-then-softmax router,
    fused experts and the shared MLP's fused activation."""
    llm = check_token_exact(granitemoeshared_ckpt, kernel_backend="triton",
                            prompts=family_prompts(512, (1, 37)), max_new=4)
    backends = llm.engine.model_info().kernel_backends
    for op in ("fused_moe", "attention_prefill", "attention_decode", "router_topk", "rms_norm",
               "rotary"):
        assert backends[op] == "triton", (op, dict(backends))


@ALL_EP
def test_granitemoeshared_ep2(granitemoeshared_ckpt):
    check_ep_token_exact(granitemoeshared_ckpt, 2)


# -- DBRX -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dbrx_ckpt(tmp_path_factory):
    return make_family_checkpoint("dbrx", DBRX, tmp_path_factory.mktemp("dbrx"),
                                  drawn=("norm_1.weight", "norm_2.weight", "norm_f.weight"))


def test_dbrx_token_exact(dbrx_ckpt):
    check_token_exact(dbrx_ckpt)


def test_dbrx_prefix_cache(dbrx_ckpt):
    check_prefix_cache(dbrx_ckpt)


@ALL_EP
def test_dbrx_ep2(dbrx_ckpt):
    check_ep_token_exact(dbrx_ckpt, 2)


# -- JetMoE -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jetmoe_ckpt(tmp_path_factory):
    return make_family_checkpoint("jetmoe", JETMOE, tmp_path_factory.mktemp("jetmoe"),
                                  drawn=("bias",))


def test_jetmoe_token_exact(jetmoe_ckpt):
    check_token_exact(jetmoe_ckpt)


def test_jetmoe_prefix_cache(jetmoe_ckpt):
    check_prefix_cache(jetmoe_ckpt)


@ALL_EP
def test_jetmoe_ep2(jetmoe_ckpt):
    check_ep_token_exact(jetmoe_ckpt, 2)


# -- pieces and refusals (no serving) ---------------------------------------------------------


def test_sparsemixer_matches_transformers():
    """`routing.sparsemixer_top2` equals transformers' `sparsemixer` (inference) on random
    logits, with ties and a margin that masks some and keeps others."""
    import torch
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from moe_engine.models.layers.routing import sparsemixer_top2

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g) * 3
    logits[:4, 2] = logits[:4, 5] = logits[:4].max(dim=-1).values  # tied best experts
    for eps in (0.01, 0.3):
        ref_w, ref_ids = sparsemixer(logits, jitter_eps=eps, training=False, top_k=2)
        weights, ids = sparsemixer_top2(logits, eps)
        assert torch.equal(ids.long(), ref_ids) and torch.equal(weights, ref_w.float())


@pytest.mark.parametrize("model_type, fields, error", [
    ("phimoe", dict(num_experts_per_tok=3), "num_experts_per_tok 3"),
    ("phimoe", dict(rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8, long_factor=[1.0] * 8,
        original_max_position_embeddings=512, short_mscale=1.0, long_mscale=1.0)), "longrope"),
    ("dbrx", dict(ffn_config=dict(moe_normalize_expert_weights=2.0)),
     "moe_normalize_expert_weights 2.0"),
    ("olmoe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_variants_are_refused_naming_the_field(model_type, fields, error):
    """Refused from the config alone (what `moe-serve` reads before any weight)."""
    from transformers import AutoConfig

    from moe_engine.errors import StartupError
    from moe_engine.models import architecture_class, resolve_architecture

    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    name, cls = resolve_architecture(config)
    assert cls is architecture_class(name)
    with pytest.raises((ValueError, StartupError), match=error):
        cls.arch_spec(config)
