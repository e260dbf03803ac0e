"""LaraMini (Translated, model card "translated/Lara-4-Mini-Base"; HF `LaraMiniForCausalLM`,
transformers 5.24 `models/lara_mini/modeling_lara_mini.py`).

A hybrid decoder on Qwen3.5-MoE's text layers, per `layer_types` (default the released
period-5 pattern linear, sliding, linear, full, sliding):
- "linear_attention": Qwen3.5's Gated DeltaNet (`layers/gated_delta_net.GatedDeltaNet`, a
  per-request state slot instead of a KV cache), its four input projections stored fused as
  one `in_proj` (rows [q | k | v | z | b | a]) and its gated norm `out_norm` multiplying the
  weight in float32 (`LaraMiniRMSNormGated`);
- "sliding_attention": Qwen3-style GQA with per-head q/k RMSNorm, full RoPE and a window of
  `sliding_window` keys (the query included);
- "full_attention": the same attention without position embedding (NoPE) nor window.
It differs from Qwen3-Next / Qwen3.5-MoE in: no attention output gate, no partial rope, plain
(not zero-centred) RMSNorms that multiply the weight in float32 (`HeliumRMSNorm`), router
logits computed in float32 (softmax top-k, renormalised when `norm_topk_prob`), and a shared
expert added in full, without a gate (`FlintSparseMoeBlock`); every layer is MoE.

Checkpoint names (`model.layers.{i}.` + ...): `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`;
`linear_attn.{in_proj, conv1d, dt_bias, A_log, out_norm, out_proj}`; `mlp.gate.weight`,
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] (or per-expert projections),
`mlp.shared_expert.{gate,up,down}_proj`. KV cache: a full-attention group and a
sliding-window group for the attention layers, the linear layers' state slots beside them;
prefix caching and speculative decoding are refused (`build.check_linear_attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.gated_delta_net import GatedDeltaNet, LinearAttentionDecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import GatedRMSNorm, RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.routers import SoftmaxTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.qwen3_next import Qwen3NextForCausalLM
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `LaraMiniConfig` defaults.
DEFAULT_PATTERN = (LINEAR_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION,
                   SLIDING_ATTENTION)
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_SHARED_EXPERT_WIDTH = 512


def lara_mini_layer_types(cfg: dict) -> tuple[str, ...]:
    """config.json's `layer_types`, default the period-5 `DEFAULT_PATTERN`
    (`LaraMiniConfig.__post_init__`).

    Raises:
        ValueError: a layer_types of the wrong length or with an unknown entry.
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or [DEFAULT_PATTERN[i % 5] for i in range(layers)]
    known = {LINEAR_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION}
    if len(types) != layers or not set(types) <= known:
        raise ValueError(
            f"config.json: layer_types {types} must give one of {sorted(known)} for each of "
            f"the {layers} layers"
        )
    return tuple(types)


class LaraMiniForCausalLM(Qwen3NextForCausalLM):
    """LaraMini on the engine's layers (module docstring)."""

    model_types = ("lara_mini",)
    spec_class = ArchSpec
    card = FamilyCard(
        "LaraMini", ("translated/Lara-4-Mini-Base",),
        "Gated DeltaNet + GQA (q/k norm), sliding RoPE + NoPE full layers",
        cache=("full", "sliding", "state"), speculation=(),
    )
    weight_mapping = WeightMapping(renames=(
        (".mlp.shared_expert.", ".mlp.shared_experts."),
        (".linear_attn.out_norm.", ".linear_attn.norm."),
    ))

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Embeddings tied unless `tie_word_embeddings` is false; every layer MoE
        (`num_experts` of `moe_intermediate_size`, softmax top-k with a float32 router,
        `norm_topk_prob` default true, an ungated shared expert of
        `shared_expert_intermediate_size`, default 512); q/k norms; the layer types with
        `sliding_window` (default 512) and the linear layers' sizes (`LaraMiniConfig`
        defaults).

        Raises:
            ValueError: a required field missing (named), a malformed layer_types, a window
                below 1 token with sliding layers.
        """
        types = lara_mini_layer_types(cfg)
        window = int(cfg.get("sliding_window") or DEFAULT_SLIDING_WINDOW)
        if SLIDING_ATTENTION in types and window < 1:
            raise ValueError(f"config.json: sliding_window {window} must be >= 1 token")
        shared = int(cfg.get("shared_expert_intermediate_size", DEFAULT_SHARED_EXPERT_WIDTH))
        bias = bool(cfg.get("attention_bias", False))
        return cls.moe_shape(
            cfg,
            moe_layers=tuple(range(required_int(cfg, "num_hidden_layers"))),
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=shared,
            router_float32=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            layer_types=types,
            sliding_window=window if SLIDING_ATTENTION in types else None,
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 8)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 16)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps and rope_theta (full-head RoPE on the sliding layers).

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act not silu.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta_of(hf_config))

    def build_rotary(self, spec: ArchSpec, max_position: int) -> nn.Module:
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta)

    def build_norm(self, spec: ArchSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """`LaraMiniRMSNorm` (Helium's): the weight multiplied in float32."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)

    def build_attention(self, spec: ArchSpec, index: int, dtype: torch.dtype,
                        rotary: nn.Module) -> nn.Module:
        """Sliding layers: the rope and the window; full layers: neither (NoPE); q/k norms
        of the float32-weight kind."""
        sliding = spec.layer_types[index] == SLIDING_ATTENTION
        attn = Attention(spec, dtype, rotary if sliding else None,
                         spec.sliding_window if sliding else None, o_bias=spec.attention_bias)
        attn.q_norm = self.build_norm(spec, spec.head_dim, dtype)
        attn.k_norm = self.build_norm(spec, spec.head_dim, dtype)
        return attn

    def build_mlp(self, spec: ArchSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Softmax top-k over float32 logits (`LaraMiniTopKRouter`) and the ungated shared
        expert added in full."""
        router = SoftmaxTopKRouter(spec.hidden_size, spec.num_experts, spec.top_k,
                                   spec.norm_topk_prob, dtype=torch.float32)
        shared = SharedExperts(spec.hidden_size, spec.shared_expert_intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=router, shared_experts=shared,
        )

    def build_layer(self, spec: ArchSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """A `LinearAttentionDecoderLayer` around a fused-projection `GatedDeltaNet` for linear
        layers, else a `DecoderLayer`."""
        mlp = self.build_mlp(spec, index, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] != LINEAR_ATTENTION:
            return DecoderLayer(self.build_attention(spec, index, dtype, rotary), mlp, *norms)
        mixer = GatedDeltaNet(
            spec.hidden_size, spec.linear_num_key_heads, spec.linear_num_value_heads,
            spec.linear_key_head_dim, spec.linear_value_head_dim, spec.linear_conv_kernel_dim,
            spec.rms_norm_eps, dtype, fused_projection=True,
        )
        mixer.norm = GatedRMSNorm(spec.linear_value_head_dim, spec.rms_norm_eps, dtype=dtype,
                                  weight_in_float32=True)
        return LinearAttentionDecoderLayer(mixer, mlp, *norms)
