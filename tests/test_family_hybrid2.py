"""Hybrid families of linear (state-slot) layers beside attention (issue 43), served
token-exact against transformers (float32, greedy, chunked prefill carrying the state over
several steps): LaraMini (Gated DeltaNet beside sliding RoPE and NoPE full attention, an
ungated shared expert). Each refuses prefix caching at startup with the reason, as Qwen3-Next
does; the checkpoint names round-trip and the plan counts the weights.

Set MOE_ENGINE_FAMILY_EP=all to also run every family's ep-2 check (one runs by default).
"""

from __future__ import annotations

import os

import pytest
import torch
from family_check import (
    check_ep_token_exact,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)
from fixtures import dequantized_experts_copy, hf_greedy

from moe_engine import LLM
from moe_engine.errors import StartupError

ALL_EP = pytest.mark.skipif(os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
                            reason="set MOE_ENGINE_FAMILY_EP=all for every family's ep-2 check")

#: LaraMini: the released period-5 pattern (linear, sliding, linear, full, sliding) over 5
#: layers, a 16-token window (the 37/70-token prompts exceed it), GQA 4/2, 2 key heads serving
#: 4 value heads in the linear layers; embeddings tied (LaraMini's default); norms and the
#: gated norm drawn.
LARA_MINI = dict(
    tie_word_embeddings=None,
    num_hidden_layers=5, sliding_window=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)


def _refused_prefix_caching(ckpt, mixer: str, linear: int, layers: int) -> None:
    with pytest.raises(StartupError) as err:
        LLM(model=str(ckpt), max_model_len=64, enable_prefix_caching=True)
    text = str(err.value)
    assert "--enable-prefix-caching" in text
    assert f"{linear} of its {layers} layers are linear attention ({mixer})" in text


def _names_round_trip(ckpt) -> None:
    """The model's expected pieces, named as the checkpoint names them, are exactly the
    checkpoint's tensors, the routed experts aside (stored fused, expected per expert; the
    token-exact test loads them): the mapping is complete both ways."""
    from safetensors import safe_open

    from moe_engine.models import resolve_architecture
    from moe_engine.models.hf_config import load_hf_config

    hf_config = load_hf_config(str(ckpt))
    _, cls = resolve_architecture(hf_config)
    model = cls(cls.arch_spec(hf_config), torch.float32)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = {k for k in f.keys() if ".mlp.experts." not in k}  # noqa: SIM118
    expected = set(model.checkpoint_names_of(model.expected_weight_names()))
    assert {k for k in expected if ".mlp.experts." not in k} == stored


def _weights_counted(llm) -> None:
    engine = llm.engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert sum(info.values()) == engine.plan.weight_bytes


# -- LaraMini -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lara_mini_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "lara_mini", LARA_MINI, tmp_path_factory.mktemp("lara_mini"),
        drawn=("layernorm.weight", "norm.weight", "dt_bias"),
    )


def test_lara_mini_token_exact(lara_mini_ckpt):
    _weights_counted(check_token_exact(lara_mini_ckpt))


def test_lara_mini_names_and_prefix_cache_refused(lara_mini_ckpt):
    _names_round_trip(lara_mini_ckpt)
    _refused_prefix_caching(lara_mini_ckpt, "Gated DeltaNet", 2, 5)


def test_lara_mini_int4_experts(lara_mini_ckpt, tmp_path):
    ref = dequantized_experts_copy(lara_mini_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512, (11, 37))
    check_token_exact(lara_mini_ckpt, prompts=prompts, expected=hf_greedy(ref, prompts, 8),
                      quantization="int4", quant_group_size=32)


def test_lara_mini_triton(lara_mini_ckpt):
    check_token_exact(lara_mini_ckpt, prompts=family_prompts(512, (1, 37)), max_new=4,
                      kernel_backend="triton")


@ALL_EP
def test_lara_mini_ep2(lara_mini_ckpt):
    check_ep_token_exact(lara_mini_ckpt, 2)


# -- Bailing-hybrid -----------------------------------------------------------------------------

#: Bailing-hybrid: delta, delta, MLA, delta; two dense-first layers (the default
#: first_k_dense_replace); 16 experts in 4 groups (2 kept), one shared expert; MLA with a
#: direct q_proj and rope; correction bias and the gated output norm drawn.
BAILING_HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, intermediate_size=96,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.0, kv_lora_rank=32,
    q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, short_conv_kernel_size=4,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def bailing_hybrid_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "bailing_hybrid", BAILING_HYBRID, tmp_path_factory.mktemp("bailing_hybrid"),
        drawn=("e_score_correction_bias", "o_norm.weight"),
    )


def test_bailing_hybrid_token_exact(bailing_hybrid_ckpt):
    _weights_counted(check_token_exact(bailing_hybrid_ckpt))


def test_bailing_hybrid_names_and_prefix_cache_refused(bailing_hybrid_ckpt):
    _names_round_trip(bailing_hybrid_ckpt)
    _refused_prefix_caching(bailing_hybrid_ckpt, "Kimi Delta Attention", 3, 4)


def test_bailing_hybrid_ep2(bailing_hybrid_ckpt):
    check_ep_token_exact(bailing_hybrid_ckpt, 2)


@pytest.mark.parametrize("safe_gate", [True, False])
def test_bailing_hybrid_forget_gate(safe_gate):
    """The full-rank forget gate of `KimiDeltaAttention(low_rank_gates=False)`, bounded
    (`gate_lower_bound`) or not, equals transformers' `BailingHybridForgetGate`."""
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import (
        BailingHybridConfig,
    )
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
        BailingHybridForgetGate,
    )

    from moe_engine.models.layers.kda import KimiDeltaAttention

    config = BailingHybridConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                 kda_safe_gate=safe_gate, kda_lower_bound=-3.0)
    torch.manual_seed(0)
    ref = BailingHybridForgetGate(config)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    kda = KimiDeltaAttention(64, 4, config.linear_head_dim, 4, 1e-5, torch.float32,
                             low_rank_gates=False, gate_lower_bound=-3.0 if safe_gate else None)
    kda.load_state_dict({"f_proj.weight": ref.f_proj.weight, "dt_bias": ref.dt_bias,
                         "A_log": ref.A_log}, strict=False)
    h = torch.randn(7, 64)
    with torch.no_grad():
        expected = ref(h[None])[0]
        torch.testing.assert_close(kda._decay(h), expected, rtol=1e-6, atol=1e-6)
    assert (expected >= -3.0).all() if safe_gate else (expected < -3.0).any()
