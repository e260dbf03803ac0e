"""Kolibri-1 (Aleph Alpha, 2026; HF `Kolibri1ForCausalLM`, transformers 5.24
`modeling_kolibri1.py`).

EXAONE-4's attention and GLM-4's decoder layer over a sigmoid-routed MoE block. It differs from
the Llama-style decoder in:
- "sandwich" norms: the attention and MLP outputs are each normalised before their residual
  add (`layers/decoder.DecoderLayer` with `post_self_attn_layernorm` / `post_mlp_layernorm`);
- per-head q/k RMSNorm, no attention biases; a local/global mix (`layer_types`, by default
  every 5th layer global): sliding layers over `sliding_window` tokens with RoPE, global ones
  without a position embedding (NoPE) whenever `sliding_window` is set;
- every layer an MoE block: the router logits (float32) plus `e_score_correction_bias` choose
  the top-k, the weights are the sigmoid of the chosen logits, renormalised when
  `norm_topk_prob` (`layers/routing.sigmoid_grouped_topk(scoring="logits")`), plus one
  ungated shared-expert MLP of `shared_expert_intermediate_size`.

Checkpoint names (the hub's; transformers renames them on load, `conversion_mapping`):
`moe.router.expert_bias` -> `mlp.gate.e_score_correction_bias`, `post_attn_norm` ->
`post_self_attn_layernorm`, `post_ffn_norm` -> `post_mlp_layernorm`; the rest are the base
mapping's. KV cache: a full-attention group and a sliding-window group.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe, required_int
from moe_engine.models.dots1 import window_layer_fields
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `Kolibri1Config` defaults.
DEFAULT_SLIDING_WINDOW = 513
DEFAULT_SHARED_WIDTH = 512


class Kolibri1ForCausalLM(MoeCausalLM):
    """Kolibri-1 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Kolibri-1", ("Aleph-Alpha/Kolibri-1",),
        "GQA, q/k norm, sandwich norms, sliding/global mix (NoPE globals)",
        cache=("full", "sliding"),
    )

    model_types = ("kolibri1",)
    weight_mapping = WeightMapping(
        renames=(
            (".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".post_attn_norm.", ".post_self_attn_layernorm."),
            (".post_ffn_norm.", ".post_mlp_layernorm."),
        ),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE; q/k norm, no attention biases; a shared expert of
        `shared_expert_intermediate_size` (default 512); `norm_topk_prob` default false;
        `layer_types` as `Kolibri1Config` derives them (every 5th layer full).

        Raises:
            ValueError: a required field missing (named), malformed layer types or window.
        """
        layers = required_int(cfg, "num_hidden_layers")
        types = [FULL_ATTENTION if (i + 1) % 5 == 0 else SLIDING_ATTENTION for i in range(layers)]
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            attention_bias=False,
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(
                cfg.get("shared_expert_intermediate_size", DEFAULT_SHARED_WIDTH) or 0
            ),
            router_correction_bias=True,
            router_float32=True,
            **window_layer_fields(cfg, types, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, the NoPE (global) layers when `sliding_window` is set.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        nope = ()
        if hf_config.sliding_window is not None:
            nope = tuple(i for i, t in enumerate(hf_config.layer_types) if t != SLIDING_ATTENTION)
        return dict(**super().spec_fields(hf_config), nope_layers=nope)

    def build_mlp(self, spec, index: int, dtype: torch.dtype) -> nn.Module:
        """The biased logits choose the top-k, their sigmoid weighs them (float32 router); the
        shared expert beside them."""
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, spec.norm_topk_prob, 1.0,
            scoring="logits",
        )
        width = spec.shared_expert_intermediate_size
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router,
            shared_experts=SharedExperts(spec.hidden_size, width, dtype) if width else None,
        )

    def build_layer(self, spec, index: int, dtype: torch.dtype, rotary: nn.Module) -> nn.Module:
        """GLM-4's layer: pre-norms and output norms around both branches."""
        norm = self.build_norm
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            post_self_attn_layernorm=norm(spec, spec.hidden_size, dtype),
            post_mlp_layernorm=norm(spec, spec.hidden_size, dtype),
        )
