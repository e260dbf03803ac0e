"""ERNIE-4.5-MoE (Baidu ERNIE team, "ERNIE 4.5 Technical Report", 2025,
baidu/ERNIE-4.5-21B-A3B-PT; HF `Ernie4_5_MoeForCausalLM`, transformers 5.24
`modeling_ernie4_5_moe.py`).

A Llama-style GQA decoder that differs in:
- biases on q/k/v/o, on every dense and shared MLP projection and on the LM head when
  `use_bias` (default false); no q/k norm;
- RoPE on interleaved pairs (x0, x1), (x2, x3), ... (GLM style, `Ernie4_5_MoeRotaryEmbedding`
  + `apply_rotary_pos_emb`: `layers/rotary.RotaryEmbedding(interleaved=True)`; q and k are
  permuted alike, so attention is unchanged);
- layer i is an MoE block when (i + 1) % `moe_layer_interval` == 0 and
  `moe_layer_start_index` <= i <= `moe_layer_end_index` (-1: the last layer), else a dense
  SwiGLU MLP of `intermediate_size` (dense-first layers, MoE every N-th);
- routing: a float32 router, softmax over all experts, the choice by the probabilities plus
  the correction bias `moe_statics.e_score_correction_bias` [1, E], the weights the unbiased
  probabilities renormalised (`Ernie4_5_MoeTopKRouter`: `layers/routing.
  SigmoidGroupedTopKRouter(scoring="softmax")` with one group and no scaling);
- `moe_num_shared_experts` shared experts as one ungated MLP of width
  `moe_intermediate_size * moe_num_shared_experts` (biases from `use_bias`).

Checkpoint names: the base mapping's (`self_attn.{q,k,v}_proj` stacked into `qkv_proj`,
`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` or the fused
`mlp.experts.gate_up_proj` / `down_proj`, `mlp.shared_experts.*`, `lm_head.bias`), plus
`mlp.moe_statics.e_score_correction_bias` -> the router's `mlp.gate.e_score_correction_bias`
(kept [1, E] as stored). The checkpoints' multi-token-prediction tensors (`mtp*`) are skipped
unread, as transformers ignores them. KV cache: one full-attention group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, num_experts_of, required_int
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class Ernie4_5_MoeSpec(ArchSpec):
    """`ArchSpec` plus ERNIE's biases: `use_bias` (dense and shared MLPs, LM head)."""

    use_bias: bool = False


def interval_moe_layers(cfg: dict) -> tuple[int, ...]:
    """Layers i with (i + 1) % `moe_layer_interval` == 0 and `moe_layer_start_index` <= i <=
    `moe_layer_end_index` (-1: the last), when the config has experts (defaults 1, 1, -1 as
    `Ernie4_5_MoeConfig`).

    Raises:
        ValueError: num_hidden_layers missing, or an interval below 1.
    """
    layers = required_int(cfg, "num_hidden_layers")
    interval = int(cfg.get("moe_layer_interval") or 1)
    if interval < 1:
        raise ValueError(f"config.json: moe_layer_interval {interval} must be >= 1")
    start = int(cfg.get("moe_layer_start_index", 1))
    end = int(cfg.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    if not num_experts_of(cfg):
        return ()
    return tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)


class Ernie4_5_MoeForCausalLM(MoeCausalLM):
    """ERNIE-4.5-MoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "ERNIE-4.5-MoE", ("baidu/ERNIE-4.5-21B-A3B-PT", "baidu/ERNIE-4.5-300B-A47B-PT"),
        "GQA, interleaved rope",
    )

    spec_class = Ernie4_5_MoeSpec
    model_types = ("ernie4_5_moe",)
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        ),
        skipped=(r"(^|\.)mtp",),  # the multi-token-prediction block (transformers ignores it)
    )

    def __init__(self, spec: Ernie4_5_MoeSpec, dtype: torch.dtype, max_position: int | None = None):
        super().__init__(spec, dtype, max_position)
        if spec.use_bias:  # lm_head.bias [vocab]
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=True, dtype=dtype)
            if spec.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `moe_layer_interval` / start / end; `moe_num_experts` experts of
        `moe_intermediate_size`, top-k `moe_k`; q/k/v/o biases from `use_bias`; shared experts
        of `moe_intermediate_size * moe_num_shared_experts` (default 2); float32 routers with
        a correction bias; tied embeddings by default.

        Raises:
            ValueError: a required field missing (named), a moe_layer_interval below 1.
        """
        cfg = {**cfg, "num_experts": cfg.get("moe_num_experts", 64)}
        shared = int(cfg.get("moe_num_shared_experts", 2) or 0)
        use_bias = bool(cfg.get("use_bias", False))
        return cls.moe_shape(
            cfg,
            moe_layers=interval_moe_layers(cfg),
            top_k=int(cfg.get("moe_k", 6)),
            attention_bias=use_bias,
            qk_norm=False,
            norm_topk_prob=True,
            shared_expert_intermediate_size=required_int(cfg, "moe_intermediate_size") * shared,
            router_correction_bias=True,
            router_float32=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, use_bias.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            use_bias=bool(hf_config.use_bias),
        )

    def build_rotary(self, spec: ArchSpec, max_position: int) -> nn.Module:
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, interleaved=True)

    def build_attention(
        self, spec: Ernie4_5_MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k/v/o biases from `use_bias`."""
        return Attention(spec, dtype, rotary, o_bias=spec.use_bias)

    def build_mlp(self, spec: Ernie4_5_MoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP off `moe_layers`; else float32 softmax routing with the correction bias
        for the choice, renormalised, and the shared experts."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, bias=spec.use_bias)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, True, 1.0, scoring="softmax"
        )
        # the checkpoint's [1, E] (`moe_statics`: one row per expert group, one group)
        router.e_score_correction_bias = router.e_score_correction_bias.view(1, -1)
        width, bias = spec.shared_expert_intermediate_size, spec.use_bias
        shared = SharedExperts(spec.hidden_size, width, dtype, bias=bias) if width else None
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            True, dtype, router=router, shared_experts=shared,
        )
