"""MiniMax-Text-01 (MiniMax, "MiniMax-01: Scaling Foundation Models with Lightning
Attention", arXiv:2501.08313; HF `MiniMaxForCausalLM`, transformers 5.24
`modeling_minimax.py`).

A hybrid decoder: `layer_types` "linear_attention" layers are lightning attention
(`layers/lightning_attention.LightningAttention`: a per-head decayed linear attention, block
by block in prefill), "full_attention" layers softmax GQA attention with full RoPE (the
original config's `attn_type_list`: 0 linear, 1 softmax). It differs from Mixtral in:
- linear layers keep a fixed per-request state ([H, D, D] per layer, no conv part:
  `kv_cache.state`) instead of a KV cache, so prefix caching and speculative decoding are
  refused at startup (`build.check_linear_attention`);
- the residual stream is scaled and post-normed (`ScaledResidualLayer`): x =
  input_layernorm(h); h = alpha_a x + beta_a attn(x), with (alpha_a, beta_a) the
  `linear_attn_*_factor`s or `full_attn_*_factor`s by the layer's type; x =
  post_attention_layernorm(h); out = alpha_m x + beta_m mlp(x) (`mlp_*_factor`s).
MoE: every layer, softmax top-k renormalised (Mixtral's), experts of width
`intermediate_size`.

Checkpoint names: Mixtral's (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`
or the fused `mlp.experts.gate_up_proj` / `down_proj`), `self_attn.{q,k,v,o}_proj` in
softmax layers, `self_attn.{qkv_proj, output_gate, out_proj, norm}` in lightning layers (their
`slope_rate` / `*_decay` buffers are derived, not read). KV cache: one full-attention group of
the softmax layers; the lightning layers' state slots beside it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe, required_int
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.lightning_attention import DERIVED_BUFFERS, LightningAttention
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: `MiniMaxConfig.block_size`'s default (tokens per lightning-attention prefill block).
DEFAULT_BLOCK_SIZE = 256


@dataclasses.dataclass(frozen=True)
class MiniMaxSpec(ArchSpec):
    """`ArchSpec` plus the lightning prefill's block and the residual scales ((alpha, beta):
    the residual's and the branch's factors)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    linear_attn_scales: tuple[float, float] = (1.0, 1.0)
    full_attn_scales: tuple[float, float] = (1.0, 1.0)
    mlp_scales: tuple[float, float] = (1.0, 1.0)


def minimax_layer_types(cfg: dict) -> tuple[str, ...]:
    """`layer_types`, else `attn_type_list` (0 linear, 1 softmax), else transformers' default
    (even layers softmax, odd layers linear).

    Raises:
        ValueError: a list of the wrong length or with an unknown entry, or no softmax layer.
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if not types and cfg.get("attn_type_list") is not None:
        types = [FULL_ATTENTION if t == 1 else LINEAR_ATTENTION if t == 0 else str(t)
                 for t in cfg["attn_type_list"]]
    types = types or [FULL_ATTENTION if (i + 1) % 2 else LINEAR_ATTENTION for i in range(layers)]
    if len(types) != layers or not set(types) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"config.json: layer_types {types} must give one of "
                         f"'linear_attention', 'full_attention' for each of the {layers} layers")
    if FULL_ATTENTION not in types:
        raise ValueError("config.json: layer_types has no full_attention layer")
    return tuple(types)


class ScaledResidualLayer(nn.Module):
    """MiniMax's decoder layer (transformers `MiniMaxDecoderLayer`; module docstring): the
    residual is the normed input, each branch's sum scaled by (alpha, beta).

    Args:
        self_attn: `Attention` (softmax layers, called with positions and the KV cache) or
            `LightningAttention` (linear layers, called with the state); mlp: the MoE block;
        input_layernorm, post_attention_layernorm: the two norms;
        attn_scales, mlp_scales: (alpha, beta) of the two residual sums.
    Never a native decode step (`decode_misfit` says why).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, attn_scales: tuple[float, float],
                 mlp_scales: tuple[float, float]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.attn_scales, self.mlp_scales = attn_scales, mlp_scales
        self.linear = isinstance(self_attn, LightningAttention)
        self.timer = None
        self.decode_kernel = None
        self.decode_misfit = "a MiniMax layer (post-norm residuals scaled by alpha/beta)"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache, step: object = None) -> torch.Tensor:
        """h: [T, H] -> [T, H]; cache: the KV pair (softmax) or the state slots (linear)."""
        x = self.input_layernorm(h)
        if self.timer is None:
            a = self._attend(x, positions, meta, cache)
        else:
            with self.timer.phase("attention"):
                a = self._attend(x, positions, meta, cache)
        alpha, beta = self.attn_scales
        x = self.post_attention_layernorm(x * alpha + a * beta)
        alpha, beta = self.mlp_scales
        return x * alpha + self.mlp(x) * beta

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache) -> torch.Tensor:
        if self.linear:
            return self.self_attn(x, meta, cache)
        return self.self_attn(x, positions, meta, cache)

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, meta: AttentionMetadata, cache,
                         step: object = None) -> tuple[torch.Tensor, None]:
        """`DecoderLayer.forward_residual`'s call on the stream h + residual (residual None:
        h alone): returns (the new stream, None)."""
        h = h if residual is None else h + residual
        return self.forward(h, positions, meta, cache, step), None


class MiniMaxForCausalLM(MoeCausalLM):
    """MiniMax-Text-01 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "MiniMax-Text-01", ("MiniMaxAI/MiniMax-Text-01-hf",),
        "lightning attention + GQA, alpha/beta-scaled post-norm residuals",
        cache=("full", "state"), speculation=(),
    )

    model_types = ("minimax",)
    spec_class = MiniMaxSpec
    weight_mapping = WeightMapping(
        renames=((".block_sparse_moe.", ".mlp."),),
        experts=ExpertMapping(gate="w1", up="w3", down="w2"),
        skipped=(DERIVED_BUFFERS,),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`, renormalised top-k; the layer types;
        the lightning layers' state [H, D, D] and parameters.

        Raises:
            ValueError: a required field missing (named), a malformed layer_types, a
                sliding_window (not implemented for MiniMax).
        """
        if cfg.get("sliding_window"):
            raise ValueError(f"config.json: sliding_window {cfg['sliding_window']}: "
                             "sliding-window MiniMax is not supported (null: full attention)")
        fields = cls.moe_shape(cfg, moe_layers=every_layer_moe(cfg), norm_topk_prob=True)
        hidden, heads, d = fields["hidden_size"], fields["num_heads"], fields["head_dim"]
        width = heads * d
        return {
            **fields,
            "layer_types": minimax_layer_types(cfg),
            "linear_mixer": "lightning attention",
            "linear_state": (None, (heads, d, d)),
            "linear_mixer_params": 5 * hidden * width + width,
        }

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, the block size and the residual scales.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu, block_size below 1.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        block = int(getattr(hf_config, "block_size", DEFAULT_BLOCK_SIZE))
        if block < 1:
            raise ValueError(f"config.json: block_size {block} must be >= 1")

        def scales(name: str) -> tuple[float, float]:
            return (float(getattr(hf_config, f"{name}_alpha_factor", 1)),
                    float(getattr(hf_config, f"{name}_beta_factor", 1)))

        return {**super().spec_fields(hf_config), "block_size": block,
                "linear_attn_scales": scales("linear_attn"),
                "full_attn_scales": scales("full_attn"), "mlp_scales": scales("mlp")}

    def build_layer(
        self, spec: MiniMaxSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """A `ScaledResidualLayer` with lightning attention or softmax `Attention` by the
        layer's type, and Mixtral's MoE block."""
        mlp = FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size,
                       spec.moe_intermediate_size, True, dtype)
        norms = (self.build_norm(spec, spec.hidden_size, dtype),
                 self.build_norm(spec, spec.hidden_size, dtype))
        if spec.layer_types[index] == LINEAR_ATTENTION:
            attn = LightningAttention(spec.hidden_size, spec.num_heads, spec.head_dim, index,
                                      spec.num_layers, spec.block_size, dtype)
            return ScaledResidualLayer(attn, mlp, *norms, spec.linear_attn_scales,
                                       spec.mlp_scales)
        return ScaledResidualLayer(Attention(spec, dtype, rotary), mlp, *norms,
                                   spec.full_attn_scales, spec.mlp_scales)
