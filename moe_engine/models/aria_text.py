"""Aria's language model (Rhymes AI, "Aria: An Open Multimodal Native Mixture-of-Experts
Model", arXiv:2410.05993, 2024, rhymes-ai/Aria; HF `AriaTextForCausalLM`, transformers 5.24
`modeling_aria.py`), served as a text-only causal LM.

A Llama-style GQA decoder (biases on q/k/v/o from `attention_bias`, no q/k norm, plain RoPE),
every layer a sparse MoE block, that differs in:
- routing: the top-k of the router logits, then a softmax over those k in the logits' dtype
  (`AriaTextTopKRouter`: `FusedMoE(routing="topk_softmax")`, the router weight in the model
  dtype); `moe_num_experts` experts of width `intermediate_size`, top-k `moe_topk`;
- `moe_num_shared_experts` shared experts as one ungated MLP of width
  `intermediate_size * moe_num_shared_experts` with biases from `mlp_bias`
  (`AriaSharedExpertsMLP`, `layers/shared_experts.SharedExperts`).

Checkpoint names: the base mapping's for attention, `mlp.router.weight` -> `mlp.gate.weight`,
the experts fused and stored [E, in, out] (`AriaExperts`, `is_transposed`): the released
`mlp.experts.fc1.weight` [E, H, 2I] (gate; up) and `fc2.weight` [E, I, H], or transformers 5's
`mlp.experts.gate_up_proj` / `down_proj` of the same layout, transposed at load
(`ExpertMapping(fused_in_out=True)`); `mlp.shared_experts.{gate,up,down}_proj.*`. KV cache: one
full-attention group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe, required_int
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping


@dataclasses.dataclass(frozen=True)
class AriaTextSpec(ArchSpec):
    """`ArchSpec` plus `mlp_bias` (biases on the shared experts' projections)."""

    mlp_bias: bool = False


class AriaTextForCausalLM(MoeCausalLM):
    """Aria's text decoder on the engine's layers (module docstring)."""

    card = FamilyCard("Aria (text)", ("rhymes-ai/Aria",), "GQA, q/k/v/o biases")

    spec_class = AriaTextSpec
    model_types = ("aria_text",)
    # Order matters for `checkpoint_name`, which undoes the renames last first.
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.router.", ".mlp.gate."),
            (".mlp.experts.fc1.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.experts.fc2.weight", ".mlp.experts.down_proj"),
        ),
        experts=ExpertMapping(fused_in_out=True),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE: `moe_num_experts` (default 8) experts of width
        `intermediate_size`, top-k `moe_topk` (default 2), shared experts of
        `intermediate_size * moe_num_shared_experts` (default 2); q/k/v/o biases from
        `attention_bias`.

        Raises:
            ValueError: a required field missing (named).
        """
        cfg = {**cfg, "num_experts": cfg.get("moe_num_experts", 8)}
        shared = int(cfg.get("moe_num_shared_experts", 2) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            top_k=int(cfg.get("moe_topk", 2)),
            qk_norm=False,
            norm_topk_prob=True,
            shared_expert_intermediate_size=required_int(cfg, "intermediate_size") * shared,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The base fields (plain RoPE) and `mlp_bias`.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return {**super().spec_fields(hf_config), "mlp_bias": bool(hf_config.mlp_bias)}

    def build_attention(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Llama attention: biases on q/k/v/o from `attention_bias`."""
        return Attention(spec, dtype, rotary, o_bias=spec.attention_bias)

    def build_mlp(self, spec: AriaTextSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Top-k-then-softmax routing and the shared experts (biases from `mlp_bias`)."""
        width, bias = spec.shared_expert_intermediate_size, spec.mlp_bias
        shared = SharedExperts(spec.hidden_size, width, dtype, bias=bias) if width else None
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            True, dtype, routing="topk_softmax", shared_experts=shared,
        )
