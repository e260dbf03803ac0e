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
