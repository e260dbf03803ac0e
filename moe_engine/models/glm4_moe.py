"""GLM-4.5 / GLM-4.5-Air (Zhipu AI, "GLM-4.5: Agentic, Reasoning, and Coding (ARC)
Foundation Models", 2025; HF `Glm4MoeForCausalLM`, transformers 5.24 `modeling_glm4_moe.py`).

A Llama-style GQA decoder that differs in:
- biases on q/k/v (`attention_bias`) but none on o_proj; optional per-head q/k RMSNorm
  (`use_qk_norm`) before the rope;
- partial rotary: only the first `head_dim * partial_rotary_factor` dims of each head are
  rotated ("rotate half" within them, `layers/rotary.PartialRotaryEmbedding`);
- the first `first_k_dense_replace` layers are dense SwiGLU MLPs of `intermediate_size`; the
  rest are MoE blocks with DeepSeek-V3-style routing (sigmoid scores, `e_score_correction_bias`
  for the choice only, group-limited top-k over `n_group` / `topk_group`, weights renormalised
  when `norm_topk_prob`, times `routed_scaling_factor`: `layers/routing.
  SigmoidGroupedTopKRouter`, weight and bias float32) plus `n_shared_experts` ungated shared
  experts as one MLP of width `moe_intermediate_size * n_shared_experts`.

Checkpoint names are the base mapping's: `self_attn.{q,k,v}_proj` (weights and biases,
stacked into `qkv_proj`), `self_attn.{q,k}_norm`, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (or
transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`), `mlp.shared_experts.*`.
Released checkpoints also hold the multi-token-prediction layer(s) as
`model.layers.{num_hidden_layers + j}.*` (`num_nextn_predict_layers`): built and loaded for
`--speculative-method mtp` (`layers/mtp.py`), else skipped unread as transformers does. KV
cache: one full-attention group of every layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import (
    PartialRotaryEmbedding,
    partial_rotary_dim_of,
    rope_theta_of,
)
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard


@dataclasses.dataclass(frozen=True)
class Glm4MoeSpec(ArchSpec):
    """`ArchSpec` plus GLM-4.5's routing and rope.

    Attributes:
        rotary_dim: dims of each head the rope rotates (head_dim * partial_rotary_factor).
        n_group, topk_group: the group limit (groups of E / n_group contiguous experts; each
            token uses at most topk_group of them).
        routed_scaling_factor: multiplies the routed experts' weights.
    """

    rotary_dim: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def first_k_dense_moe_layers(cfg: dict) -> tuple[int, ...]:
    """Layers `first_k_dense_replace` (transformers' default 1) .. num_hidden_layers - 1 when
    the config has routed experts, else ()."""
    layers = required_int(cfg, "num_hidden_layers")
    first = int(cfg.get("first_k_dense_replace", 1) or 0)
    return tuple(range(first, layers)) if cfg.get("n_routed_experts") else ()


class Glm4MoeForCausalLM(MoeCausalLM):
    """GLM-4.5 on the engine's layers (module docstring)."""
    card = FamilyCard(
        "GLM-4.5", ("zai-org/GLM-4.5", "zai-org/GLM-4.5-Air"),
        "GQA, q/k/v biases, q/k norm, partial rotary", speculation=("ngram", "mtp"),
    )

    spec_class = Glm4MoeSpec
    model_types = ("glm4_moe",)
    mtp_layers_field = "num_nextn_predict_layers"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers from `first_k_dense_replace` on (dense width `intermediate_size`), experts
        `n_routed_experts` of width `moe_intermediate_size`; q/k/v biases without an o_proj
        bias; q/k norm from `use_qk_norm`; one shared-expert MLP of width
        `moe_intermediate_size * n_shared_experts` per MoE layer; float32 routers with a
        correction bias. Missing fields take `Glm4MoeConfig`'s defaults (first_k_dense_replace
        1, n_shared_experts 1, norm_topk_prob true).

        Raises:
            ValueError: a required field missing (named).
        """
        width = required_int(cfg, "moe_intermediate_size")
        shared = int(cfg.get("n_shared_experts", 1) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=first_k_dense_moe_layers(cfg),
            o_proj_bias=False,
            qk_norm=bool(cfg.get("use_qk_norm", False)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=width * shared,
            router_correction_bias=True,
            router_float32=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta and the rotated dims, the group limit, the scaling.

        Raises:
            StartupError: a rope_type other than default, a partial_rotary_factor outside
                (0, 1]; ValueError: hidden_act other than silu, n_routed_experts not divisible
                by n_group (and the other `check_sigmoid_group_limits` cases), fewer than 2 experts
                per group, an odd rotary_dim.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        num_experts, n_group = int(hf_config.n_routed_experts), int(hf_config.n_group or 1)
        topk_group = int(hf_config.topk_group or 1)
        check_sigmoid_group_limits(
            num_experts, int(hf_config.num_experts_per_tok), n_group, topk_group
        )
        rotary_dim = partial_rotary_dim_of(hf_config)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            rotary_dim=rotary_dim,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
        )

    def build_rotary(self, spec: Glm4MoeSpec, max_position: int) -> nn.Module:
        return PartialRotaryEmbedding(spec.head_dim, spec.rotary_dim, max_position, spec.rope_theta)

    def build_attention(
        self, spec: Glm4MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k/v biases from `attention_bias`, no o_proj bias, q/k norm from `use_qk_norm`."""
        return Attention(spec, dtype, rotary, o_bias=False)

    def build_mlp(self, spec: Glm4MoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP before `first_k_dense_replace`; then sigmoid grouped routing with a
        correction bias and the shared experts."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.n_group, spec.topk_group,
            spec.norm_topk_prob, spec.routed_scaling_factor,
        )
        shared = spec.shared_expert_intermediate_size
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router,
            shared_experts=SharedExperts(spec.hidden_size, shared, dtype) if shared else None,
        )
