"""Mamba hybrids served token-exact against transformers (issue 43): Granite-4.0-H
(`granitemoehybrid`: Mamba-2 + NoPE/rope attention + MoE with a shared MLP, Granite's
multipliers) and Jamba (`jamba`: Mamba-1 selective scan + attention every `attn_layer_period`,
MoE every `expert_layer_period`), on per-request state slots (`kv_cache.state`).

Each family: greedy ids equal transformers with chunked prefill (prompts of 1..70 tokens over
a 16-token budget, so a prompt's state is carried over several steps; several requests
decoding together through the batched one-token steps), and prefix caching refused at startup
with the reason (the state is not in the KV blocks a hit would reuse).
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
from fixtures import dequantized_experts_copy, hf_greedy

from kernels.attention.ssm_scan import (
    mamba2_chunk_scan,
    mamba2_state_update,
    selective_scan,
    selective_state_update,
    softplus_dt,
)
from moe_engine import LLM
from moe_engine.errors import StartupError
from moe_engine.models import model_shape
from moe_engine.startup.plan import make_plan

EP_ALL = pytest.mark.skipif(os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
                            reason="ep 2 of every family: MOE_ENGINE_FAMILY_EP=all")

#: Granite-4.0-H: Mamba, attention, Mamba, attention (rope), 8 experts + shared MLP, 2 groups
#: of B/C over 8 heads, chunk 16 in transformers (its prefill scan blocks), multipliers != 1.
GRANITE = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
    mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head="auto",
    mamba_chunk_size=16, position_embedding_type="rope",
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
    logits_scaling=2.0,
)
#: Drawn from N(0, 0.5) rather than transformers' init (zero biases, unit D / dt_bias).
GRANITE_DRAWN = ("conv1d.bias", "mamba.D", "dt_bias", "mamba.norm.weight", "layernorm.weight",
                 "model.norm.weight")

#: Jamba: attention at layers 1, 3 (period 2, offset 1), MoE at 0 and 3 (period 3): Mamba + MoE,
#: attention + dense, Mamba + dense, attention + MoE; dt rank 8, state 8.
JAMBA = dict(
    num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=3,
    expert_layer_offset=0, num_experts=8, intermediate_size=32, mamba_d_state=8,
    mamba_dt_rank=8, mamba_expand=2,
)
JAMBA_DRAWN = ("conv1d.bias", "mamba.D", "dt_proj.bias", "layernorm.weight")


@pytest.fixture(scope="module")
def granite_ckpt(tmp_path_factory):
    return make_family_checkpoint("granitemoehybrid", GRANITE, tmp_path_factory.mktemp("granite"),
                                  drawn=GRANITE_DRAWN)


def test_granitemoehybrid_token_exact(granite_ckpt):
    check_token_exact(granite_ckpt)


def _refuses_prefix_caching(ckpt, layers: str) -> None:
    with pytest.raises(StartupError) as err:
        LLM(model=str(ckpt), max_model_len=64, enable_prefix_caching=True)
    text = str(err.value)
    assert "--enable-prefix-caching" in text and layers in text, text
    assert "per-request state" in text


def test_granitemoehybrid_refuses_prefix_caching(granite_ckpt):
    _refuses_prefix_caching(granite_ckpt, "2 of its 4 layers are linear attention (Mamba-2)")


@EP_ALL
def test_granitemoehybrid_ep2(granite_ckpt):
    """Two expert-parallel ranks, each with its own requests' Mamba state slots."""
    check_ep_token_exact(granite_ckpt, 2)


def test_granitemoehybrid_triton_backend(granite_ckpt):
    """The Triton backend (under the interpreter): fused MoE and paged attention kernels, the
    Mamba layers' torch scans beside them."""
    check_token_exact(granite_ckpt, kernel_backend="triton", max_new=4,
                      prompts=family_prompts(512, (1, 37)))


@pytest.fixture(scope="module")
def jamba_ckpt(tmp_path_factory):
    return make_family_checkpoint("jamba", JAMBA, tmp_path_factory.mktemp("jamba"),
                                  drawn=JAMBA_DRAWN)


def test_jamba_token_exact(jamba_ckpt):
    check_token_exact(jamba_ckpt)


def test_jamba_refuses_prefix_caching(jamba_ckpt):
    _refuses_prefix_caching(jamba_ckpt, "2 of its 4 layers are linear attention (Mamba)")


def test_jamba_int4_experts(jamba_ckpt, tmp_path):
    """4-bit experts (int4, group 32) against transformers on the dequantized copy."""
    ref = dequantized_experts_copy(jamba_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512, (5, 37))
    check_token_exact(jamba_ckpt, prompts=prompts, expected=hf_greedy(ref, prompts, 8),
                      quantization="int4", quant_group_size=32)


@EP_ALL
def test_jamba_ep2(jamba_ckpt):
    check_ep_token_exact(jamba_ckpt, 2)


def test_state_sizes_in_the_startup_plan(granite_ckpt, jamba_ckpt):
    """The plan sizes the Mamba states per request: Mamba-2 conv [I + 2GN, W - 1] in the
    model dtype + [Hh, P, N] float32 per layer; Mamba-1 conv [I, W - 1] + [I, N]."""
    import json

    for ckpt, layers, conv, ssm in ((granite_ckpt, 2, (128 + 2 * 2 * 16, 3), (8, 16, 16)),
                                    (jamba_ckpt, 2, (128, 3), (128, 8))):
        shape = model_shape(json.loads((ckpt / "config.json").read_text()))
        assert shape.linear_state_shapes() == (conv, ssm)
        per_request = layers * (conv[0] * conv[1] * 2 + torch.tensor(ssm).prod().item() * 4)
        plan = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=256,
                         kv_cache_memory=1 << 22, max_num_seqs=4)
        assert plan.state_bytes_per_request == per_request and plan.num_state_slots == 4


def test_scans_carry_their_state_across_chunks():
    """A prompt split at any points (chunked prefill) then decoded token by token gives the
    one-pass scan's outputs and final state, for both scans."""
    g = torch.Generator().manual_seed(0)
    t, heads, p, groups, n = 29, 4, 8, 2, 6
    x, dt = torch.randn(t, heads, p, generator=g), torch.randn(t, heads, generator=g)
    b, c = torch.randn(t, groups, n, generator=g), torch.randn(t, groups, n, generator=g)
    a, d = -torch.rand(heads, generator=g), torch.randn(heads, generator=g)
    bias = torch.randn(heads, generator=g)
    dt = softplus_dt(dt, bias)
    whole, final = mamba2_chunk_scan(x, dt, a, b, c, d, torch.zeros(heads, p, n), 8)
    state, parts = torch.zeros(heads, p, n), []
    for lo, hi in ((0, 5), (5, 22), (22, 26)):
        y, state = mamba2_chunk_scan(x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], d, state, 4)
        parts.append(y)
    state = state[None].clone()
    for i in range(26, t):
        parts.append(mamba2_state_update(x[i:i + 1], dt[i:i + 1], a, b[i:i + 1], c[i:i + 1], d,
                                         state))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[0], final, rtol=1e-4, atol=1e-4)
    inter = 12
    x1, dt1 = torch.randn(t, inter, generator=g), softplus_dt(torch.randn(t, inter), torch.zeros(1))
    a1, b1, c1 = -torch.rand(inter, n, generator=g), torch.randn(t, n), torch.randn(t, n)
    d1 = torch.randn(inter)
    whole, final = selective_scan(x1, dt1, a1, b1, c1, d1, torch.zeros(inter, n))
    y, state = selective_scan(x1[:20], dt1[:20], a1, b1[:20], c1[:20], d1, torch.zeros(inter, n))
    state, parts = state[None].clone(), [y]
    for i in range(20, t):
        parts.append(selective_state_update(x1[i:i + 1], dt1[i:i + 1], a1, b1[i:i + 1],
                                            c1[i:i + 1], d1, state))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], final, rtol=1e-5, atol=1e-5)


#: GraniteMoE-SWA: full, sliding (NoPE), sliding (rope base 500), sliding; window 24 < the
#: 37/70-token prompts; sinks drawn; shared MLP; multipliers != 1.
GRANITE_SWA = dict(
    num_hidden_layers=4, num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
    sliding_window=24, layer_rope_theta=[10000.0, 0, 500.0, 10000.0],
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
    logits_scaling=2.0,
)


@pytest.fixture(scope="module")
def granite_swa_ckpt(tmp_path_factory):
    return make_family_checkpoint("granitemoe_swa", GRANITE_SWA,
                                  tmp_path_factory.mktemp("granite_swa"),
                                  drawn=("sinks", "layernorm.weight", "model.norm.weight"))


def test_granitemoe_swa_token_exact(granite_swa_ckpt):
    check_token_exact(granite_swa_ckpt)


def test_granitemoe_swa_prefix_cache(granite_swa_ckpt):
    """No state layers: prefix caching applies (sliding groups hit on their window)."""
    check_prefix_cache(granite_swa_ckpt)


@EP_ALL
def test_granitemoe_swa_ep2(granite_swa_ckpt):
    check_ep_token_exact(granite_swa_ckpt, 2)


#: Nemotron-H blocks: an MLP block before the first mixer (joins engine layer 0), Mamba, MoE,
#: attention, MLP, Mamba, MoE: engine layers [-, M, E], [*, -], [M, E]; 8 experts in 2 groups
#: (top-1 group), sigmoid routing with a drawn correction bias, scaling 2.5, relu^2 experts.
NEMOTRON_H = dict(
    layers_block_type=["mlp", "linear_attention", "moe", "full_attention", "mlp",
                       "linear_attention", "moe"],
    n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    intermediate_size=40, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
    time_step_min=0.001, num_hidden_layers=None,
)
NEMOTRON_DRAWN = ("conv1d.bias", "mixer.D", "dt_bias", "mixer.norm.weight",
                  "e_score_correction_bias",
                  ".norm.weight", "norm_f.weight")


@pytest.fixture(scope="module")
def nemotron_ckpt(tmp_path_factory):
    return make_family_checkpoint("nemotron_h", NEMOTRON_H, tmp_path_factory.mktemp("nemotron"),
                                  drawn=NEMOTRON_DRAWN)


def test_nemotron_h_token_exact(nemotron_ckpt):
    check_token_exact(nemotron_ckpt)


def test_nemotron_h_refuses_prefix_caching(nemotron_ckpt):
    _refuses_prefix_caching(nemotron_ckpt, "2 of its 3 layers are linear attention (Mamba-2)")


def test_nemotron_h_refuses_int4_experts(nemotron_ckpt):
    """The 4-bit expert kernels compute SwiGLU: relu^2 experts are refused, naming the flag."""
    with pytest.raises(StartupError, match="--quantization int4: .*non-gated"):
        LLM(model=str(nemotron_ckpt), max_model_len=64, quantization="int4", quant_group_size=32)


def test_nemotron_h_ep2(nemotron_ckpt):
    """Two expert-parallel ranks: the relu^2 experts split, sigmoid routing, state slots per
    rank."""
    check_ep_token_exact(nemotron_ckpt, 2)


def test_non_gated_experts_take_the_declared_torch_path():
    """Non-gated relu^2 experts (w13 [E, I, H]) bound to native-cpu or triton run the torch
    expert path, equal to the per-expert reference, and the plan declares that fallback."""
    from kernels.moe.activation import RELU2
    from kernels.moe.backends import NON_GATED_FALLBACK, ExpertExtras, bind_float_experts
    from kernels.moe.reference import fused_moe_reference
    from kernels.plan import NATIVE_CPU, TRITON, fallbacks

    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    hidden = torch.randn(5, 16, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=g)
    expected = fused_moe_reference(hidden, w13, w2, weights, ids, activation=RELU2)
    for backend in (NATIVE_CPU, TRITON):
        bound = bind_float_experts(backend, w13, w2, ExpertExtras(activation=RELU2))
        assert bound.backend == "torch"
        torch.testing.assert_close(bound(hidden, weights, ids), expected)
        assert any("non-gated" in line for line in fallbacks("fused_moe", backend))
    assert "relu^2" in NON_GATED_FALLBACK


def test_released_config_spellings():
    """Released configs: Granite-4.0-H's legacy "mamba"/"attention" layer types, Nemotron-H's
    `hybrid_override_pattern`; the blocks group into engine layers as the module says."""
    from moe_engine.models.nemotron_h import block_types, group_blocks

    granite = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 512,
               "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
               "intermediate_size": 32, "num_local_experts": 4,
               "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8}
    assert model_shape(granite).linear_attention_layers() == (0, 2)
    types = block_types({"hybrid_override_pattern": "-M-ME*-"})
    assert group_blocks(types) == (
        ((0, "mlp"), (1, "linear_attention"), (2, "mlp")),
        ((3, "linear_attention"), (4, "moe")),
        ((5, "full_attention"), (6, "mlp")),
    )
    with pytest.raises(ValueError, match="two MoE blocks"):
        group_blocks(block_types({"hybrid_override_pattern": "MEE"}))
