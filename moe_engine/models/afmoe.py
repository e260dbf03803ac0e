"""AFMoE (Arcee AI, Trinity models, 2025; HF `AfmoeForCausalLM`, transformers 5.24
`modeling_afmoe.py`).

A Llama-style GQA decoder that differs in:
- "sandwich" norms: the attention and MLP outputs are each normalised before their residual
  add (`layers/decoder.DecoderLayer` with output norms); every norm multiplies its weight in
  float32 (gpt-oss's `RMSNorm(weight_in_float32=True)`);
- gated attention: the output times sigmoid(`gate_proj`(x)), per element, before o_proj;
  per-head q/k RMSNorm; a local/global mix (`layer_types`, by default every
  `global_attn_every_n_layers`-th layer global): sliding layers use RoPE, global ones none
  (NoPE);
- the first `num_dense_layers` layers dense SwiGLU MLPs of `intermediate_size`; then MoE
  blocks routed by sigmoid scores of a router in the model dtype, `expert_bias` choosing (never
  weighting) the top-k, the k weights renormalised, times `route_scale`
  (`layers/routers.SigmoidGroupedTopKRouter` without groups), plus `num_shared_experts`
  ungated shared experts of width `moe_intermediate_size * num_shared_experts`;
- with `mup_enabled`, the embeddings times hidden_size ** 0.5.

Checkpoint names: `mlp.router.gate.weight` -> `mlp.gate.weight`, `mlp.expert_bias` ->
`mlp.gate.e_score_correction_bias`, the attention-output norm `post_attention_layernorm` ->
`post_self_attn_layernorm` and the pre-MLP norm `pre_mlp_layernorm` ->
`post_attention_layernorm` (the engine's decoder-layer names); the rest are the base
mapping's (`self_attn.gate_proj` included). KV cache: a full-attention group and a
sliding-window group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.dots1 import shared_width, window_layer_fields
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `AfmoeConfig` defaults.
DEFAULT_SLIDING_WINDOW = 1024
DEFAULT_GLOBAL_EVERY = 4


@dataclasses.dataclass(frozen=True)
class AfmoeSpec(ArchSpec):
    """`ArchSpec` plus AFMoE's routing scale.

    Attributes:
        routed_scaling_factor: `route_scale`, multiplies the routed weights.
    """

    routed_scaling_factor: float = 1.0


class AfmoeForCausalLM(MoeCausalLM):
    """AFMoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "AFMoE (Arcee Trinity)", ("arcee-ai/Trinity-Mini", "arcee-ai/Trinity-Large"),
        "gated GQA, q/k norm, sandwich norms, sliding RoPE / global NoPE mix",
        cache=("full", "sliding"),
    )

    spec_class = AfmoeSpec
    model_types = ("afmoe",)
    # Order matters: the attention-output norm's name is freed before the pre-MLP norm takes it.
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.router.gate.", ".mlp.gate."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".post_attention_layernorm.", ".post_self_attn_layernorm."),
            (".pre_mlp_layernorm.", ".post_attention_layernorm."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers from `num_dense_layers` (default 1) on; q/k norm; gated attention;
        shared experts of `num_shared_experts` (default 2); `layer_types` as `AfmoeConfig`
        derives them.

        Raises:
            ValueError: a required field missing (named), malformed layer types or window.
        """
        layers = required_int(cfg, "num_hidden_layers")
        every = int(cfg.get("global_attn_every_n_layers") or DEFAULT_GLOBAL_EVERY)
        types = [SLIDING_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(layers)]
        first = int(cfg.get("num_dense_layers", 1) or 0)
        return cls.moe_shape(
            cfg,
            moe_layers=tuple(range(first, layers)) if cfg.get("num_experts", 64) else (),
            qk_norm=True,
            norm_topk_prob=True,
            shared_expert_intermediate_size=shared_width(cfg, "num_shared_experts", 2),
            router_correction_bias=True,
            **window_layer_fields(cfg, types, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, the NoPE (global) layers, `route_scale`, the muP
        embedding scale.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        nope = tuple(i for i, t in enumerate(hf_config.layer_types) if t != SLIDING_ATTENTION)
        return dict(
            **super().spec_fields(hf_config),
            nope_layers=nope,
            routed_scaling_factor=float(hf_config.route_scale),
            embedding_multiplier=hf_config.hidden_size**0.5 if hf_config.mup_enabled else 1.0,
        )

    def build_norm(self, spec: AfmoeSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`AfmoeRMSNorm` (gpt-oss's): the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_attention(
        self, spec: AfmoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k norms multiplying their weight in float32 (`AfmoeRMSNorm`), the sigmoid output
        gate, sliding with rope or global without."""
        sliding = spec.layer_types[index] == SLIDING_ATTENTION if spec.layer_types else False
        return Attention(
            spec, dtype, None if index in spec.nope_layers else rotary,
            spec.sliding_window if sliding else None, o_bias=spec.attention_bias,
            output_gate=True, qk_norm_in_float32=True,
        )

    def build_mlp(self, spec: AfmoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """The base dense MLP before `num_dense_layers`; then sigmoid top-k with the expert
        bias (router in the model dtype) and the shared experts."""
        if index not in spec.moe_layers:
            return super().build_mlp(spec, index, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, True,
            spec.routed_scaling_factor, dtype=dtype,
        )
        width = spec.shared_expert_intermediate_size
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size, True,
            dtype, router=router,
            shared_experts=SharedExperts(spec.hidden_size, width, dtype) if width else None,
        )

    def build_layer(
        self, spec: AfmoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Pre-norms and output norms around both branches."""
        norm = self.build_norm
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            post_self_attn_layernorm=norm(spec, spec.hidden_size, dtype),
            post_mlp_layernorm=norm(spec, spec.hidden_size, dtype),
        )
