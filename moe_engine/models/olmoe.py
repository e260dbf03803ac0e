"""OLMoE (Muennighoff et al., "OLMoE: Open Mixture-of-Experts Language Models",
arXiv:2409.02060, 2024; HF `OlmoeForCausalLM`, transformers 5.24 `modeling_olmoe.py`) and
FlexOlmo (Shi et al., "FlexOlmo: Open Language Models for Flexible Data Use",
arXiv:2507.07024, 2025; HF `FlexOlmoForCausalLM`, `modeling_flex_olmo.py`).

Both are Llama-style GQA decoders whose every layer is an MoE block of `num_experts` experts
of width `intermediate_size`, routed by softmax then top-k (renormalised when
`norm_topk_prob`, default false). They differ from the Llama decoder in:
- q/k RMSNorm over the whole projection (num_heads * head_dim and num_kv_heads * head_dim
  features), not per head, before the rope (`Attention(qk_norm_per_head=False)`);
- OLMoE: optional `clip_qkv` (q, k, v clamped after the norms); pre-norm layers;
- FlexOlmo: OLMo 2's post-norm layers (`layers/decoder.PostNormDecoderLayer`: h +
  norm(attn(h)), then + norm(mlp(h)); no input norm) and every RMSNorm multiplies by its
  weight in float32 (`Olmo2RMSNorm`).

Checkpoint names are the base mapping's: `self_attn.{q,k,v}_proj` (stacked into `qkv_proj`),
`self_attn.{q,k}_norm` (full width), `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (or
transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`); FlexOlmo's norms are
`post_attention_layernorm` and `post_feedforward_layernorm`. KV cache: one full-attention
group of every layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe
from moe_engine.models.layers.decoder import PostNormDecoderLayer
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard


@dataclasses.dataclass(frozen=True)
class OlmoeSpec(ArchSpec):
    """`ArchSpec` plus OLMoE's clamp.

    Attributes:
        clip_qkv: q, k and v clamped to [-clip_qkv, clip_qkv] (None: no clamp).
    """

    clip_qkv: float | None = None


class OlmoeForCausalLM(MoeCausalLM):
    """OLMoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "OLMoE", ("allenai/OLMoE-1B-7B-0924", "allenai/OLMoE-1B-7B-0924-Instruct"),
        "GQA, q/k norm over the whole projection, clip_qkv",
    )

    spec_class = OlmoeSpec
    model_types = ("olmoe",)

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`; q/k norms; `norm_topk_prob` default
        false; biases on q/k/v/o from `attention_bias`.

        Raises:
            ValueError: a required field missing (named).
        """
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta (plain RoPE), clip_qkv.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu, num_attention_heads * head_dim other than hidden_size (the q norm spans
                hidden_size features in transformers), clip_qkv <= 0.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        if heads * head_dim != hidden:
            raise ValueError(
                f"config.json: num_attention_heads * head_dim ({heads} * {head_dim}) must equal "
                f"hidden_size ({hidden}) for {cls.__name__} (its q/k norms span hidden_size)"
            )
        clip = getattr(hf_config, "clip_qkv", None)
        if clip is not None and clip <= 0:
            raise ValueError(f"config.json: clip_qkv {clip!r} must be > 0 or null")
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            clip_qkv=None if clip is None else float(clip),
        )

    def build_attention(
        self, spec: OlmoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Full-width q/k norms, then the clamp."""
        return Attention(
            spec, dtype, rotary, o_bias=spec.attention_bias, qk_norm_per_head=False,
            clip_qkv=spec.clip_qkv,
        )


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    """FlexOlmo: OLMoE's blocks in OLMo 2's post-norm layers, norms weighted in float32."""

    card = FamilyCard(
        "FlexOlmo", ("allenai/FlexOlmo-7x7B-1T",),
        "GQA, q/k norm over the whole projection, post-norm layers",
    )

    model_types = ("flex_olmo",)

    def build_norm(self, spec: ArchSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`FlexOlmoRMSNorm` (Olmo2's): the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_attention(
        self, spec: OlmoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Full-width q/k norms weighted in float32 (FlexOlmo has no clamp)."""
        return Attention(
            spec, dtype, rotary, o_bias=spec.attention_bias, qk_norm_per_head=False,
            qk_norm_in_float32=True,
        )

    def build_layer(
        self, spec: OlmoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """`PostNormDecoderLayer`: norms on the attention's and the MLP's outputs."""
        return PostNormDecoderLayer(
            self.build_attention(spec, index, dtype, rotary),
            self.build_mlp(spec, index, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
        )
