"""Bailing-hybrid / Ling 3 (inclusionAI, model card "inclusionAI/Ling-3.0-Flash"; HF
`BailingHybridForCausalLM`, transformers 5.24 `models/bailing_hybrid/modeling_bailing_hybrid.py`).

Kimi-Linear's hybrid (`kimi_linear.py`): `layer_types` "linear_attention" layers are Kimi
Delta Attention, "full_attention" layers MLA, by default the last of every `layer_group_size`
(6) layers; DeepSeek-V3's MoE (sigmoid group-limited routing with the correction bias,
`num_shared_experts` shared experts, dense MLPs by `mlp_layer_types`, default the first
`first_k_dense_replace` = 2). It differs from Kimi-Linear in:
- the delta attention's forget and output gates are full projections (`f_proj`, `g_proj`
  [H -> heads x D]) and the forget gate is bounded when `kda_safe_gate` (default):
  g = kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in (kda_lower_bound, 0)
  (`layers/kda.KimiDeltaAttention` with `low_rank_gates=False`, `gate_lower_bound`);
- MLA with interleaved RoPE on the qk_rope_head_dim part (`rope_theta` default 6e6) and a
  per-head output gate, sigmoid(g_proj(h)) [heads] (`layers/mla.MLAAttention(head_gate=True)`);
- the linear layers' sizes come from `linear_head_dim` / `linear_num_heads` /
  `linear_conv_kernel_dim`, defaults `head_dim`, `num_attention_heads` and
  `short_conv_kernel_size` (`BailingHybridConfig.__post_init__`).

Checkpoint names (Ling's, transformers' "bailing_hybrid" conversion mapping undone):
`model.word_embeddings`; per layer `attention.*` (MLA: `q_proj` or `q_a_proj`/`q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `g_proj`, `dense` = o_proj; delta
attention: `{q,k,v}_proj`, `{q,k,v}_conv1d`, `f_proj`, `dt_bias`, `A_log`, `b_proj`, `g_proj`,
`o_norm`, `dense`); `mlp.gate.{weight, expert_bias}` (the correction bias),
`mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.*`, dense `mlp.{gate,up,down}_proj`.
MTP layers (`num_nextn_predict_layers`, stored as layers num_hidden_layers..) are not loaded,
as transformers ignores them (the loader skips layers past num_layers). KV cache: one MLA
group of the full-attention layers, the delta layers' state slots beside it; prefix caching
and speculative decoding are refused.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.config_fields import required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Spec
from moe_engine.models.kimi_linear import KimiLinearForCausalLM
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.gated_delta_net import LinearAttentionDecoderLayer
from moe_engine.models.layers.kda import KimiDeltaAttention
from moe_engine.models.layers.mla import MLA_STACKED, MLAAttention
from moe_engine.models.layers.rotary import rope_with_scaling_of
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import QKV_STACKED, WeightMapping

#: `BailingHybridConfig` defaults.
DEFAULT_LAYER_GROUP_SIZE = 6
DEFAULT_FIRST_K_DENSE = 2
DEFAULT_KDA_LOWER_BOUND = -5.0


@dataclasses.dataclass(frozen=True)
class BailingHybridSpec(DeepseekV3Spec):
    """`DeepseekV3Spec` plus the delta attention's forget-gate bound (None: unbounded)."""

    kda_lower_bound: float | None = None


def bailing_config(cfg: dict) -> dict:
    """config.json with the linear layers' sizes, `layer_types` and `mlp_layer_types` filled
    from Ling's fields (`BailingHybridConfig.__post_init__`), for `KimiLinearForCausalLM`'s
    readers."""
    layers = required_int(cfg, "num_hidden_layers")
    out = dict(cfg)
    out.setdefault("linear_head_dim", int(cfg.get("head_dim") or 128))
    out.setdefault("linear_num_heads", required_int(cfg, "num_attention_heads"))
    out.setdefault("linear_conv_kernel_dim", int(cfg.get("short_conv_kernel_size") or 4))
    group = int(cfg.get("layer_group_size") or DEFAULT_LAYER_GROUP_SIZE)
    if not cfg.get("layer_types"):
        out["layer_types"] = [FULL_ATTENTION if (i + 1) % group == 0 else LINEAR_ATTENTION
                              for i in range(layers)]
    first = int(cfg.get("first_k_dense_replace", DEFAULT_FIRST_K_DENSE))
    if not cfg.get("mlp_layer_types"):
        out["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(layers)]
    return out


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """Bailing-hybrid on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Bailing-hybrid (Ling 3)", ("inclusionAI/Ling-3.0-Flash",),
        "gated delta attention (per-channel forget gate) + head-gated MLA",
        cache=("mla", "state"), speculation=(),
    )

    model_types = ("bailing_hybrid",)
    spec_class = BailingHybridSpec
    # Order matters for `checkpoint_name`, which undoes the renames last first.
    weight_mapping = WeightMapping(
        renames=(
            ("model.word_embeddings.", "model.embed_tokens."),
            (".attention.", ".self_attn."),
            (".self_attn.dense.", ".self_attn.o_proj."),
            (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
        ),
        stacked_params=QKV_STACKED + MLA_STACKED,
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Kimi-Linear's fields over `bailing_config`, with the head gate of the MLA layers
        and the delta layers' parameters: q/k/v/o projections, the three convs, f_proj,
        g_proj, dt_bias, A_log, b_proj, o_norm.

        Raises:
            ValueError: as `KimiLinearForCausalLM.shape_fields`.
        """
        fields = super().shape_fields(bailing_config(cfg))
        hidden = fields["hidden_size"]
        heads, d = fields["linear_num_key_heads"], fields["linear_key_head_dim"]
        w, qkv = fields["linear_conv_kernel_dim"], heads * d
        params = 6 * hidden * qkv + 3 * qkv * w + qkv + heads + hidden * heads + d
        return {**fields, "attn_head_gate": True, "linear_mixer_params": params}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """Kimi-Linear's (rms_norm_eps, the group limits and scaling), rope_theta with any
        YaRN, rope always interleaved, and the forget-gate bound (`kda_lower_bound` when
        `kda_safe_gate`, both default as `BailingHybridConfig`).

        Raises:
            StartupError: a rope_type other than default or yarn; ValueError:
                linear_conv_kernel_dim below 2.
        """
        theta, yarn = rope_with_scaling_of(hf_config)
        cfg = hf_config.to_dict()
        bound = float(cfg.get("kda_lower_bound", DEFAULT_KDA_LOWER_BOUND))
        return {**super().spec_fields(hf_config), "rope_theta": theta, "yarn": yarn,
                "rope_interleave": True,
                "kda_lower_bound": bound if cfg.get("kda_safe_gate", True) else None}

    def build_rotary(self, spec: BailingHybridSpec, max_position: int) -> nn.Module:
        """DeepSeek-V3's interleaved RoPE over qk_rope_head_dim."""
        return DeepseekV3ForCausalLM.build_rotary(self, spec, max_position)

    def build_attention(self, spec: BailingHybridSpec, index: int, dtype: torch.dtype,
                        rotary: nn.Module) -> nn.Module:
        """`MLAAttention` with the per-head output gate."""
        return MLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias, dtype=dtype, head_gate=True,
        )

    def build_layer(self, spec: BailingHybridSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """A `LinearAttentionDecoderLayer` around the full-gate delta attention (as
        `self_attn`) for linear layers, else the head-gated MLA `DecoderLayer`."""
        mlp = self.build_mlp(spec, index, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] != LINEAR_ATTENTION:
            return DecoderLayer(self.build_attention(spec, index, dtype, rotary), mlp, *norms)
        kda = KimiDeltaAttention(spec.hidden_size, spec.linear_num_key_heads,
                                 spec.linear_key_head_dim, spec.linear_conv_kernel_dim,
                                 spec.rms_norm_eps, dtype, low_rank_gates=False,
                                 gate_lower_bound=spec.kda_lower_bound)
        return LinearAttentionDecoderLayer(kda, mlp, *norms, mixer=spec.linear_mixer,
                                           mixer_name="self_attn")
