"""Kimi-Linear (Moonshot AI, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692, Kimi-Linear-48B-A3B model card; HF `KimiLinearForCausalLM`, transformers
5.24 `modeling_kimi_linear.py`).

A hybrid of DeepSeek-V3's blocks: `layer_types` "linear_attention" layers are Kimi Delta
Attention (`layers/kda.KimiDeltaAttention`: the gated delta rule with a decay per key
channel, short convs on q, k and v), "full_attention" layers MLA (`layers/mla.py`). It
differs from DeepSeek-V3 in:
- KDA layers keep a fixed per-request state (conv [3 H D, W - 1] and recurrent [H, D, D]:
  `kv_cache.state`) instead of a latent cache, so prefix caching and speculative decoding are
  refused at startup (`build.check_linear_attention`);
- MLA without positions (NoPE): the qk_rope_head_dim part of the keys is shared by the heads
  but never rotated (`MLAAttention` with rotary None); the softmax scale is
  qk_head_dim**-0.5;
- MLP kinds from `mlp_layer_types` ("dense" / "sparse"; default: the first
  `first_k_dense_replace` = 1 dense), DeepSeek-V3's sigmoid group-limited routing with the
  correction bias and `num_shared_experts` ungated shared experts;
- config.json keys: `num_experts`, `num_experts_per_token`, `num_shared_experts`,
  `num_expert_group`, `moe_renormalize`, `model_max_length`, and the linear layers in
  `linear_attn_config` ({head_dim, num_heads, short_conv_kernel_size, kda_layers,
  full_attn_layers}, layers 1-indexed) or `linear_head_dim` / `linear_num_heads` /
  `linear_conv_kernel_dim` / `layer_types`.

Checkpoint names: `block_sparse_moe.{gate, experts.{e}.w1/w3/w2, shared_experts}` (dense
layers `block_sparse_moe.{gate,up,down}_proj`), MLA's under `self_attn` as DeepSeek's, KDA's
under `self_attn` (`layers/kda.py`). KV cache: one MLA group of the full-attention layers; the
KDA layers' state slots beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.config_fields import check_hidden_act, mla_shape_fields, required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Spec
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.gated_delta_net import LinearAttentionDecoderLayer
from moe_engine.models.layers.kda import KimiDeltaAttention
from moe_engine.models.layers.mla import MLA_STACKED
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import QKV_STACKED, ExpertMapping, WeightMapping

#: Kimi's config.json keys -> the names the shared readers use (`KimiLinearConfig.attribute_map`).
KEY_ALIASES = {
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
}
#: `KimiLinearConfig` defaults.
DEFAULTS = {"linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4}


def kimi_config(cfg: dict) -> dict:
    """config.json with Kimi's keys also under the shared names and `linear_attn_config`
    read into `linear_head_dim`, `linear_num_heads`, `linear_conv_kernel_dim` and
    `layer_types` (transformers `KimiLinearConfig.__post_init__`'s precedence)."""
    out = dict(cfg)
    for key, name in KEY_ALIASES.items():
        if key in cfg and cfg.get(name) is None:
            out[name] = cfg[key]
    linear = cfg.get("linear_attn_config") or {}
    for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                      ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        out[name] = int(linear.get(key, cfg.get(name, DEFAULTS[name])))
    layers = required_int(cfg, "num_hidden_layers")
    if not cfg.get("layer_types"):
        if "kda_layers" in linear and "full_attn_layers" in linear:
            types: list = [None] * layers
            for i in linear["full_attn_layers"]:
                types[i - 1] = FULL_ATTENTION
            for i in linear["kda_layers"]:
                types[i - 1] = LINEAR_ATTENTION
        else:
            types = [FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION
                     for i in range(layers)]
        out["layer_types"] = types
    return out


def kimi_layer_kinds(cfg: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(layer_types, MoE layers) of a `kimi_config` dict.

    Raises:
        ValueError: a layer_types or mlp_layer_types of the wrong length or with an unknown
            entry, no full-attention layer.
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg["layer_types"]
    if len(types) != layers or not set(types) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"config.json: layer_types {types} must give one of "
                         f"'linear_attention', 'full_attention' for each of the {layers} layers")
    if FULL_ATTENTION not in types:
        raise ValueError("config.json: layer_types has no full_attention layer")
    first = int(cfg.get("first_k_dense_replace", 1))
    mlp = cfg.get("mlp_layer_types") or ["dense" if i < first else "sparse"
                                         for i in range(layers)]
    if len(mlp) != layers or not set(mlp) <= {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types {mlp} must give 'dense' or 'sparse' "
                         f"for each of the {layers} layers")
    return tuple(types), tuple(i for i, kind in enumerate(mlp) if kind == "sparse")


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """Kimi-Linear on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Kimi-Linear", ("moonshotai/Kimi-Linear-48B-A3B-Instruct",),
        "Kimi Delta Attention + MLA without rope", cache=("mla", "state"), speculation=(),
    )

    model_types = ("kimi_linear",)
    mtp_layers_field = None
    weight_mapping = WeightMapping(
        renames=((".block_sparse_moe.", ".mlp."),),
        stacked_params=QKV_STACKED + MLA_STACKED,
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MLA sizes, the MoE layers (`mlp_layer_types`), shared experts of width
        moe_intermediate_size x num_shared_experts, a float32 router with a correction bias,
        the layer types and the KDA layers' state and parameters.

        Raises:
            ValueError: a required field missing (named), malformed layer kinds, hidden_act
                other than silu, kv_lora_rank missing, group limits the router refuses.
        """
        cfg = kimi_config(cfg)
        check_hidden_act(cfg, cls.__name__)
        if not cfg.get("kv_lora_rank"):
            raise ValueError(f"config.json: kv_lora_rank is {cfg.get('kv_lora_rank')!r}: "
                             "Kimi-Linear's MLA layers need the latent width")
        cls.check_routing(cfg)
        layer_types, moe_layers = kimi_layer_kinds(cfg)
        hidden, width = required_int(cfg, "hidden_size"), required_int(cfg, "moe_intermediate_size")
        heads, d, w = cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]
        qkv = heads * d
        # q/k/v/o projections, the three convs, f_a/g_a and f_b/g_b, dt_bias, A_log, b_proj,
        # o_norm (`KimiDeltaAttention`)
        params = (4 * hidden * qkv + 3 * qkv * w + 2 * hidden * d + 2 * d * qkv + qkv + heads
                  + hidden * heads + d)
        return cls.moe_shape(
            cfg,
            moe_layers=moe_layers,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
            router_correction_bias=True,
            router_float32=True,
            layer_types=layer_types,
            linear_mixer="Kimi Delta Attention",
            linear_state=((3 * qkv, w - 1), (heads, d, d)),
            linear_mixer_params=params,
            linear_num_key_heads=heads,
            linear_num_value_heads=heads,
            linear_key_head_dim=d,
            linear_value_head_dim=d,
            linear_conv_kernel_dim=w,
            **mla_shape_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, the group limits and scaling (no rope).

        Raises:
            ValueError: linear_conv_kernel_dim below 2.
        """
        if int(hf_config.linear_conv_kernel_dim) < 2:
            raise ValueError(f"config.json: linear_conv_kernel_dim "
                             f"{hf_config.linear_conv_kernel_dim} must be >= 2")
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            n_group=int(hf_config.n_group or 1),
            topk_group=int(hf_config.topk_group or 1),
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
        )

    def build_rotary(self, spec: DeepseekV3Spec, max_position: int) -> None:
        """No rope (NoPE MLA)."""
        return None

    def build_layer(
        self, spec: DeepseekV3Spec, index: int, dtype: torch.dtype, rotary: None
    ) -> nn.Module:
        """A `LinearAttentionDecoderLayer` around KDA (as `self_attn`) for linear layers, else
        DeepSeek-V3's MLA `DecoderLayer`; the MLP by `moe_layers`."""
        mlp = self.build_mlp(spec, index, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] == LINEAR_ATTENTION:
            kda = KimiDeltaAttention(spec.hidden_size, spec.linear_num_key_heads,
                                     spec.linear_key_head_dim, spec.linear_conv_kernel_dim,
                                     spec.rms_norm_eps, dtype)
            return LinearAttentionDecoderLayer(kda, mlp, *norms, mixer=spec.linear_mixer,
                                               mixer_name="self_attn")
        return DecoderLayer(self.build_attention(spec, index, dtype, rotary), mlp, *norms)
