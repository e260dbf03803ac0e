"""Flint (RecursiveSI, model card "RecursiveSI/flint"; HF `FlintForCausalLM`, transformers
`models/flint/modeling_flint.py`).

A Qwen3-MoE-style decoder (`layers/decoder.py`, per-head q/k RMSNorm before the rope) that
differs in:
- attention per `layer_types`: sliding-window layers (window `sliding_window`, the query
  included) are the only RoPE layers; full-attention layers (default the first two, every
  fourth from layer 1, and the last) use no positional encoding (no rotary module);
- a learned attention sink per query head in every layer (`FlintAttention.sinks`, float32 in
  transformers);
- RMSNorms multiplying by the weight in float32 (`GptOssRMSNorm`), the q/k norms included;
- the router scores experts by sigmoid of float32 logits, top-k, renormalised when
  `norm_topk_prob` (`FlintTopKRouter`: the grouped sigmoid router with one group and no
  correction bias);
- an ungated shared expert of width `shared_expert_intermediate_size` added in full; dense MLPs
  of width `intermediate_size` on `mlp_only_layers` (default [0, 1]).

Checkpoint names (`model.layers.{i}.` + ...; transformers' "flint" conversion mapping):
`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `self_attn.softmax_offset` [num_heads] (the
sinks); `mlp.gate.weight` [E, H] (float32); per-expert `mlp.experts.{e}.{gate,up,down}_proj`
(or transformers 5's fused `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]);
`mlp.shared_expert.{gate,up,down}_proj`; dense layers' `mlp.{gate,up,down}_proj`.

KV cache: a full-attention group and a sliding-window group (`kv_cache.spec`), prefix caching
as for gpt-oss.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import (
    check_hidden_act,
    layer_types_fields,
    required_int,
    sparse_step_moe_layers,
)
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `FlintConfig` defaults.
DEFAULT_SLIDING_WINDOW = 513
DEFAULT_MLP_ONLY_LAYERS = (0, 1)


def flint_layer_types(cfg: dict) -> list[str]:
    """`layer_types`, default full attention on layers 0, 1, every i % 4 == 1 and the last."""
    layers = required_int(cfg, "num_hidden_layers")
    return cfg.get("layer_types") or [
        "full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention"
        for i in range(layers)
    ]


class FlintForCausalLM(MoeCausalLM):
    """Flint on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Flint", ("RecursiveSI/flint",),
        "GQA, q/k norm, sliding RoPE + NoPE full layers, attention sinks",
        cache=("full", "sliding"), native_4bit=(),
    )

    model_types = ("flint",)
    weight_mapping = WeightMapping(renames=(
        (".mlp.shared_expert.", ".mlp.shared_experts."),
        (".self_attn.softmax_offset", ".self_attn.sinks"),
    ))

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers off `mlp_only_layers` (default [0, 1]) every `decoder_sparse_step`;
        experts `num_experts` of `moe_intermediate_size`, a shared expert of
        `shared_expert_intermediate_size`, dense width `intermediate_size`; q/k norms, sinks,
        a float32 router; `flint_layer_types` with `sliding_window` (default 513).

        Raises:
            ValueError: a required field missing, a malformed layer_types / sliding_window.
        """
        cfg = {**cfg, "layer_types": flint_layer_types(cfg)}
        if cfg.get("mlp_only_layers") is None:
            cfg["mlp_only_layers"] = list(DEFAULT_MLP_ONLY_LAYERS)
        return cls.moe_shape(
            cfg,
            moe_layers=sparse_step_moe_layers(cfg),
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            attention_sinks=True,
            shared_expert_intermediate_size=required_int(cfg, "shared_expert_intermediate_size"),
            router_float32=True,
            **layer_types_fields(cfg, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps and rope_theta.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act not silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta_of(hf_config))

    def build_norm(self, spec, size: int, dtype: torch.dtype) -> nn.Module:
        """`FlintRMSNorm` (gpt-oss's): the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_rotary(self, spec, max_position: int) -> nn.Module:
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta)

    def build_attention(self, spec, index: int, dtype: torch.dtype, rotary: nn.Module
                        ) -> nn.Module:
        """Sliding layers: the rope and the window; full layers: no positional encoding;
        sinks, q/k norms of the float32-weight kind, no o_proj bias."""
        sliding = spec.layer_types[index] == "sliding_attention"
        attn = Attention(spec, dtype, rotary if sliding else None,
                         spec.sliding_window if sliding else None, o_bias=False, sinks=True)
        attn.q_norm = self.build_norm(spec, spec.head_dim, dtype)
        attn.k_norm = self.build_norm(spec, spec.head_dim, dtype)
        return attn

    def build_mlp(self, spec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP off `moe_layers`; else sigmoid top-k routing (float32 router, no
        correction bias) and the ungated shared expert."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, spec.norm_topk_prob, 1.0,
            correction_bias=False,
        )
        shared = SharedExperts(spec.hidden_size, spec.shared_expert_intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router, shared_experts=shared,
        )
