"""DBRX (Databricks, "Introducing DBRX: A New State-of-the-Art Open LLM", 2024; HF
`DbrxForCausalLM`, transformers 5.24 `modeling_dbrx.py`).

A Llama-style GQA decoder whose every layer is an MoE block of `ffn_config.moe_num_experts`
experts of width `ffn_config.ffn_hidden_size`; it differs in:
- its config.json: `d_model`, `n_heads`, `n_layers`, `max_seq_len`, with the attention's and
  the MoE block's fields nested in `attn_config` (`kv_n_heads`, `clip_qkv`) and `ffn_config`
  (`moe_top_k`, `moe_normalize_expert_weights`, `ffn_act_fn`);
- one fused `Wqkv` projection whose output is clamped to [-clip_qkv, clip_qkv] before the
  split (`Attention(clip_qkv=...)`); no biases anywhere;
- LayerNorm without a bias (eps 1e-5, `nn.LayerNorm`'s default) instead of RMSNorm;
- routing: softmax over all experts, top-k, weights divided by their p-norm for p =
  `moe_normalize_expert_weights` (1: renormalised to sum to 1; null: not normalised).
The rotary base is the config's `rope_parameters` (transformers 5.24 builds DBRX's rotary from
it; `attn_config.rope_theta` is read by neither).

Checkpoint names: `transformer.wte`, `transformer.blocks.{i}.norm_attn_norm.{norm_1, norm_2}`,
`...norm_attn_norm.attn.Wqkv` [(heads + 2 kv_heads) * head_dim, d_model] (loaded whole into
`qkv_proj`), `...attn.out_proj`, `...ffn.router.layer` [E, d_model], the experts as three
2-D tensors `...ffn.experts.mlp.w1` (gate), `v1` (up) and `w2` (down, stored transposed), each
[E * I, d_model]; `transformer.norm_f`, `lm_head`. KV cache: one full-attention group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import required_int
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import LayerNorm
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: `nn.LayerNorm`'s epsilon, which DBRX's norms keep.
LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class DbrxSpec(ArchSpec):
    """`ArchSpec` plus DBRX's clamp.

    Attributes:
        clip_qkv: the fused q/k/v output clamped to [-clip_qkv, clip_qkv] (None: no clamp).
    """

    clip_qkv: float | None = None


def llama_style_fields(cfg: dict) -> dict:
    """A DBRX config.json dict with the Llama-style keys `moe_shape_fields` reads (hidden_size,
    num_attention_heads, num_hidden_layers, num_key_value_heads, num_local_experts,
    num_experts_per_tok, intermediate_size, max_position_embeddings) added from its own.

    Raises:
        ValueError: d_model, n_heads or n_layers missing (named).
    """
    attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    heads = required_int(cfg, "n_heads")
    return {
        **cfg,
        "hidden_size": required_int(cfg, "d_model"),
        "num_attention_heads": heads,
        "num_hidden_layers": required_int(cfg, "n_layers"),
        "num_key_value_heads": int(attn.get("kv_n_heads", 1)),
        "num_local_experts": int(ffn.get("moe_num_experts", 4)),
        "num_experts_per_tok": int(ffn.get("moe_top_k", 1)),
        "intermediate_size": int(ffn.get("ffn_hidden_size", 3584)),
        "max_position_embeddings": int(cfg.get("max_seq_len") or 2048),
        "head_dim": required_int(cfg, "d_model") // heads,
    }


class DbrxForCausalLM(MoeCausalLM):
    """DBRX on the engine's layers (module docstring)."""

    card = FamilyCard(
        "DBRX", ("databricks/dbrx-instruct", "databricks/dbrx-base"),
        "GQA, fused Wqkv with clip_qkv, LayerNorm", native_4bit=(),
    )

    spec_class = DbrxSpec
    model_types = ("dbrx",)
    weight_mapping = WeightMapping(
        renames=(
            ("transformer.wte.", "model.embed_tokens."),
            ("transformer.norm_f.", "model.norm."),
            ("transformer.blocks.", "model.layers."),
            (".norm_attn_norm.norm_1.", ".input_layernorm."),
            (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
            (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
            (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
            (".ffn.router.layer.", ".mlp.gate."),
            (".ffn.experts.mlp.", ".mlp.experts."),
        ),
        experts=ExpertMapping(
            fused_gate="w1", fused_up="v1", fused_down="w2", fused_down_in_out=True, flat=True
        ),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `ffn_config.ffn_hidden_size`; no biases; renormalised
        top-k when `moe_normalize_expert_weights` is set (1, checked in `spec_fields`).

        Raises:
            ValueError: a required field missing (named).
        """
        ffn = cfg.get("ffn_config") or {}
        fields = llama_style_fields(cfg)
        layers = fields["num_hidden_layers"]
        return cls.moe_shape(
            fields,
            moe_layers=tuple(range(layers)) if fields["num_local_experts"] else (),
            attention_bias=False,
            qk_norm=False,
            norm_topk_prob=ffn.get("moe_normalize_expert_weights", 1.0) is not None,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The LayerNorm epsilon, rope_theta, clip_qkv.

        Raises:
            StartupError: a rope_type other than default; ValueError: ffn_act_fn other than
                silu, moe_normalize_expert_weights other than 1 or null (another p-norm),
                clip_qkv <= 0, tie_word_embeddings.
        """
        ffn, attn = hf_config.ffn_config, hf_config.attn_config
        act = (ffn.ffn_act_fn or {}).get("name", "silu")
        if act != "silu":
            raise ValueError(
                f"config.json: ffn_config.ffn_act_fn name {act!r} is not supported for "
                f"{cls.__name__} (the experts compute SwiGLU with silu; supported: 'silu')"
            )
        p = ffn.moe_normalize_expert_weights
        if p is not None and float(p) != 1.0:
            raise ValueError(
                f"config.json: ffn_config.moe_normalize_expert_weights {p} is not supported "
                "(the top-k weights are renormalised to sum to 1: supported 1.0 or null)"
            )
        clip = attn.clip_qkv
        if clip is not None and clip <= 0:
            raise ValueError(f"config.json: attn_config.clip_qkv {clip!r} must be > 0 or null")
        if hf_config.tie_word_embeddings:
            raise ValueError("config.json: tie_word_embeddings is not supported for DBRX")
        return dict(
            rms_norm_eps=LAYER_NORM_EPS,
            rope_theta=rope_theta_of(hf_config),
            clip_qkv=None if clip is None else float(clip),
        )

    def build_norm(self, spec: DbrxSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`nn.LayerNorm(size, bias=False)`."""
        return LayerNorm(size, spec.rms_norm_eps, bias=False, dtype=dtype)

    def build_attention(
        self, spec: DbrxSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """No biases; the fused q/k/v output clamped by `clip_qkv`."""
        return Attention(spec, dtype, rotary, clip_qkv=spec.clip_qkv)

    def build_mlp(self, spec: DbrxSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Softmax then top-k, renormalised unless `moe_normalize_expert_weights` is null."""
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype,
        )
