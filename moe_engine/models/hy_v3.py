"""Hy3 (Tencent Hunyuan, "Hy3-preview", 2026; HF `HYV3ForCausalLM`, transformers 5.24
`modeling_hy_v3.py`).

A Llama-style GQA decoder that differs in:
- per-head q/k RMSNorm before the rope; biases on q/k/v/o when `attention_bias`;
- `mlp_layer_types` ("dense" / "sparse"; default the first layer dense): dense SwiGLU MLPs of
  `intermediate_size`, or MoE blocks of `num_experts` experts routed by sigmoid scores with a
  correction bias choosing (never weighting) the top-k, the k weights renormalised, times
  `router_scaling_factor` (`layers/routers.SigmoidGroupedTopKRouter` without groups; float32
  router), plus `num_shared_experts` ungated shared experts of width `moe_intermediate_size *
  num_shared_experts`; dense MLPs and shared experts have biases when `mlp_bias`.
  `enable_moe_fp32_combine` (routed + shared summed in float32, then rounded) rounds as the
  engine's add already does.

Checkpoint names (the hub's; transformers renames them on load, `conversion_mapping`):
`mlp.router.gate.weight` -> `mlp.gate.weight`, `mlp.expert_bias` ->
`mlp.gate.e_score_correction_bias`, `mlp.shared_mlp.*` -> `mlp.shared_experts.*`; the rest
are the base mapping's. The multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`)
is skipped unread, as transformers ignores it. KV cache: one full-attention group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act
from moe_engine.models.exaone_moe import mlp_layer_types_moe_layers
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class HYV3Spec(ArchSpec):
    """`ArchSpec` plus Hy3's router scale and MLP biases.

    Attributes:
        routed_scaling_factor: `router_scaling_factor`, multiplies the routed weights.
        mlp_bias: dense MLPs and shared experts have biases.
    """

    routed_scaling_factor: float = 1.0
    mlp_bias: bool = False


class HYV3ForCausalLM(MoeCausalLM):
    """Hy3 on the engine's layers (module docstring)."""

    card = FamilyCard("Hy3", ("tencent/Hy3-preview",), "GQA, q/k norm")

    spec_class = HYV3Spec
    model_types = ("hy_v3",)
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.router.gate.", ".mlp.gate."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".mlp.shared_mlp.", ".mlp.shared_experts."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types` (default the first dense); q/k norm; biases on
        q/k/v/o from `attention_bias`; shared experts of `num_shared_experts` (default 1);
        float32 routers with a correction bias; top-k always renormalised.

        Raises:
            ValueError: a required field missing (named), a malformed mlp_layer_types.
        """
        shared = int(cfg.get("num_shared_experts", 1) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=mlp_layer_types_moe_layers(cfg, 1),
            qk_norm=True,
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(cfg["moe_intermediate_size"]) * shared,
            router_correction_bias=True,
            router_float32=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, the router scale, `mlp_bias`.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(
            **super().spec_fields(hf_config),
            routed_scaling_factor=float(hf_config.router_scaling_factor),
            mlp_bias=bool(hf_config.mlp_bias),
        )

    def build_attention(
        self, spec: HYV3Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k norm; biases on q/k/v/o from `attention_bias`."""
        return Attention(spec, dtype, rotary, o_bias=spec.attention_bias)

    def build_mlp(self, spec: HYV3Spec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP off `moe_layers`; else sigmoid top-k with the correction bias and the
        shared experts (biases from `mlp_bias` on both)."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, bias=spec.mlp_bias)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, True,
            spec.routed_scaling_factor,
        )
        width = spec.shared_expert_intermediate_size
        shared = (
            SharedExperts(spec.hidden_size, width, dtype, bias=spec.mlp_bias) if width else None
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size, True,
            dtype, router=router, shared_experts=shared,
        )
