"""Hybrid families whose linear layers keep per-request state slots (issue 43 item 2), served
token-exact against transformers (float32, greedy, chunked prefill carrying the state over
several steps): LFM2-MoE (gated short convolutions), MiniMax-Text-01 (lightning attention,
scaled post-norm residuals), Kimi-Linear (Kimi Delta Attention beside NoPE MLA). Each refuses
prefix caching at startup with the reason, as Qwen3-Next does; the plan sizes each family's
state, and each family's weights are what the plan counted.

Set MOE_ENGINE_FAMILY_EP=all to also run every family's ep-2 check (one runs by default).
"""

from __future__ import annotations

import json
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
from moe_engine.models import model_shape
from moe_engine.startup.plan import make_plan

ALL_EP = pytest.mark.skipif(os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
                            reason="set MOE_ENGINE_FAMILY_EP=all for every family's ep-2 check")

#: LFM2-MoE: conv, attention, conv, conv; one dense-first layer; expert bias drawn.
LFM2_MOE = dict(
    num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
    num_dense_layers=1, num_experts=8, moe_intermediate_size=32, intermediate_size=96,
    conv_L_cache=3, norm_eps=1e-5, routed_scaling_factor=1.5,
)

#: MiniMax: lightning, softmax, lightning, lightning; 16-token lightning blocks (the 37/70-token
#: prompts span several); every residual scale off 1.
MINIMAX = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_local_experts=8, intermediate_size=32, block_size=16,
    full_attn_alpha_factor=0.7, full_attn_beta_factor=1.3, linear_attn_alpha_factor=1.2,
    linear_attn_beta_factor=0.8, mlp_alpha_factor=0.9, mlp_beta_factor=1.1,
)

#: Kimi-Linear: KDA, MLA, KDA, KDA; a dense first layer; 16 experts in 4 groups (2 kept), one
#: shared expert; correction bias and the gated output norm drawn.
KIMI_LINEAR = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_local_experts=16,
    moe_intermediate_size=32, intermediate_size=96, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.0, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4, linear_num_heads=4,
    linear_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def lfm2_moe_ckpt(tmp_path_factory):
    return make_family_checkpoint("lfm2_moe", LFM2_MOE, tmp_path_factory.mktemp("lfm2_moe"),
                                  drawn=("expert_bias",))


def _refused_prefix_caching(ckpt, mixer: str, linear: int, layers: int) -> None:
    with pytest.raises(StartupError) as err:
        LLM(model=str(ckpt), max_model_len=64, enable_prefix_caching=True)
    text = str(err.value)
    assert "--enable-prefix-caching" in text
    assert f"{linear} of its {layers} layers are linear attention ({mixer})" in text


def _names_round_trip(ckpt) -> None:
    """The model's expected pieces, named as the checkpoint names them, are exactly the
    checkpoint's tensors (less those the mapping ignores): the mapping is complete both ways."""
    from safetensors import safe_open

    from moe_engine.models import resolve_architecture
    from moe_engine.models.hf_config import load_hf_config

    hf_config = load_hf_config(str(ckpt))
    _, cls = resolve_architecture(hf_config)
    model = cls(cls.arch_spec(hf_config), torch.float32)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = {k for k in f.keys() if not cls.weight_mapping.skips(k)}  # noqa: SIM118
    assert set(model.checkpoint_names_of(model.expected_weight_names())) == stored


def _state_bytes(ckpt) -> int:
    shape = model_shape(json.loads((ckpt / "config.json").read_text()))
    plan = make_plan(shape, torch.float32, block_size=16, max_model_len=256,
                     kv_cache_memory=1 << 22, max_num_seqs=4)
    assert plan.num_state_slots == 4 and "linear-attention state:" in plan.describe()
    return plan.state_bytes_per_request


# -- LFM2-MoE -----------------------------------------------------------------------------------


def test_lfm2_moe_token_exact(lfm2_moe_ckpt):
    llm = check_token_exact(lfm2_moe_ckpt)
    engine = llm.engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert sum(info.values()) == engine.plan.weight_bytes  # the plan counts the conv layers


def test_lfm2_moe_names_state_and_prefix_cache_refused(lfm2_moe_ckpt):
    _names_round_trip(lfm2_moe_ckpt)
    assert _state_bytes(lfm2_moe_ckpt) == 3 * 64 * 2 * 4  # 3 conv layers x [H, L - 1] float32
    _refused_prefix_caching(lfm2_moe_ckpt, "short convolution", 3, 4)


def test_lfm2_moe_int4_experts(lfm2_moe_ckpt, tmp_path):
    ref = dequantized_experts_copy(lfm2_moe_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512, (11, 37))
    check_token_exact(lfm2_moe_ckpt, prompts=prompts, expected=hf_greedy(ref, prompts, 8),
                      quantization="int4", quant_group_size=32)


def test_lfm2_moe_triton(lfm2_moe_ckpt):
    check_token_exact(lfm2_moe_ckpt, prompts=family_prompts(512, (1, 37)), max_new=4,
                      kernel_backend="triton")


def test_lfm2_moe_ep2(lfm2_moe_ckpt):
    check_ep_token_exact(lfm2_moe_ckpt, 2)


# -- MiniMax ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minimax_ckpt(tmp_path_factory):
    return make_family_checkpoint("minimax", MINIMAX, tmp_path_factory.mktemp("minimax"))


def test_minimax_token_exact(minimax_ckpt):
    llm = check_token_exact(minimax_ckpt)
    engine = llm.engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert sum(info.values()) == engine.plan.weight_bytes  # the plan counts the linear layers


def test_minimax_names_state_and_prefix_cache_refused(minimax_ckpt):
    _names_round_trip(minimax_ckpt)
    assert _state_bytes(minimax_ckpt) == 3 * 4 * 16 * 16 * 4  # 3 layers x [H, D, D] float32
    _refused_prefix_caching(minimax_ckpt, "lightning attention", 3, 4)


@ALL_EP
def test_minimax_ep2(minimax_ckpt):
    check_ep_token_exact(minimax_ckpt, 2)


# -- Kimi-Linear --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_linear_ckpt(tmp_path_factory):
    return make_family_checkpoint("kimi_linear", KIMI_LINEAR,
                                  tmp_path_factory.mktemp("kimi_linear"),
                                  drawn=("e_score_correction_bias", "o_norm.weight"))


def test_kimi_linear_token_exact(kimi_linear_ckpt):
    llm = check_token_exact(kimi_linear_ckpt)
    engine = llm.engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert sum(info.values()) == engine.plan.weight_bytes  # the plan counts the KDA layers


def test_kimi_linear_names_state_and_prefix_cache_refused(kimi_linear_ckpt):
    _names_round_trip(kimi_linear_ckpt)
    # 3 KDA layers x (conv [3 x 4 x 16, 3] + recurrent [4, 16, 16]) float32
    assert _state_bytes(kimi_linear_ckpt) == 3 * (3 * 64 * 3 + 4 * 16 * 16) * 4
    _refused_prefix_caching(kimi_linear_ckpt, "Kimi Delta Attention", 3, 4)


@ALL_EP
def test_kimi_linear_ep2(kimi_linear_ckpt):
    check_ep_token_exact(kimi_linear_ckpt, 2)


# -- the mixers' kernels against transformers' torch paths, state carried across chunks ---------


def test_kda_and_lightning_kernels_carry_the_state_across_chunks():
    """Prefill split into two chunks then one decode token equals one pass (KDA: transformers'
    `chunk_kimi_delta_attention`; lightning attention, 16-token blocks: its recurrence token by
    token, transformers' cached branch) to float32 rounding, outputs and state."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
    )

    from kernels.attention.gated_delta import recurrent_gated_delta_rule
    from kernels.attention.kda import chunk_kda_rule
    from kernels.attention.lightning import (
        lightning_attention_decode,
        lightning_attention_prefill,
    )
    from moe_engine.models.layers.lightning_attention import lightning_slopes

    g = torch.Generator().manual_seed(0)
    t, h, d = 70, 3, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    decay, beta = -torch.rand(t, h, d, generator=g) * 0.5, torch.rand(t, h, generator=g)
    ref, ref_state = chunk_kimi_delta_attention(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=None,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = torch.zeros(h, d, d)
    parts = [chunk_kda_rule(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], state, chunk_size=16)
             for a, b in ((0, 40), (40, 69))]
    batch = state[None].clone()
    parts.append(recurrent_gated_delta_rule(q[69:], k[69:], v[69:], decay[69:], beta[69:], batch))
    torch.testing.assert_close(torch.cat(parts), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch[0], ref_state[0], rtol=1e-5, atol=1e-5)

    slope, block = lightning_slopes(h, 1, 4), 16
    kv, outs = torch.zeros(h, d, d), []
    for i in range(t):  # the definition, token by token (transformers' cached branch)
        kv = torch.exp(-slope)[:, None, None] * kv + k[i, :, :, None] * v[i, :, None, :]
        outs.append((q[i, :, None, :] @ kv)[:, 0])
    ref = torch.stack(outs)
    state = torch.zeros(h, d, d)
    parts = [lightning_attention_prefill(q[a:b], k[a:b], v[a:b], slope, state, block)
             for a, b in ((0, 37), (37, 69))]
    batch = state[None].clone()
    parts.append(lightning_attention_decode(q[69:], k[69:], v[69:], slope, batch))
    # values of ~10 (70 unnormalised k v^T, slowly decayed): float32 rounding of sums
    torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch[0], kv, rtol=1e-4, atol=1e-4)


def test_speculative_decoding_refused_naming_the_mixer(lfm2_moe_ckpt):
    with pytest.raises(StartupError) as err:
        LLM(model=str(lfm2_moe_ckpt), max_model_len=64, speculative_method="ngram",
            num_speculative_tokens=2)
    text = str(err.value)
    assert "--speculative-method ngram" in text and "(short convolution)" in text
