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
from family_check import check_ep_token_exact, check_token_exact, make_family_checkpoint

from moe_engine import LLM
from moe_engine.errors import StartupError

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


@pytest.fixture(scope="module")
def jamba_ckpt(tmp_path_factory):
    return make_family_checkpoint("jamba", JAMBA, tmp_path_factory.mktemp("jamba"),
                                  drawn=JAMBA_DRAWN)


def test_jamba_token_exact(jamba_ckpt):
    check_token_exact(jamba_ckpt)


def test_jamba_refuses_prefix_caching(jamba_ckpt):
    _refuses_prefix_caching(jamba_ckpt, "2 of its 4 layers are linear attention (Mamba)")
