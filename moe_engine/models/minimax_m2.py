"""MiniMax-M2 (MiniMax, "MiniMax-M2" model card, 2025, MiniMaxAI/MiniMax-M2; HF
`MiniMaxM2ForCausalLM`, transformers 5.24 `modeling_minimax_m2.py`).

A Llama-style GQA decoder, every layer a sparse MoE block, that differs in:
- q/k RMSNorm over each token's *whole* q projection [Hq * D] and k projection [Hkv * D]
  (`MiniMaxM2Attention.q_norm` / `k_norm`), before the rope, not per head
  (`layers/self_attention.Attention(qk_norm_per_head=False)`); no biases;
- partial rotary: the first `rotary_dim` (config.json; transformers turns it into
  `partial_rotary_factor`) dims of each head are rotated, "rotate half" within them
  (`layers/rotary.PartialRotaryEmbedding`);
- routing: sigmoid scores, `e_score_correction_bias` added for the choice only, top-k, the
  unbiased scores renormalised (`MiniMaxM2TopKRouter`: `layers/routing.
  SigmoidGroupedTopKRouter` with one group and no scaling; the router weight in the model
  dtype, as transformers keeps it, its logits then taken to float32); experts of width
  `intermediate_size`; no shared experts.

Checkpoint names are Mixtral's: `block_sparse_moe.gate.weight`,
`block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down) (or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj`), plus the block's own
`block_sparse_moe.e_score_correction_bias` [E] -> the router's `mlp.gate.e_score_correction_bias`.
Released checkpoints are FP8 block-quantized (`weight_scale_inv`: the loader's FP8 transform,
not exercised by this family's tests).
KV cache: one full-attention group of every layer (transformers' MiniMax-M2 has no sliding
window).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import (
    PartialRotaryEmbedding,
    partial_rotary_dim_of,
    rope_theta_of,
)
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Spec(ArchSpec):
    """`ArchSpec` plus the rotated dims of each head (`rotary_dim`)."""

    rotary_dim: int = 0


class MiniMaxM2ForCausalLM(MoeCausalLM):
    """MiniMax-M2 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "MiniMax-M2", ("MiniMaxAI/MiniMax-M2",),
        "GQA, q/k norm over the whole projection, partial rotary",
    )

    spec_class = MiniMaxM2Spec
    model_types = ("minimax_m2",)
    # Order matters for `checkpoint_name`, which undoes the renames last first.
    weight_mapping = WeightMapping(
        renames=(
            (".block_sparse_moe.", ".mlp."),
            (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        ),
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE (`num_local_experts` experts of width `intermediate_size`); q/k
        norms; renormalised routing with a correction bias; no sliding window.

        Raises:
            ValueError: a required field missing (named).
        """
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            qk_norm=True,
            norm_topk_prob=True,
            router_correction_bias=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta and the rotated dims.

        Raises:
            StartupError: a rope_type other than default, a partial_rotary_factor outside
                (0, 1]; ValueError: hidden_act other than silu, an odd rotary_dim.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            rotary_dim=partial_rotary_dim_of(hf_config),
        )

    def build_rotary(self, spec: MiniMaxM2Spec, max_position: int) -> nn.Module:
        return PartialRotaryEmbedding(spec.head_dim, spec.rotary_dim, max_position, spec.rope_theta)

    def build_attention(
        self, spec: MiniMaxM2Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """No biases; q/k norms over the whole projections."""
        return Attention(spec, dtype, rotary, qk_norm=True, qk_norm_per_head=False)

    def build_mlp(self, spec: MiniMaxM2Spec, index: int, dtype: torch.dtype) -> nn.Module:
        """Sigmoid top-k with the correction bias, renormalised (one group, no scaling)."""
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, True, 1.0, dtype=dtype
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            True, dtype, router=router,
        )
