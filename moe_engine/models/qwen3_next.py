"""Qwen3-Next (Qwen team, "Qwen3-Next" model card, 2025; HF `Qwen3NextForCausalLM`,
transformers 5.24 `modeling_qwen3_next.py`).

A hybrid decoder: most layers are Gated DeltaNet linear attention (`layer_types`
"linear_attention"; by default every layer but each `full_attention_interval`-th, 3 of 4),
the rest gated full attention. It differs from Qwen2-MoE in:
- linear layers (`layers/gated_delta_net.GatedDeltaNet`): a fixed per-request state instead
  of a KV cache (`kv_cache.state`), so prefix caching and speculative decoding are refused
  at startup (`build.check_linear_attention`);
- gated attention: q_proj yields per head D query dims then D gate dims, the attention output
  is multiplied by sigmoid(gate) before o_proj; q/k RMSNorm; partial RoPE on the first
  head_dim x `partial_rotary_factor` (default 0.25) dims ("rotate half" within them);
- zero-centred RMSNorm (`layers/norm.ZeroCenteredRMSNorm`, y = (1 + w) x / rms) for the
  layers' norms, the q/k norms and the final norm;
- MoE: softmax top-k routing renormalised when `norm_topk_prob` (default true) and a shared
  expert scaled by sigmoid(`shared_expert_gate`(x)) (as Qwen2-MoE); MoE layers by
  `mlp_only_layers` / `decoder_sparse_step`.

Checkpoint names: Qwen2-MoE's (shared expert renames included), plus per linear layer
`model.layers.{i}.linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm,
out_proj}`. KV cache: one full-attention group of the attention layers; the linear layers'
state slots beside it. Released checkpoints also carry MTP weights (`mtp.*`), which are not
loaded (transformers drops them too).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.config_fields import check_hidden_act, required_int, sparse_step_moe_layers
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.gated_delta_net import GatedDeltaNet, LinearAttentionDecoderLayer
from moe_engine.models.layers.linear import MergedLinear
from moe_engine.models.layers.norm import ZeroCenteredRMSNorm
from moe_engine.models.layers.rotary import (
    PartialRotaryEmbedding,
    partial_rotary_dim_of,
    rope_theta_of,
)
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.qwen2_moe import Qwen2MoeForCausalLM
from moe_engine.models.spec import ArchSpec, FamilyCard

#: `Qwen3NextConfig` defaults.
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_SHARED_EXPERT_WIDTH = 512


@dataclasses.dataclass(frozen=True)
class Qwen3NextSpec(ArchSpec):
    """`ArchSpec` plus the rotated dims of the partial rope."""

    rotary_dim: int = 0


def qwen3_next_layer_types(cfg: dict) -> tuple[str, ...]:
    """config.json's `layer_types`, or every `full_attention_interval`-th layer full attention
    and the rest linear (`Qwen3NextConfig.__post_init__`).

    Raises:
        ValueError: a layer_types of the wrong length or with an unknown entry.
    """
    layers = required_int(cfg, "num_hidden_layers")
    interval = int(cfg.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
    types = cfg.get("layer_types") or [
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)
    ]
    if len(types) != layers or not set(types) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(
            f"config.json: layer_types {types} must give one of 'linear_attention', "
            f"'full_attention' for each of the {layers} layers"
        )
    if FULL_ATTENTION not in types:
        raise ValueError("config.json: layer_types has no full_attention layer")
    return tuple(types)


class GatedAttention(Attention):
    """`Attention` whose q_proj also yields a per-head output gate (transformers
    `Qwen3NextAttention`): per head, D query dims then D gate dims; out = o_proj(attn(q, k,
    v) * sigmoid(gate)). Zero-centred q/k norms; always the module path (no native prologue).
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype, rotary: nn.Module) -> None:
        super().__init__(spec, dtype, rotary, qk_norm=True)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.sizes = (2 * q_size, kv_size, kv_size)
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q": 2 * q_size, "k": kv_size, "v": kv_size},
            bias=spec.attention_bias, dtype=dtype,
        )  # fmt: skip
        self.q_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype)

    def bind_kernels(self, plan) -> None:
        """The module path always: the native prologue knows no output gate."""
        self.prologue = None

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """h: [T, H] -> [T, H]; positions [T] int64; kv_cache: this layer's (K, V) pair."""
        t, d = h.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(h).split(self.sizes, dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(t, self.num_heads * d)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, d))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.view(t, self.num_kv_heads, d), kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-Next on the engine's layers (module docstring)."""

    model_types = ("qwen3_next",)
    spec_class = Qwen3NextSpec
    card = FamilyCard(
        "Qwen3-Next", ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
        "Gated DeltaNet + gated GQA (q/k norm, partial rotary)", cache=("full", "state"),
        speculation=(),
    )
    #: The linear layers' four plain input projections (Qwen3.5-MoE) instead of two.
    split_linear_projections = False

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Qwen2-MoE's MoE fields (`norm_topk_prob` default true, shared expert width default
        512), gated attention with q/k norm and biases from `attention_bias`, the layer types
        and the linear layers' sizes (`Qwen3NextConfig` defaults).

        Raises:
            ValueError: a required field missing (named), a malformed layer_types.
        """
        shared = int(cfg.get("shared_expert_intermediate_size", DEFAULT_SHARED_EXPERT_WIDTH) or 0)
        bias = bool(cfg.get("attention_bias", False))
        return cls.moe_shape(
            cfg,
            moe_layers=sparse_step_moe_layers(cfg),
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=shared,
            shared_expert_gate=shared > 0,
            layer_types=qwen3_next_layer_types(cfg),
            attn_output_gate=True,
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta and the rotated dims.

        Raises:
            StartupError: a rope_type other than default, a partial_rotary_factor outside
                (0, 1]; ValueError: hidden_act other than silu, an odd rotary_dim.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        rotary_dim = partial_rotary_dim_of(hf_config)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta_of(hf_config),
                    rotary_dim=rotary_dim)

    def build_rotary(self, spec: Qwen3NextSpec, max_position: int) -> nn.Module:
        return PartialRotaryEmbedding(spec.head_dim, spec.rotary_dim, max_position, spec.rope_theta)

    def build_norm(self, spec: ArchSpec, size: int, dtype: torch.dtype) -> nn.Module:
        return ZeroCenteredRMSNorm(size, spec.rms_norm_eps, dtype=dtype)

    def build_layer(
        self, spec: Qwen3NextSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """A `LinearAttentionDecoderLayer` for linear layers, else a `DecoderLayer` with
        `GatedAttention`."""
        mlp = self.build_mlp(spec, index, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] == LINEAR_ATTENTION:
            mixer = GatedDeltaNet(
                spec.hidden_size, spec.linear_num_key_heads, spec.linear_num_value_heads,
                spec.linear_key_head_dim, spec.linear_value_head_dim,
                spec.linear_conv_kernel_dim, spec.rms_norm_eps, dtype,
                split_projections=self.split_linear_projections,
            )  # fmt: skip
            return LinearAttentionDecoderLayer(mixer, mlp, *norms)
        return DecoderLayer(GatedAttention(spec, dtype, rotary), mlp, *norms)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """The text model of Qwen3.5-MoE (transformers `Qwen3_5MoeForCausalLM`, config
    `model_type` "qwen3_5_moe_text"): Qwen3-Next's layers, except that every layer is MoE, the
    top-k weights are always renormalised, and the linear layers' q|k|v, z, b and a come from
    four plain projections. Its interleaved multimodal rope (`mrope_section`) gives text
    tokens, whose three position streams are equal, the plain partial rope.
    """

    card = FamilyCard(
        "Qwen3.5-MoE (text)", ("Qwen/Qwen3.5-397B-A17B",),
        "Gated DeltaNet + gated GQA (q/k norm, partial rotary)", cache=("full", "state"),
        speculation=(),
    )

    model_types = ("qwen3_5_moe_text",)
    split_linear_projections = True

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Qwen3-Next's fields with every layer MoE and `norm_topk_prob` true (the router
        renormalises unconditionally).

        Raises:
            ValueError: a required field missing (named), a malformed layer_types.
        """
        fields = super().shape_fields(
            {**cfg, "mlp_only_layers": [], "decoder_sparse_step": 1}
        )
        return {**fields, "norm_topk_prob": True}
