"""Qwen2-MoE / Qwen1.5-MoE (Qwen team, "Qwen2 Technical Report", arXiv:2407.10671, 2024; HF
`Qwen2MoeForCausalLM`, transformers 5.24 `modeling_qwen2_moe.py`).

A Llama-style GQA decoder that differs in:
- biases on q/k/v (`qkv_bias`, default true) but none on o_proj; no q/k norm;
- layer i is an MoE block when i is not in `mlp_only_layers`, `num_experts` > 0 and
  (i + 1) % `decoder_sparse_step` == 0, else a dense MLP of `intermediate_size`;
- routing: softmax over all experts, then the top-k, renormalised only when `norm_topk_prob`
  (default false) (`layers/routers.SoftmaxTopKRouter`; the router weight in the model dtype,
  as `Qwen2MoeTopKRouter` keeps it);
- one shared expert per MoE block, an MLP of width `shared_expert_intermediate_size` whose
  output is multiplied by sigmoid(`shared_expert_gate`(x)), a Linear(H, 1)
  (`layers/shared_experts.SharedExperts(gated=True)`);
- with `use_sliding_window`, layers i < `max_window_layers` with i even are sliding-window
  layers (`Qwen2MoeConfig.layer_types`), unless config.json lists `layer_types` itself.

Checkpoint names: the base mapping's (`self_attn.{q,k,v}_proj` stacked into `qkv_proj`,
`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` or the fused
`mlp.experts.gate_up_proj` / `down_proj`), plus the shared expert's
`mlp.shared_expert.{gate,up,down}_proj.weight` -> `mlp.shared_experts.*` and
`mlp.shared_expert_gate.weight` -> `mlp.shared_experts.expert_gate.weight`
(`layers/shared_experts.SHARED_EXPERT_CHECKPOINT_NAMES`). KV cache: one full-attention group,
or a full and a sliding-window group (`layer_types`).
"""

from __future__ import annotations

import torch

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import (
    check_hidden_act,
    layer_types_fields,
    required_int,
    sparse_step_moe_layers,
)
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.routers import SoftmaxTopKRouter
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `Qwen2MoeConfig.max_window_layers` default.
DEFAULT_MAX_WINDOW_LAYERS = 28
#: `Qwen2MoeConfig.sliding_window` default.
DEFAULT_SLIDING_WINDOW = 4096
#: `Qwen2MoeConfig.shared_expert_intermediate_size` default.
DEFAULT_SHARED_EXPERT_WIDTH = 5632


def qwen2_window_fields(cfg: dict) -> dict:
    """`layer_types` / `sliding_window` of a Qwen2-MoE config.json: {} (all full attention)
    unless `use_sliding_window`; then config.json's `layer_types`, or layers i <
    `max_window_layers` with (i + 1) odd sliding, as `Qwen2MoeConfig.__post_init__`.

    Raises:
        ValueError: a malformed layer_types, or a window below 1 token.
    """
    if not cfg.get("use_sliding_window", False):
        return {}
    layers = required_int(cfg, "num_hidden_layers")
    max_window = int(cfg.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS))
    types = cfg.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % 2 and i < max_window else FULL_ATTENTION
        for i in range(layers)
    ]
    fields = layer_types_fields({**cfg, "layer_types": types}, DEFAULT_SLIDING_WINDOW)
    return fields if fields["sliding_window"] is not None else {}


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE on the engine's layers (module docstring)."""
    card = FamilyCard(
        "Qwen2-MoE / Qwen1.5-MoE", ("Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen2-57B-A14B"),
        "GQA, q/k/v biases",
    )

    model_types = ("qwen2_moe",)
    # Order matters for `checkpoint_name`, which undoes the renames last first.
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.shared_expert.", ".mlp.shared_experts."),
            (".mlp.shared_expert_gate.", ".mlp.shared_experts.expert_gate."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_only_layers` / `decoder_sparse_step`; q/k/v biases from
        `qkv_bias` (default true) without an o_proj bias; a gated shared expert of
        `shared_expert_intermediate_size` (default 5632, as `Qwen2MoeConfig`) per MoE layer;
        `norm_topk_prob` default false.

        Raises:
            ValueError: a required field missing (named), a malformed layer_types or window.
        """
        shared = int(cfg.get("shared_expert_intermediate_size", DEFAULT_SHARED_EXPERT_WIDTH) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=sparse_step_moe_layers(cfg),
            attention_bias=bool(cfg.get("qkv_bias", True)),
            o_proj_bias=False,
            qk_norm=False,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared,
            shared_expert_gate=shared > 0,
            **qwen2_window_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The base fields (plain RoPE).

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return super().spec_fields(hf_config)

    def build_mlp(self, spec: ArchSpec, index: int, dtype: torch.dtype) -> torch.nn.Module:
        """The base dense MLP off `moe_layers`; else softmax top-k routing (router weight in
        the model dtype) and the sigmoid-gated shared expert."""
        if index not in spec.moe_layers:
            return super().build_mlp(spec, index, dtype)
        width = spec.shared_expert_intermediate_size
        shared = SharedExperts(spec.hidden_size, width, dtype, gated=True) if width else None
        router = SoftmaxTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.norm_topk_prob, dtype
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router, shared_experts=shared,
        )
