"""Mistral-Small-4 (Mistral AI, model card mistralai/Mistral-Small-4-119B-2603, 2026; HF
`Mistral4ForCausalLM`, transformers 5.24 `models/mistral4/modeling_mistral4.py`).

DeepSeek-V3's decoder (`deepseek_v3.py`: MLA with its latent cache, dense first layers,
shared experts, the same checkpoint names) with Mistral-4's differences:
- routing (`Mistral4TopkRouter`): softmax over all experts (not sigmoid), no correction bias,
  `n_group` groups ranked by the sum of their two best probabilities, the best `topk_group`
  kept, weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`
  (`layers/routers.SigmoidGroupedTopKRouter` with `scoring` "softmax");
- rope over the `qk_rope_head_dim` dims (`partial_rotary_factor` = rope / (nope + rope) of a
  head_dim of nope + rope), YaRN by default, on interleaved pairs when `rope_interleave`;
- Llama-4's attention temperature: queries times 1 + beta * log(1 + floor(position /
  original_max_position_embeddings)) with beta `rope_parameters["llama_4_scaling_beta"]`
  (`MLAAttention(query_position_scaling=)`);
- MoE in layer i >= `first_k_dense_replace` (default 0: every layer), `n_shared_experts`
  (default 1) ungated shared experts.
The router weight is held (and computed) in float32; transformers keeps it in the model
dtype, so a bfloat16 model's routing may differ from transformers' in the last bits.

Checkpoint names are DeepSeek-V3's (`self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`, `mlp.gate.weight`, per-expert or
fused experts, `mlp.shared_experts.*`). KV cache: one MLA latent group of every layer;
prefix caching applies.

Refused (ValueError naming the field): a hidden_act other than silu, a missing kv_lora_rank
or q_lora_rank key, group limits `check_sigmoid_group_limits` refuses, `rope_parameters`
without llama_4_scaling_beta or original_max_position_embeddings (transformers' forward needs
both), a rotated width other than qk_rope_head_dim.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.config_fields import num_experts_of, required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Spec
from moe_engine.models.layers.mla import MLAAttention
from moe_engine.models.layers.rotary import partial_rotary_factor_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.spec import FamilyCard


@dataclasses.dataclass(frozen=True)
class Mistral4Spec(DeepseekV3Spec):
    """`DeepseekV3Spec` plus Llama-4's query scaling (beta, original_max_position_embeddings)."""

    query_position_scaling: tuple[float, int] | None = None


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral-Small-4 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Mistral-Small-4", ("mistralai/Mistral-Small-4-119B-2603",),
        "MLA (latent-only cache, absorbed decode)", cache=("mla",),
    )

    spec_class = Mistral4Spec
    model_types = ("mistral4",)
    mtp_layers_field = None

    @classmethod
    def check_routing(cls, cfg: dict) -> None:
        """The group limits (transformers' defaults n_group = topk_group = 1 when absent);
        Mistral-4's router reads no topk_method or scoring_func.

        Raises:
            ValueError: see `check_sigmoid_group_limits`.
        """
        check_sigmoid_group_limits(
            num_experts_of(cfg), required_int(cfg, "num_experts_per_tok"),
            int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
        )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """DeepSeek-V3's fields with Mistral-4's defaults (n_shared_experts 1) and a router
        without correction bias.

        Raises:
            ValueError: a missing, malformed or refused field (module doc).
        """
        fields = super().shape_fields({**cfg, "n_shared_experts": cfg.get("n_shared_experts", 1)})
        return {**fields, "router_correction_bias": False}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """DeepSeek-V3's (rope, YaRN, interleave, group limits, scaling) and the query
        scaling of `rope_parameters`.

        Raises:
            ValueError: llama_4_scaling_beta or original_max_position_embeddings missing, or
                a rotated width other than qk_rope_head_dim; StartupError: a rope_type other
                than default or yarn.
        """
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        beta, period = params.get("llama_4_scaling_beta"), params.get(
            "original_max_position_embeddings"
        )
        if beta is None or not period:
            raise ValueError(
                f"config.json: rope_parameters {params} must give llama_4_scaling_beta and "
                "original_max_position_embeddings (Mistral-4's query scaling; transformers "
                "fails without them)"
            )
        head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        rotated = int(head_dim * partial_rotary_factor_of(hf_config))
        if rotated != hf_config.qk_rope_head_dim:
            raise ValueError(
                f"config.json: partial_rotary_factor rotates {rotated} of {head_dim} dims; "
                f"supported: qk_rope_head_dim = {hf_config.qk_rope_head_dim}"
            )
        fields = super().spec_fields(hf_config)
        return {**fields, "query_position_scaling": (float(beta), int(period))}

    def build_attention(
        self, spec: Mistral4Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """`MLAAttention` with the Llama-4 query scaling."""
        return MLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias,
            query_position_scaling=spec.query_position_scaling, dtype=dtype,
        )

    def build_router(self, spec: Mistral4Spec) -> nn.Module:
        """Softmax scores, the group limit by top-2 sums, no correction bias (float32)."""
        return SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.n_group, spec.topk_group,
            spec.norm_topk_prob, spec.routed_scaling_factor, correction_bias=False,
            scoring="softmax",
        )
