"""Mixtral (Jiang et al., "Mixtral of Experts", 2024; HF `MixtralForCausalLM`).

Llama-style decoder where every layer is a sparse MoE block; routing is softmax, top-k, then
always renormalised over the k chosen experts. Checkpoint names: the MoE block is
`block_sparse_moe` (router `block_sparse_moe.gate`, experts `experts.{e}.w1` (gate), `w3` (up),
`w2` (down)); transformers 5 writes `mlp.experts.gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import every_layer_moe, uniform_window_fields
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping


class MixtralForCausalLM(MoeCausalLM):
    card = FamilyCard(
        "Mixtral", ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1"), "GQA"
    )
    model_types = ("mixtral",)
    weight_mapping = WeightMapping(
        renames=((".block_sparse_moe.", ".mlp."),),
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer is MoE, of width `intermediate_size`; `sliding_window` windows all."""
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            qk_norm=False,
            norm_topk_prob=True,
            **uniform_window_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """Raises: ValueError: a sliding window (not implemented for Mixtral)."""
        if getattr(hf_config, "sliding_window", None):
            raise ValueError(
                f"sliding_window={hf_config.sliding_window}: sliding-window Mixtral is not "
                "supported yet (set sliding_window to null in config.json for full attention)"
            )
        return super().spec_fields(hf_config)
