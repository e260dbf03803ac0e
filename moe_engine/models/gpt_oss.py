"""gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; HF `GptOssForCausalLM`).

A decoder-only MoE transformer that differs from the Llama family (`layers/decoder.py`) in:
- attention alternating per `layer_types` between sliding-window ("sliding_attention", window
  `sliding_window`: a query sees itself and the window - 1 tokens before it) and full layers;
  here every layer keeps the full KV cache and the window is an attention mask
  (`layers/attention.py`);
- a learned attention sink per query head (a logit in the softmax denominator with no value);
- YaRN rotary embedding (`layers/rotary.py`, `rope_parameters` with rope_type "yarn");
- biases on q/k/v/o, on the router, and on every expert's gate/up and down projections;
- routing by top-k of the router logits, then softmax over those k (`layers/moe.topk_softmax`);
- the clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`, gate <= limit and
  |up| <= limit (`kernels/moe/activation.py`; `swiglu_alpha`, default 1.702, and `swiglu_limit`);
- RMSNorm multiplying by its weight in float32 (`GptOssRMSNorm`).

Checkpoints (transformers 5 names): experts as `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up columns INTERLEAVED (gate = [..., 0::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I]
(interleaved alike), `down_proj` [E, I, H], `down_proj_bias` [E, H]; or, as OpenAI released them
(config.json quantization_config {"quant_method": "mxfp4"}), `gate_up_proj_blocks`
[E, 2I, H // 32, 16] / `_scales` [E, 2I, H // 32] and `down_proj_blocks` [E, H, I // 32, 16] /
`_scales` [E, H, I // 32] (OCP MX v1.0, `quant/mxfp4.py`; rows are output features, so their
interleave is undone on the packed rows exactly). The router is `mlp.router` (weight, bias) and the
sinks `self_attn.sinks` [num_heads]. The engine stores w13 [E, 2I, H] as gate rows then up rows
and w2 [E, H, I]; `weight_mapping` says so and the shared loader does the rest.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kernels.moe.activation import SwiGLU
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import every_layer_moe, layer_types_fields
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, YarnScaling, rope_with_scaling_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: `GptOssExperts.alpha` when config.json has no `swiglu_alpha` (the released checkpoints).
DEFAULT_SWIGLU_ALPHA = 1.702
#: transformers `GptOssConfig.swiglu_limit` default.
DEFAULT_SWIGLU_LIMIT = 7.0
#: transformers `GptOssConfig.sliding_window` default.
DEFAULT_SLIDING_WINDOW = 128


@dataclasses.dataclass(frozen=True)
class GptOssSpec(ArchSpec):
    """`ArchSpec` plus gpt-oss's extras.

    Attributes:
        yarn: YaRN rotary scaling, None for plain RoPE.
        swiglu_alpha: the clamped SwiGLU's sigmoid gain.
        swiglu_limit: its clamp (None: no clamp).
    """

    yarn: YarnScaling | None = None
    swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA
    swiglu_limit: float | None = DEFAULT_SWIGLU_LIMIT


class GptOssForCausalLM(MoeCausalLM):
    """gpt-oss on the engine's layers; loads the bf16/float layout and the native MXFP4 one."""
    card = FamilyCard(
        "gpt-oss", ("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
        "GQA, sliding/full mix, attention sinks, YaRN", cache=("full", "sliding"),
        native_4bit=("mxfp4",),
    )

    spec_class = GptOssSpec
    model_types = ("gpt_oss",)
    weight_mapping = WeightMapping(
        renames=((".mlp.router.", ".mlp.gate."),),
        experts=ExpertMapping(fused_in_out=True, interleaved_gate_up=True),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`; top-k as `num_experts_per_tok` or
        `experts_per_token`; `layer_types` (default even layers sliding) and `sliding_window`
        (default 128) as `GptOssConfig`; attention biases unless `attention_bias` is false;
        sinks, router and expert biases.

        Raises:
            ValueError: a malformed layer_types / sliding_window, a missing field.
        """
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            attention_bias=bool(cfg.get("attention_bias", True)),
            qk_norm=False,
            norm_topk_prob=False,
            attention_sinks=True,
            router_bias=True,
            expert_bias=True,
            **layer_types_fields(cfg, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta with YaRN, the clamped SwiGLU's alpha and limit.

        Raises:
            StartupError: a rope_type other than default or yarn.
        """
        theta, yarn = rope_with_scaling_of(hf_config)
        limit = getattr(hf_config, "swiglu_limit", DEFAULT_SWIGLU_LIMIT)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            yarn=yarn,
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", None) or DEFAULT_SWIGLU_ALPHA),
            swiglu_limit=None if limit is None else float(limit),
        )

    def build_rotary(self, spec: GptOssSpec, max_position: int) -> nn.Module:
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, spec.yarn)

    def build_norm(self, spec: GptOssSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`GptOssRMSNorm`: the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_attention(
        self, spec: GptOssSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        sliding = spec.layer_types and spec.layer_types[index] == "sliding_attention"
        window = spec.sliding_window if sliding else None
        return Attention(spec, dtype, rotary, window, o_bias=True, sinks=True)

    def build_mlp(self, spec: GptOssSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Top-k then softmax routing, router and expert biases, the clamped SwiGLU."""
        return FusedMoE(
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            spec.moe_intermediate_size,
            False,
            dtype,
            routing="topk_softmax",
            router_bias=spec.router_bias,
            expert_bias=spec.expert_bias,
            activation=SwiGLU(alpha=spec.swiglu_alpha, limit=spec.swiglu_limit),
        )
