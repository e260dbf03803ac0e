"""Laguna (poolside, laguna-XS.2, 2026; HF `LagunaForCausalLM`, transformers 5.24
`modeling_laguna.py`).

A Llama-style pre-norm GQA decoder that differs in:
- per-layer query heads (`num_attention_heads_per_layer`; the key/value heads are shared by
  all layers, so every layer's KV cache has one shape);
- a rope per attention kind (`rope_parameters` keyed by "full_attention" /
  "sliding_attention": by default theta 500000 over half of each head for full layers, theta
  10000 over the whole head for sliding ones; `layers/rotary.PartialRotaryEmbedding`);
  `layer_types` (default all full) with `sliding_window`;
- per-head q/k RMSNorm; a softplus output gate: the attention output times
  softplus(`g_proj`(x)) (one value per head, broadcast over its dims, when `gating` is true or
  "per-head"; one per element for "per-element") before o_proj;
- `mlp_layer_types` (default the first layer dense, of `intermediate_size`); MoE blocks routed
  by sigmoid scores of a router in the model dtype, `e_score_correction_bias` choosing (never
  weighting) the top-k, the k weights renormalised; the routed output times
  `moe_routed_scaling_factor` (here folded into the weights, `SigmoidGroupedTopKRouter`'s
  scaling: the same value up to float rounding), plus one ungated shared expert of
  `shared_expert_intermediate_size`.
Refused (ValueError naming the field): `moe_router_logit_softcapping` > 0 (tanh-capped router
logits are not implemented), `moe_apply_router_weight_on_input` (transformers refuses it too).

Checkpoint names (the hub's; transformers renames them on load, `conversion_mapping`):
`mlp.experts.e_score_correction_bias` -> `mlp.gate.e_score_correction_bias`,
`mlp.shared_expert.*` -> `mlp.shared_experts.*`; `self_attn.g_proj` -> `self_attn.gate_proj`;
the rest are the base mapping's. KV cache: a full-attention group, plus a sliding-window group
when some layer slides.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.dots1 import window_layer_fields
from moe_engine.models.exaone_moe import mlp_layer_types_moe_layers
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import PartialRotaryEmbedding
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `LagunaConfig` defaults.
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_SHARED_WIDTH = 512


@dataclasses.dataclass(frozen=True)
class LagunaSpec(ArchSpec):
    """`ArchSpec` plus Laguna's per-layer and per-kind numbers.

    Attributes:
        heads_per_layer: query heads of each layer.
        rope: per attention kind, (rope_theta, rotated dims of each head).
        gate_per_head: the output gate has one value per head (else per element).
        routed_scaling_factor: `moe_routed_scaling_factor`.
    """

    heads_per_layer: tuple[int, ...] = ()
    rope: tuple[tuple[str, float, int], ...] = ()
    gate_per_head: bool = True
    routed_scaling_factor: float = 1.0


def rope_by_kind(hf_config) -> tuple[tuple[str, float, int], ...]:
    """(kind, rope_theta, rotated dims) per attention kind of `rope_parameters`.

    Raises:
        StartupError: a rope_type other than "default", or a missing rope_theta.
    """
    head_dim = hf_config.head_dim or hf_config.hidden_size // hf_config.num_attention_heads
    out = []
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        params = (hf_config.rope_parameters or {}).get(kind) or {}
        if params.get("rope_type", "default") != "default" or params.get("rope_theta") is None:
            raise StartupError(
                f"rope_parameters[{kind!r}] {params}: supported: rope_type 'default' with a "
                "rope_theta"
            )
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        out.append((kind, float(params["rope_theta"]), dim))
    return tuple(out)


class LagunaForCausalLM(MoeCausalLM):
    """Laguna on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Laguna", ("poolside/laguna-XS.2",),
        "GQA, per-layer query heads, q/k norm, softplus output gate, sliding/full mix",
        cache=("full", "sliding"),
    )

    spec_class = LagunaSpec
    model_types = ("laguna",)
    weight_mapping = WeightMapping(
        renames=(
            (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            (".mlp.shared_expert.", ".mlp.shared_experts."),
            (".self_attn.g_proj.", ".self_attn.gate_proj."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types` (default the first dense); q/k norm; q/k/v/o biases
        from `attention_bias`; a shared expert of `shared_expert_intermediate_size` (default
        512); `layer_types` (default all full). `num_heads` is `num_attention_heads` (the
        per-layer counts are the spec's).

        Raises:
            ValueError: a required field missing (named), malformed layer types or window, or
                a refused field (module docstring).
        """
        for key in ("moe_router_logit_softcapping", "moe_apply_router_weight_on_input"):
            if cfg.get(key):
                raise ValueError(f"config.json: {key}={cfg[key]!r} is not supported for "
                                 f"{cls.__name__} (supported: 0 / false)")
        layers = required_int(cfg, "num_hidden_layers")
        return cls.moe_shape(
            cfg,
            moe_layers=mlp_layer_types_moe_layers(cfg, 1),
            qk_norm=True,
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(
                cfg.get("shared_expert_intermediate_size", DEFAULT_SHARED_WIDTH) or 0
            ),
            router_correction_bias=True,
            **window_layer_fields(cfg, [FULL_ATTENTION] * layers, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, the rope per kind, the heads per layer, the gate's granularity, the
        routed scale.

        Raises:
            StartupError: see `rope_by_kind`; ValueError: hidden_act other than silu, a
                `gating` other than true / "per-head" / "per-element".
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        gating = hf_config.gating
        if gating not in (True, "per-head", "per-element"):
            raise ValueError(f"config.json: gating {gating!r} is not supported (supported: "
                             "true, 'per-head', 'per-element')")
        rope = rope_by_kind(hf_config)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope[0][1],
            rope=rope,
            heads_per_layer=tuple(int(n) for n in hf_config.num_attention_heads_per_layer),
            gate_per_head=gating is True or gating == "per-head",
            routed_scaling_factor=float(hf_config.moe_routed_scaling_factor),
        )

    def build_rotary(self, spec: LagunaSpec, max_position: int) -> nn.Module:
        """One rope per attention kind (shared by that kind's layers)."""
        return nn.ModuleDict({
            kind: PartialRotaryEmbedding(spec.head_dim, dim, max_position, theta)
            for kind, theta, dim in spec.rope
        })

    def build_attention(
        self, spec: LagunaSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """The layer's own query heads, its kind's rope and window, q/k norm, the softplus
        output gate."""
        kind = spec.layer_types[index] if spec.layer_types else FULL_ATTENTION
        heads = spec.heads_per_layer[index] if spec.heads_per_layer else spec.num_heads
        return Attention(
            dataclasses.replace(spec, num_heads=heads), dtype, rotary[kind],
            spec.sliding_window if kind == SLIDING_ATTENTION else None,
            o_bias=spec.attention_bias, output_gate="softplus", gate_per_head=spec.gate_per_head,
        )

    def build_mlp(self, spec: LagunaSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """The base dense MLP off `moe_layers`; else sigmoid top-k with the correction bias
        (router in the model dtype), weights renormalised and scaled, and the shared expert."""
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
