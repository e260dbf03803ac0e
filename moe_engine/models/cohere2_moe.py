"""Cohere2-MoE (Cohere, Command A-style MoE; HF `Cohere2MoeForCausalLM`, transformers 5.24
`modeling_cohere2_moe.py`).

A Cohere-2 decoder (Command R7B / Command A) with routed experts. It differs from the
Llama-style decoder in:
- the parallel block: one norm per layer feeding attention and MLP alike, h + attn(n) + mlp(n)
  (`layers/decoder.DecoderLayer` without a post-attention norm); the norm is a bias-free
  LayerNorm (`layer_norm_eps`; `layers/norm.LayerNorm`) unless `rms_norm_eps` is set (then
  RMSNorm), the final norm alike;
- RoPE on interleaved pairs (Cohere's `rotate_half`) on the sliding layers only: the global
  layers use no position embedding (NoPE) except dense prefix layers when
  `prefix_dense_sliding_window_pattern` is 1 (`force_rope`); `layer_types` by default every
  `sliding_window_pattern`-th layer global, the dense prefix by its own pattern;
- biases on q/k/v/o when `attention_bias`; no q/k norm;
- `mlp_layer_types` ("dense" of `prefix_dense_intermediate_size`, or "sparse"); experts of width
  `intermediate_size`; routing by the top-k router logits (router in the model dtype), then
  softmax over those k (`expert_selection_fn` "softmax", `layers/routing.topk_softmax`) or
  their sigmoid, renormalised when `norm_topk_prob` ("sigmoid": `SigmoidGroupedTopKRouter`
  without groups or bias, the same choice as sigmoid is monotonic);
- `num_shared_experts` ungated shared experts (one MLP of width `intermediate_size *
  num_shared_experts`) combined by "sum" or "average" ((routed + shared) / 2:
  `FusedMoE(output_scale=0.5)`, exact as a power of two);
- logits times `logit_scale`; tied embeddings by default.

Checkpoint names: the base mapping's (`self_attn.{q,k,v,o}_proj`, `input_layernorm`,
`mlp.gate.weight`, `mlp.experts.{e}.*` or the fused `mlp.experts.gate_up_proj` / `down_proj`,
`mlp.shared_experts.*`, dense `mlp.{gate,up,down}_proj`). KV cache: a full-attention group and
a sliding-window group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.dots1 import window_layer_fields
from moe_engine.models.exaone_moe import mlp_layer_types_moe_layers
from moe_engine.models.layers.decoder import DecoderLayer, DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import LayerNorm, RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard

#: `Cohere2MoeConfig` defaults.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_SLIDING_WINDOW_PATTERN = 4
#: The values `expert_selection_fn` and `shared_expert_combination_strategy` may take.
SELECTION_FNS = ("softmax", "sigmoid")
COMBINATIONS = {"sum": 1.0, "average": 0.5}


@dataclasses.dataclass(frozen=True)
class Cohere2MoeSpec(ArchSpec):
    """`ArchSpec` plus Cohere2-MoE's extras.

    Attributes:
        layer_norm: the norms are bias-free LayerNorms (of eps `rms_norm_eps`), not RMSNorms.
        logit_scale: multiplies the logits.
        sigmoid_routing: `expert_selection_fn` "sigmoid" (else "softmax").
        moe_output_scale: multiplies routed + shared (0.5 for "average").
    """

    layer_norm: bool = True
    logit_scale: float = 1.0
    sigmoid_routing: bool = False
    moe_output_scale: float = 1.0


def cohere2_layer_types(cfg: dict) -> list[str]:
    """config.json's `layer_types`, or `Cohere2MoeConfig.__post_init__`'s: the first
    `first_k_dense_replace` layers by `prefix_dense_sliding_window_pattern` (default 1), the
    rest by `sliding_window_pattern` (default 4); every pattern-th layer full."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    layers = required_int(cfg, "num_hidden_layers")
    first = int(cfg.get("first_k_dense_replace") or 0)
    prefix = int(cfg.get("prefix_dense_sliding_window_pattern", 1))
    rest = int(cfg.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN))
    return [SLIDING_ATTENTION if (i + 1) % prefix else FULL_ATTENTION for i in range(first)] + [
        SLIDING_ATTENTION if (i + 1) % rest else FULL_ATTENTION for i in range(layers - first)
    ]


def _choice(cfg: dict, key: str, default: str, allowed) -> str:
    """`cfg[key]` checked against `allowed`.

    Raises:
        ValueError: naming the field, its value and the supported ones."""
    value = cfg.get(key) or default
    if value not in allowed:
        raise ValueError(f"config.json: {key} {value!r} is not supported (supported: "
                         f"{', '.join(allowed)})")
    return value


class Cohere2MoeForCausalLM(MoeCausalLM):
    """Cohere2-MoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Cohere2-MoE", ("CohereLabs/command-a-moe",),
        "GQA, parallel block, sliding RoPE / global NoPE mix", cache=("full", "sliding"),
    )

    spec_class = Cohere2MoeSpec
    model_types = ("cohere2_moe",)

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types` (or `first_k_dense_replace`); dense layers of
        `prefix_dense_intermediate_size`; shared experts of `intermediate_size *
        num_shared_experts`; biases on q/k/v/o from `attention_bias`; tied embeddings unless
        config.json says otherwise.

        Raises:
            ValueError: a required field missing (named), malformed layer types or window.
        """
        width = required_int(cfg, "intermediate_size")
        moe_layers = mlp_layer_types_moe_layers(cfg, 0)
        dense = int(cfg.get("prefix_dense_intermediate_size") or width)
        layers = required_int(cfg, "num_hidden_layers")
        return cls.moe_shape(
            cfg,
            moe_layers=moe_layers,
            intermediate_size=dense if len(moe_layers) < layers else 0,
            qk_norm=False,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=width * int(cfg.get("num_shared_experts") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            **window_layer_fields(cfg, cohere2_layer_types(cfg), DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The norm kind and eps, rope_theta, the NoPE layers, routing and combination, the
        logit scale.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu, an unknown expert_selection_fn or shared_expert_combination_strategy.
        """
        cfg = hf_config.to_dict()
        check_hidden_act(cfg, cls.__name__)
        selection = _choice(cfg, "expert_selection_fn", "softmax", SELECTION_FNS)
        combine = _choice(cfg, "shared_expert_combination_strategy", "average", COMBINATIONS)
        force_rope = hf_config.prefix_dense_sliding_window_pattern == 1
        nope = tuple(
            i for i, t in enumerate(hf_config.layer_types)
            if t != SLIDING_ATTENTION
            and not (force_rope and hf_config.mlp_layer_types[i] == "dense")
        )
        shared = int(hf_config.num_shared_experts or 0) > 0
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps or hf_config.layer_norm_eps,
            layer_norm=hf_config.rms_norm_eps is None,
            rope_theta=rope_theta_of(hf_config),
            nope_layers=nope,
            logit_scale=float(hf_config.logit_scale),
            sigmoid_routing=selection == "sigmoid",
            moe_output_scale=COMBINATIONS[combine] if shared else 1.0,
        )

    def build_rotary(self, spec: Cohere2MoeSpec, max_position: int) -> nn.Module:
        """RoPE on interleaved pairs (Cohere's `rotate_half`)."""
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, interleaved=True)

    def build_norm(self, spec: Cohere2MoeSpec, size: int, dtype: torch.dtype) -> nn.Module:
        if spec.layer_norm:
            return LayerNorm(size, spec.rms_norm_eps, bias=False, dtype=dtype, float32_math=True)
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype)

    def build_attention(
        self, spec: Cohere2MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Biases on q/k/v/o from `attention_bias`; sliding and NoPE per layer."""
        sliding = bool(spec.layer_types) and spec.layer_types[index] == SLIDING_ATTENTION
        return Attention(
            spec, dtype, None if index in spec.nope_layers else rotary,
            spec.sliding_window if sliding else None, o_bias=spec.attention_bias,
        )

    def build_mlp(self, spec: Cohere2MoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP of the prefix width, or top-k routed experts (softmax over the k logits,
        or their sigmoid) with the shared experts."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = None
        if spec.sigmoid_routing:
            router = SigmoidGroupedTopKRouter(
                spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, spec.norm_topk_prob, 1.0,
                correction_bias=False, dtype=dtype,
            )
        width = spec.shared_expert_intermediate_size
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, routing="topk_softmax", router=router,
            shared_experts=SharedExperts(spec.hidden_size, width, dtype) if width else None,
            output_scale=spec.moe_output_scale,
        )

    def build_layer(
        self, spec: Cohere2MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """The parallel block: one norm, attention and MLP both read its output."""
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            self.build_norm(spec, spec.hidden_size, dtype), None,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] float32, times `logit_scale` in the model dtype
        as transformers multiplies them."""
        return (self.lm_head(hidden) * self.spec.logit_scale).float()
