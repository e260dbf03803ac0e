"""Solar Open (Upstage, Solar-Open-100B, 2025; HF `SolarOpenForCausalLM`, transformers 5.24
`modeling_solar_open.py`).

GLM-4.5's MoE block (`glm4_moe.Glm4MoeForCausalLM`) under Llama's attention. It differs from
the Llama-style decoder in:
- biases on q/k/v when `attention_bias`, none on o_proj; no q/k norm; RoPE over the whole head
  (Llama's `apply_rotary_pos_emb`: a `partial_rotary_factor` below 1 is refused);
- every layer an MoE block (no dense layers): DeepSeek-V3 routing (sigmoid scores,
  `e_score_correction_bias` for the choice only, group-limited top-k, renormalised when
  `norm_topk_prob`, times `routed_scaling_factor`; float32 router) plus `n_shared_experts`
  ungated shared experts of width `moe_intermediate_size * n_shared_experts`.

Checkpoint names are the base mapping's (`self_attn.{q,k,v,o}_proj`, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.*`, `mlp.shared_experts.*`). KV cache: one
full-attention group.
"""

from __future__ import annotations

from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import every_layer_moe, required_int
from moe_engine.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeSpec
from moe_engine.models.spec import FamilyCard


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Solar Open on the engine's layers (module docstring)."""

    card = FamilyCard("Solar Open", ("upstage/Solar-Open-100B",), "GQA")

    model_types = ("solar_open",)
    mtp_layers_field = None

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE; q/k/v biases from `attention_bias`, none on o_proj; no q/k norm;
        shared experts of `n_shared_experts` (default 1).

        Raises:
            ValueError: a required field missing (named).
        """
        shared = int(cfg.get("n_shared_experts", 1) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            o_proj_bias=False,
            qk_norm=False,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=required_int(cfg, "moe_intermediate_size") * shared,
            router_correction_bias=True,
            router_float32=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """GLM-4.5's, with the rope over the whole head.

        Raises:
            ValueError: a partial_rotary_factor below 1 (transformers' Llama attention cannot
                apply it either), and `Glm4MoeForCausalLM.spec_fields`'s errors.
        """
        fields = super().spec_fields(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        if fields["rotary_dim"] != head_dim:
            raise ValueError(
                f"config.json: partial_rotary_factor rotates {fields['rotary_dim']} of "
                f"{head_dim} dims; SolarOpenForCausalLM supports the whole head only (1.0)"
            )
        return fields

    def build_rotary(self, spec: Glm4MoeSpec, max_position: int) -> nn.Module:
        return MoeCausalLM.build_rotary(self, spec, max_position)
