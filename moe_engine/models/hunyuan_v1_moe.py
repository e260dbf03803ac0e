"""Hunyuan-A13B (Tencent Hunyuan team, "Hunyuan-A13B Technical Report", 2025,
tencent/Hunyuan-A13B-Instruct; HF `HunYuanMoEV1ForCausalLM`, transformers 5.24
`modeling_hunyuan_v1_moe.py`).

A Llama-style GQA decoder, every layer a sparse MoE block, that differs in:
- per-head q/k RMSNorm *after* the rope (`query_layernorm` / `key_layernorm`;
  `layers/self_attention.Attention(qk_norm_after_rope=True)`), biases on q/k/v/o from
  `attention_bias`;
- RoPE whose base is stretched by a fixed NTK `alpha` (`rope_parameters` type "dynamic" with
  "alpha": base = rope_theta * alpha ** (D / (D - 2)), transformers'
  `compute_ntk_alpha_rope_parameters`; static, so a plain `RotaryEmbedding` of that base);
- routing: a float32 router `gate.wg` [E, H], softmax over all experts, the top-k
  renormalised (`layers/routers.SoftmaxTopKRouter`, float32); experts of width
  `intermediate_size`, top-k `moe_topk` (an int, or one per layer when all equal);
- one ungated shared MLP of width `intermediate_size` per layer (`shared_mlp`,
  `layers/shared_experts.SharedExperts`).

Checkpoint names: `self_attn.{q,k,v}_proj` (stacked into `qkv_proj`), `o_proj`,
`self_attn.query_layernorm` / `key_layernorm` -> `q_norm` / `k_norm`, `mlp.gate.wg.weight` ->
`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (or the fused
`mlp.experts.gate_up_proj` / `down_proj`), `mlp.shared_mlp.*` -> `mlp.shared_experts.*`.
Fields of the released config.json that transformers ignores (`use_cla`, `num_shared_expert`,
per-layer `moe_intermediate_size`) are ignored here too. KV cache: one full-attention group.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.routers import SoftmaxTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


def uniform_per_layer(cfg: dict, key: str, default: int) -> int:
    """`cfg[key]` as one int: an int, or a per-layer list whose entries are all equal.

    Raises:
        ValueError: a list of differing values (the engine builds every MoE layer alike),
            naming the field.
    """
    value = cfg.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(
                f"config.json: {key} {value} differs between layers; supported: one value for "
                "every layer"
            )
        value = value[0]
    return int(value)


def ntk_alpha_rope_theta(hf_config) -> float:
    """The rotary base: `rope_theta`, times alpha ** (D / (D - 2)) for HunYuan's static NTK
    scaling (`rope_parameters` {"rope_type": "dynamic", "alpha": ...}).

    Raises:
        StartupError: another rope_type (true dynamic or linear scaling), or no rope_theta.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    alpha = params.get("alpha")
    if params.get("rope_type", params.get("type")) != "dynamic" or not alpha:
        return rope_theta_of(hf_config)
    theta = params.get("rope_theta")
    if theta is None:
        raise StartupError("config.json has no rope_theta")
    dim = hf_config.head_dim or hf_config.hidden_size // hf_config.num_attention_heads
    return float(theta) * float(alpha) ** (dim / (dim - 2))


class HunYuanMoEV1ForCausalLM(MoeCausalLM):
    """Hunyuan-A13B on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Hunyuan-A13B (HunYuan-MoE-V1)", ("tencent/Hunyuan-A13B-Instruct",),
        "GQA, q/k norm after the rope, NTK-alpha rope",
    )

    model_types = ("hunyuan_v1_moe",)
    weight_mapping = WeightMapping(
        renames=(
            (".self_attn.query_layernorm.", ".self_attn.q_norm."),
            (".self_attn.key_layernorm.", ".self_attn.k_norm."),
            (".mlp.gate.wg.", ".mlp.gate."),
            (".mlp.shared_mlp.", ".mlp.shared_experts."),
        ),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE: `num_experts` experts (default 1) and a shared MLP, both of width
        `intermediate_size`; top-k `moe_topk` (default 1); float32 routers; q/k norms.

        Raises:
            ValueError: a required field missing (named); `num_experts` or `moe_topk` lists
                of differing values.
        """
        experts = uniform_per_layer(cfg, "num_experts", 1)
        layers = required_int(cfg, "num_hidden_layers")
        return cls.moe_shape(
            {**cfg, "num_experts": experts},
            moe_layers=tuple(range(layers)) if experts else (),
            top_k=uniform_per_layer(cfg, "moe_topk", 1),
            qk_norm=True,
            norm_topk_prob=True,
            shared_expert_intermediate_size=required_int(cfg, "intermediate_size"),
            router_float32=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps and the (NTK-alpha-stretched) rotary base.

        Raises:
            StartupError: a rope_type other than default or "dynamic" with an alpha;
                ValueError: hidden_act other than silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=ntk_alpha_rope_theta(hf_config))

    def build_attention(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Biases on q/k/v/o from `attention_bias`; per-head q/k norms after the rope."""
        return Attention(
            spec, dtype, rotary, o_bias=spec.attention_bias, qk_norm=True,
            qk_norm_after_rope=True,
        )

    def build_mlp(self, spec: ArchSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Float32 softmax top-k routing, renormalised, and the shared MLP."""
        router = SoftmaxTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, True, torch.float32
        )
        shared = SharedExperts(spec.hidden_size, spec.shared_expert_intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            True, dtype, router=router, shared_experts=shared,
        )
