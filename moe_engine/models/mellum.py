"""Mellum 2 (JetBrains, Mellum2-12B-A2.5B model card, 2026, JetBrains/Mellum2-12B-A2.5B-Base;
HF `MellumForCausalLM`, transformers 5.24 `modeling_mellum.py`).

Qwen3-MoE's decoder (per-head q/k RMSNorm before the rope, softmax-then-top-k routing
renormalised when `norm_topk_prob`, the router in the model dtype) that differs in:
- `layer_types`: each layer "full_attention" or "sliding_attention" (window
  `sliding_window`), each kind with its own RoPE base (`rope_parameters` keyed by layer type:
  default 500000 for full, 10000 for sliding layers; `MellumRotaryEmbedding`), so every
  attention takes its kind's `RotaryEmbedding`;
- `mlp_layer_types`: each layer "sparse" (an MoE block of `num_experts` experts of
  `moe_intermediate_size`) or "dense" (a SwiGLU MLP of `intermediate_size`);
- biases on q/k/v/o from `attention_bias`.

Checkpoint names are Qwen3-MoE's (the base mapping's); the multi-token-prediction layer
(`mtp.*`, `num_nextn_predict_layers`) is skipped unread, as transformers ignores it. KV cache:
a full-attention and a sliding-window group (`layer_types`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, layer_types_fields, required_int
from moe_engine.models.layers.rotary import RotaryEmbedding
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `MellumConfig.sliding_window` default (tokens).
DEFAULT_SLIDING_WINDOW = 1024


@dataclasses.dataclass(frozen=True)
class MellumSpec(ArchSpec):
    """`ArchSpec` plus the sliding layers' RoPE base (`rope_theta` is the full layers')."""

    sliding_rope_theta: float = 10000.0


def sparse_mlp_layers(cfg: dict) -> tuple[int, ...]:
    """The layers whose `mlp_layer_types` entry is "sparse" (default all of them).

    Raises:
        ValueError: a list of the wrong length or with an entry other than "sparse"/"dense".
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("mlp_layer_types") or ["sparse"] * layers
    if len(types) != layers or not set(types) <= {"sparse", "dense"}:
        raise ValueError(
            f"config.json: mlp_layer_types {types} must give 'sparse' or 'dense' for each of "
            f"the {layers} layers"
        )
    return tuple(i for i, kind in enumerate(types) if kind == "sparse")


def rope_theta_by_kind(hf_config) -> dict[str, float]:
    """{layer type: RoPE base} from `rope_parameters` keyed by layer type (the kinds present
    in `layer_types`).

    Raises:
        StartupError: a kind without parameters or rope_theta, a rope_type other than
            default, or a partial_rotary_factor other than 1 (transformers' Mellum rotates the
            whole head: its tables would not fit a partial one).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    thetas = {}
    for kind in sorted(set(hf_config.layer_types)):
        p = params.get(kind) or {}
        if p.get("rope_theta") is None:
            raise StartupError(f"rope_parameters[{kind!r}] has no rope_theta")
        if p.get("rope_type", "default") != "default":
            raise StartupError(
                f"rope_parameters[{kind!r}] rope_type {p['rope_type']!r} is not supported yet "
                "(supported: default)"
            )
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise StartupError(
                f"rope_parameters[{kind!r}] partial_rotary_factor "
                f"{p['partial_rotary_factor']} is not supported (supported: 1.0)"
            )
        thetas[kind] = float(p["rope_theta"])
    return thetas


class MellumForCausalLM(MoeCausalLM):
    """Mellum on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Mellum 2", ("JetBrains/Mellum2-12B-A2.5B-Base",),
        "GQA, q/k norm, sliding/full mix with a rope base per kind", cache=("full", "sliding"),
    )

    spec_class = MellumSpec
    model_types = ("mellum",)
    weight_mapping = WeightMapping(skipped=(r"^mtp\.",))

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types`; q/k norms; q/k/v/o biases from
        `attention_bias`; `layer_types` (default all full) with `sliding_window` (default
        1024).

        Raises:
            ValueError: a required field missing (named), malformed layer types.
        """
        layers = required_int(cfg, "num_hidden_layers")
        types = {**cfg, "layer_types": cfg.get("layer_types") or [FULL_ATTENTION] * layers}
        window = layer_types_fields(types, DEFAULT_SLIDING_WINDOW)
        return cls.moe_shape(
            cfg,
            moe_layers=sparse_mlp_layers(cfg),
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            **(window if window["sliding_window"] is not None else {}),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps and the RoPE base of each layer kind.

        Raises:
            StartupError: see `rope_theta_by_kind`; ValueError: hidden_act other than silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        thetas = rope_theta_by_kind(hf_config)
        full = thetas.get(FULL_ATTENTION, thetas.get(SLIDING_ATTENTION))
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=full,
            sliding_rope_theta=thetas.get(SLIDING_ATTENTION, full),
        )

    def build_rotary(self, spec: MellumSpec, max_position: int) -> nn.Module:
        """One `RotaryEmbedding` per layer kind, each shared by that kind's layers."""
        return nn.ModuleDict({
            FULL_ATTENTION: RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta),
            SLIDING_ATTENTION: RotaryEmbedding(spec.head_dim, max_position,
                                               spec.sliding_rope_theta),
        })

    def build_attention(
        self, spec: MellumSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Qwen3-MoE's attention with its kind's rope and window; o_proj bias as q/k/v's."""
        sliding = bool(spec.layer_types) and spec.layer_types[index] == SLIDING_ATTENTION
        kind = SLIDING_ATTENTION if sliding else FULL_ATTENTION
        window = spec.sliding_window if sliding else None
        return Attention(spec, dtype, rotary[kind], window, o_bias=spec.attention_bias)
