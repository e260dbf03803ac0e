"""Qwen3-MoE (Qwen team, "Qwen3 Technical Report", 2025; HF `Qwen3MoeForCausalLM`).

Llama-style decoder with per-head q/k RMSNorm, softmax-then-top-k routing renormalised when
`norm_topk_prob`, and dense MLP layers where `mlp_only_layers` or `decoder_sparse_step` say so.
Checkpoint names are the base mapping's: `self_attn.{q,k,v}_proj` (stacked into `qkv_proj`),
`mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import (
    every_layer_moe,
    sparse_step_moe_layers,
    uniform_window_fields,
)
from moe_engine.models.spec import FamilyCard


class Qwen3MoeForCausalLM(MoeCausalLM):
    card = FamilyCard(
        "Qwen3-MoE", ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
        "GQA, q/k norm, optional sliding window",
    )
    model_types = ("qwen3_moe",)

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        """`moe_intermediate_size` (`intermediate_size` in a config without it, whose layers
        are then all MoE)."""
        return "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Layer i is MoE when i is not in `mlp_only_layers`, `num_experts` > 0 and
        (i + 1) % `decoder_sparse_step` == 0; the others are dense of `intermediate_size`.
        A window only with `use_sliding_window` (transformers drops it otherwise)."""
        width = cls.experts_width_field(cfg)
        moe_layers = sparse_step_moe_layers(cfg) if width != "intermediate_size" else (
            every_layer_moe(cfg)
        )
        return cls.moe_shape(
            cfg,
            moe_layers=moe_layers,
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            **uniform_window_fields(cfg, enabled=bool(cfg.get("use_sliding_window", False))),
        )
