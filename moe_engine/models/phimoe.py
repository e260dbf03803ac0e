"""PhiMoE / Phi-3.5-MoE (Microsoft, "Phi-3 Technical Report", arXiv:2404.14219, 2024; routing
from "GRIN: GRadient-INformed MoE", arXiv:2409.12136; HF `PhimoeForCausalLM`, transformers
5.24 `modeling_phimoe.py`).

A Mixtral-style decoder (every layer an MoE block of `num_local_experts` experts of width
`intermediate_size`) that differs from the Llama-style one in:
- LayerNorm with a bias (eps `rms_norm_eps`) instead of RMSNorm, in both layer norms and the
  final one (`layers/norm.LayerNorm`);
- biases on q/k/v/o when `attention_bias`; a bias on the LM head when `lm_head_bias`;
- SparseMixer top-2 routing (`layers/routers.SparseMixerRouter`, its inference path: the best
  expert, then the second best, each weighted by its softmax probability among the logits
  within a relative `router_jitter_noise` margin of it);
- a sliding window over every layer when `sliding_window` is set (as Mixtral).

Checkpoint names: the MoE block is `block_sparse_moe` (router `block_sparse_moe.gate`, experts
`experts.{e}.w1` (gate), `w3` (up), `w2` (down)); transformers 5's own names
(`mlp.router`, `mlp.experts.gate_up_proj` / `down_proj`) load too. Norms hold `weight` and
`bias`. KV cache: one full-attention group, or one sliding-window group of every layer.
The released Phi-3.5-MoE's "longrope" rotary (scaled by the sequence's length) is refused.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import (
    check_hidden_act,
    every_layer_moe,
    uniform_window_fields,
)
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import LayerNorm
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.routers import SparseMixerRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: `PhimoeConfig.router_jitter_noise` default.
DEFAULT_ROUTER_JITTER = 0.01


@dataclasses.dataclass(frozen=True)
class PhimoeSpec(ArchSpec):
    """`ArchSpec` plus the SparseMixer margin.

    Attributes:
        router_jitter_noise: the relative logit margin of SparseMixer's masks.
    """

    router_jitter_noise: float = DEFAULT_ROUTER_JITTER


class PhimoeForCausalLM(MoeCausalLM):
    """PhiMoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "PhiMoE", ("microsoft/Phi-3.5-MoE-instruct",),
        "GQA, q/k/v/o biases, LayerNorm, optional sliding window (its longrope is refused)",
        cache=("full", "sliding"),
    )

    spec_class = PhimoeSpec
    model_types = ("phimoe",)
    # `checkpoint_name` undoes the renames last first: the released names come back.
    weight_mapping = WeightMapping(
        renames=((".mlp.router.", ".mlp.gate."), (".block_sparse_moe.", ".mlp.")),
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`; q/k/v/o biases from `attention_bias`;
        `sliding_window` windows every layer when set.

        Raises:
            ValueError: a required field missing (named), a window below 1 token.
        """
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            qk_norm=False,
            norm_topk_prob=False,
            **uniform_window_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The LayerNorm epsilon, rope_theta, the SparseMixer margin, the LM head's bias.

        Raises:
            StartupError: a rope_type other than default (Phi-3.5-MoE's "longrope" scales by
                the sequence's length: not implemented); ValueError: hidden_act other than
                silu, num_experts_per_tok other than 2.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        if hf_config.num_experts_per_tok != 2:
            raise ValueError(
                f"config.json: num_experts_per_tok {hf_config.num_experts_per_tok} is not "
                "supported for PhimoeForCausalLM (SparseMixer routing selects exactly 2 experts)"
            )
        jitter = getattr(hf_config, "router_jitter_noise", DEFAULT_ROUTER_JITTER)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            router_jitter_noise=float(jitter),
            lm_head_bias=bool(getattr(hf_config, "lm_head_bias", False)),
        )

    def build_norm(self, spec: PhimoeSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`nn.LayerNorm(eps=rms_norm_eps)` with its bias."""
        return LayerNorm(size, spec.rms_norm_eps, bias=True, dtype=dtype)

    def build_attention(
        self, spec: PhimoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Biases on q/k/v/o from `attention_bias`; the window on sliding layers."""
        sliding = bool(spec.layer_types) and spec.layer_types[index] == "sliding_attention"
        window = spec.sliding_window if sliding else None
        return Attention(spec, dtype, rotary, window, o_bias=spec.attention_bias)

    def build_mlp(self, spec: PhimoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """SparseMixer top-2 routing (router in the model dtype), SwiGLU experts."""
        router = SparseMixerRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.router_jitter_noise, dtype
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            False, dtype, router=router,
        )
