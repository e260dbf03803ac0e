"""Beam (Reflection AI, Beam-1.0-501B-A23B, 2026; HF `BeamForCausalLM`, transformers 5.24
`modeling_beam.py`).

A Qwen3-MoE-style GQA decoder that differs in:
- "sandwich" norms (attention and MLP outputs normalised before their residual adds) and
  depth-scaled residual adds: the k-th add of the model (k = 2(i + 1) for layer i's attention,
  k + 1 for its MLP) is branch / sqrt(k) + stream * sqrt((k - 1) / k)
  (`layers/decoder.DecoderLayer(residual_scales=...)`); norms multiply their weight in float32;
- per-head q/k RMSNorm; biases on q/k/v/o when `attention_bias`; a sigmoid output gate per
  element with a per-head `gate_bias`; `layer_types` (default every 6th layer and the last
  global): each kind has its RoPE (`rope_parameters` keyed by kind) or none; a kind without
  RoPE (by default the global layers) scales its queries by (1 + (position + 1) / 2048) ** 0.1
  instead (`layers/rotary.QueryLengthScaling`);
- `mlp_layer_types` (default three dense layers first, of `intermediate_size`); MoE blocks
  routed as DeepSeek-V3 (sigmoid scores, `e_score_correction_bias` choosing, group-limited
  top-k over `n_group` / `topk_group`, renormalised when `norm_topk_prob`; float32 router),
  no shared experts, the routed output times `routed_scaling_factor` (folded into the weights:
  the same value up to float rounding);
- logits soft-capped: tanh(logits / `final_logit_softcapping`) * `final_logit_softcapping`.

Checkpoint names are the base mapping's (`self_attn.{q,k,v,o,gate}_proj`, `self_attn.gate_bias`,
`post_attention_layernorm` (the attention output's norm) -> `post_self_attn_layernorm`,
`pre_feedforward_layernorm` -> `post_attention_layernorm`, `post_feedforward_layernorm` ->
`post_mlp_layernorm`, `mlp.gate.*`, `mlp.experts.*`). KV cache: a full-attention group and a
sliding-window group.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, num_experts_of, required_int
from moe_engine.models.dots1 import window_layer_fields
from moe_engine.models.exaone_moe import mlp_layer_types_moe_layers
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import QueryLengthScaling, RotaryEmbedding
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `BeamConfig` defaults.
DEFAULT_SLIDING_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class BeamSpec(ArchSpec):
    """`ArchSpec` plus Beam's extras.

    Attributes:
        rope: per attention kind, its rope_theta, or None (no RoPE: query length scaling).
        n_group, topk_group, routed_scaling_factor: the routing's.
        final_logit_softcapping: the logits' soft cap (None: none).
    """

    rope: tuple[tuple[str, float | None], ...] = ()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    final_logit_softcapping: float | None = None


def beam_layer_types(cfg: dict) -> list[str]:
    """config.json's `layer_types`, or `BeamConfig.__post_init__`'s: every 6th layer and the
    last full, the others sliding."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    layers = required_int(cfg, "num_hidden_layers")
    types = [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(layers)]
    return types[:-1] + [FULL_ATTENTION] if types else types


def rope_theta_by_kind(hf_config) -> tuple[tuple[str, float | None], ...]:
    """(kind, rope_theta or None) for the kinds of `rope_parameters`.

    Raises:
        StartupError: a rope_type other than "default", or partial rotary.
    """
    out = []
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        params = (hf_config.rope_parameters or {}).get(kind)
        if params is None:
            out.append((kind, None))
            continue
        if params.get("rope_type", "default") != "default" or float(
            params.get("partial_rotary_factor", 1.0)
        ) != 1.0:
            raise StartupError(f"rope_parameters[{kind!r}] {params}: supported: rope_type "
                               "'default' over the whole head")
        out.append((kind, float(params["rope_theta"])))
    return tuple(out)


class BeamForCausalLM(MoeCausalLM):
    """Beam on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Beam", ("reflection/Beam-1.0-501B-A23B",),
        "gated GQA, q/k norm, sandwich norms, sliding/global mix (scaled-query globals)",
        cache=("full", "sliding"),
    )

    spec_class = BeamSpec
    model_types = ("beam",)
    # Order matters: the attention-output norm's name is freed before the pre-MLP norm takes it.
    weight_mapping = WeightMapping(
        renames=(
            (".post_attention_layernorm.", ".post_self_attn_layernorm."),
            (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
            (".post_feedforward_layernorm.", ".post_mlp_layernorm."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types` (default three dense first); q/k norm; biases from
        `attention_bias`; float32 routers with a correction bias; `layer_types` as
        `BeamConfig` derives them.

        Raises:
            ValueError: a required field missing (named), malformed layer types or window.
        """
        layers = required_int(cfg, "num_hidden_layers")
        return cls.moe_shape(
            cfg,
            moe_layers=mlp_layer_types_moe_layers(cfg, min(3, layers)),
            qk_norm=True,
            attn_output_gate=True,  # gate_proj [H -> heads x D], in the plan's bytes
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            router_correction_bias=True,
            router_float32=True,
            **window_layer_fields(cfg, beam_layer_types(cfg), DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, the rope per kind, the group limits and scale, the logit cap.

        Raises:
            StartupError: see `rope_theta_by_kind`; ValueError: hidden_act other than silu,
                group limits `check_sigmoid_group_limits` refuses.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        n_group, topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
        check_sigmoid_group_limits(
            num_experts_of(hf_config.to_dict()), int(hf_config.num_experts_per_tok), n_group,
            topk_group,
        )
        rope = rope_theta_by_kind(hf_config)
        cap = hf_config.final_logit_softcapping
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=next((t for _, t in rope if t is not None), 10000.0),
            rope=rope,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            final_logit_softcapping=float(cap) if cap else None,
        )

    def build_rotary(self, spec: BeamSpec, max_position: int) -> nn.Module:
        """Per kind its RoPE, or the query length scaling where the kind has none."""
        return nn.ModuleDict({
            kind: QueryLengthScaling() if theta is None
            else RotaryEmbedding(spec.head_dim, max_position, theta)
            for kind, theta in spec.rope
        })

    def build_norm(self, spec: BeamSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`BeamRMSNorm` (OLMo-3's): the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_attention(
        self, spec: BeamSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k norms multiplying their weight in float32 (`BeamRMSNorm`), its kind's rope (or
        query scaling) and window, the biased sigmoid gate."""
        kind = spec.layer_types[index] if spec.layer_types else FULL_ATTENTION
        return Attention(
            spec, dtype, rotary[kind], spec.sliding_window if kind == SLIDING_ATTENTION else None,
            o_bias=spec.attention_bias, output_gate="sigmoid", gate_bias=True,
            qk_norm_in_float32=True,
        )

    def build_mlp(self, spec: BeamSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """The base dense MLP off `moe_layers`; else DeepSeek-V3 routing with the routed scale
        in the weights, no shared experts."""
        if index not in spec.moe_layers:
            return super().build_mlp(spec, index, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.n_group, spec.topk_group,
            spec.norm_topk_prob, spec.routed_scaling_factor,
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router,
        )

    def build_layer(
        self, spec: BeamSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Sandwich norms and the depth-scaled residual adds of layer `index`."""
        k = 2 * (index + 1)
        scales = (1 / math.sqrt(k), math.sqrt((k - 1) / k),
                  1 / math.sqrt(k + 1), math.sqrt(k / (k + 1)))
        norm = self.build_norm
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            post_self_attn_layernorm=norm(spec, spec.hidden_size, dtype),
            post_mlp_layernorm=norm(spec, spec.hidden_size, dtype), residual_scales=scales,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] float32, soft-capped as transformers does."""
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
