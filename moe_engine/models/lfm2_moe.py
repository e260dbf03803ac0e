"""LFM2-MoE (Liquid AI, "LFM2 Technical Report", arXiv:2511.23404, LFM2-8B-A1B model card;
HF `Lfm2MoeForCausalLM`, transformers 5.24 `modeling_lfm2_moe.py`).

A hybrid decoder: `layer_types` "conv" layers are gated short convolutions
(`layers/short_conv.ShortConv`: in_proj -> B, C, x; y = out_proj(C * conv(B * x)), a
depthwise causal conv of kernel `conv_L_cache`, no activation), "full_attention" layers are
GQA attention with per-head q/k RMSNorm and full RoPE. It differs from the Llama-style MoE
decoder in:
- conv layers keep a fixed per-request state, the conv's last `conv_L_cache - 1` inputs
  (`kv_cache.state`, a conv part only), instead of a KV cache, so prefix caching and
  speculative decoding are refused at startup (`build.check_linear_attention`);
- dense-first layout: layers below `num_dense_layers` have a dense SwiGLU MLP of
  `intermediate_size`, the rest are MoE blocks;
- routing: sigmoid scores, `expert_bias` added for the choice only (`use_expert_bias`),
  weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`
  (`SigmoidGroupedTopKRouter` with one group; transformers adds 1e-6 to the renormalising
  sum, the router 1e-20: a relative difference below 1e-6 in the weights);
- the final norm is named `embedding_norm`; norms `operator_norm` / `ffn_norm`; eps `norm_eps`.

Checkpoint names: `model.layers.{i}.conv.{in_proj, conv, out_proj}`,
`self_attn.{q,k,v}_proj`, `self_attn.out_proj`, `self_attn.{q,k}_layernorm`,
`feed_forward.{w1,w3,w2}` (dense), `feed_forward.gate.weight`, `feed_forward.expert_bias`,
`feed_forward.experts.{e}.{w1,w3,w2}` (or the fused `gate_up_proj` / `down_proj`),
`model.embedding_norm`. KV cache: one full-attention group of the attention layers; the conv
layers' state slots beside it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.decoder import DecoderLayer, DenseMLP
from moe_engine.models.layers.gated_delta_net import LinearAttentionDecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.short_conv import ShortConv
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: config.json `layer_types` entries -> the engine's layer kinds.
LAYER_KINDS = {"conv": LINEAR_ATTENTION, "full_attention": FULL_ATTENTION}
#: `Lfm2MoeConfig` defaults.
DEFAULT_CONV_L_CACHE = 3
DEFAULT_NUM_DENSE_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Lfm2MoeSpec(ArchSpec):
    """`ArchSpec` plus the routing's scale and the conv layers' biases (`conv_bias`)."""

    routed_scaling_factor: float = 1.0
    conv_bias: bool = False


def lfm2_layer_types(cfg: dict) -> tuple[str, ...]:
    """config.json `layer_types` as the engine's kinds ("conv" -> linear attention).

    Raises:
        ValueError: layer_types missing, of the wrong length, with an unknown entry or no
            attention layer.
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if not types or len(types) != layers or not set(types) <= set(LAYER_KINDS):
        raise ValueError(f"config.json: layer_types {types} must give one of 'conv', "
                         f"'full_attention' for each of the {layers} layers")
    if "full_attention" not in types:
        raise ValueError("config.json: layer_types has no full_attention layer")
    return tuple(LAYER_KINDS[t] for t in types)


class Lfm2MoeForCausalLM(MoeCausalLM):
    """LFM2-MoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "LFM2-MoE", ("LiquidAI/LFM2-8B-A1B",),
        "gated short convolutions + GQA (q/k norm)", cache=("full", "state"), speculation=(),
    )

    model_types = ("lfm2_moe",)
    spec_class = Lfm2MoeSpec
    weight_mapping = WeightMapping(
        renames=(
            (".feed_forward.", ".mlp."),
            (".mlp.w1.", ".mlp.gate_proj."),
            (".mlp.w3.", ".mlp.up_proj."),
            (".mlp.w2.", ".mlp.down_proj."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."),
            ("model.embedding_norm.", "model.norm."),
        ),
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers from `num_dense_layers` on (dense width `intermediate_size`), experts
        `num_experts` of width `moe_intermediate_size`; q/k norms, no biases; the conv layers'
        state [H, conv_L_cache - 1] and parameters; tied embeddings by default.

        Raises:
            ValueError: a required field missing (named), a malformed layer_types.
        """
        layers = required_int(cfg, "num_hidden_layers")
        first = int(cfg.get("num_dense_layers", DEFAULT_NUM_DENSE_LAYERS))
        hidden = required_int(cfg, "hidden_size")
        width = int(cfg.get("conv_L_cache", DEFAULT_CONV_L_CACHE))
        bias = bool(cfg.get("conv_bias", False))
        conv_params = 4 * hidden * hidden + hidden * width + (5 * hidden if bias else 0)
        tie = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
        return cls.moe_shape(
            cfg,
            moe_layers=tuple(range(first, layers)),
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            router_correction_bias=bool(cfg.get("use_expert_bias", True)),
            router_float32=True,
            tie_word_embeddings=bool(tie),
            layer_types=lfm2_layer_types(cfg),
            linear_mixer="short convolution",
            linear_state=((hidden, width - 1), None),
            linear_mixer_params=conv_params,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """norm_eps, rope_theta, routed_scaling_factor, conv_bias.

        Raises:
            StartupError: a rope_type other than default; ValueError: conv_L_cache below 2.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        if int(hf_config.conv_L_cache) < 2:
            raise ValueError(f"config.json: conv_L_cache {hf_config.conv_L_cache} must be >= 2")
        return dict(rms_norm_eps=hf_config.norm_eps, rope_theta=rope_theta_of(hf_config),
                    routed_scaling_factor=float(hf_config.routed_scaling_factor),
                    conv_bias=bool(hf_config.conv_bias))

    def build_mlp(self, spec: Lfm2MoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP below `num_dense_layers`; then sigmoid routing with the expert bias."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, spec.norm_topk_prob,
            spec.routed_scaling_factor, correction_bias=spec.router_correction_bias,
        )
        return FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size,
                        spec.moe_intermediate_size, spec.norm_topk_prob, dtype, router=router)

    def build_layer(
        self, spec: Lfm2MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """A `LinearAttentionDecoderLayer` around a `ShortConv` for conv layers, else a
        `DecoderLayer` with q/k-normed attention."""
        mlp = self.build_mlp(spec, index, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] == LINEAR_ATTENTION:
            (channels, state), _ = spec.linear_state_shapes()
            conv = ShortConv(channels, state + 1, spec.conv_bias, dtype)
            return LinearAttentionDecoderLayer(conv, mlp, *norms, mixer=spec.linear_mixer,
                                               mixer_name="conv")
        return DecoderLayer(Attention(spec, dtype, rotary, qk_norm=True), mlp, *norms)
