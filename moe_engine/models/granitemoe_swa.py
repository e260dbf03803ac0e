"""GraniteMoE with sliding-window attention (IBM; HF `GraniteMoeSWAForCausalLM`, transformers
5.24 `modeling_granitemoe_swa.py`): Granite-4.0-H's file without the Mamba layers.

Every layer is attention, sliding where `layer_types` says (default all but every 4th layer,
window `sliding_window`), with a learned per-head sink in each softmax (`sinks`: gpt-oss's
extra denominator logit, which transformers applies as the output times sigmoid(lse - sink)),
a rope base per layer (`layer_rope_theta`, 0: NoPE), softmax scale `attention_multiplier`,
Granite's multipliers (embeddings, residuals, logits), and the routed experts (top-k then
softmax) plus an optional shared SwiGLU MLP (`shared_intermediate_size` 0: none).

Checkpoint names: transformers 5's (`block_sparse_moe.experts.gate_up_proj` / `down_proj`,
`block_sparse_moe.router.weight`, `self_attn.sinks`, `shared_mlp.input_linear` /
`output_linear`). KV cache: a full-attention and a sliding-window group; prefix caching
applies.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.granitemoehybrid import GraniteMoeHybridForCausalLM, GraniteMoeHybridSpec
from moe_engine.models.layers.hybrid import HybridDecoderLayer
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class GraniteMoeSWASpec(GraniteMoeHybridSpec):
    """`GraniteMoeHybridSpec` plus each layer's rope base (0: NoPE)."""

    layer_rope_theta: tuple[float, ...] = ()


class GraniteMoeSWAForCausalLM(GraniteMoeHybridForCausalLM):
    """GraniteMoE-SWA on the engine's layers (module docstring)."""

    model_types = ("granitemoe_swa",)
    spec_class = GraniteMoeSWASpec
    weight_mapping = WeightMapping(renames=(
        (".block_sparse_moe.router.", ".block_sparse_moe.gate."),
        (".shared_mlp.input_linear.", ".block_sparse_moe.shared_experts.gate_up_proj."),
        (".shared_mlp.output_linear.", ".block_sparse_moe.shared_experts.down_proj."),
    ))
    card = FamilyCard(
        "GraniteMoE-SWA", ("ibm-granite/granite-swash-3b-a600m",),
        "GQA with sinks, sliding/full mix, per-layer rope base or NoPE, Granite multipliers",
        cache=("full", "sliding"), native_4bit=(),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE (optional shared MLP), sinks, the sliding/full layer types.

        Raises:
            ValueError: a required field missing (named), a malformed layer_types, a window
                below 1 token.
        """
        layers = required_int(cfg, "num_hidden_layers")
        types = tuple(cfg.get("layer_types") or (
            FULL_ATTENTION if i % 4 == 0 else SLIDING_ATTENTION for i in range(layers)))
        if len(types) != layers or not set(types) <= {SLIDING_ATTENTION, FULL_ATTENTION}:
            raise ValueError(f"config.json: layer_types {list(types)} must give "
                             f"'sliding_attention' or 'full_attention' for each of {layers} "
                             "layers")
        window = int(cfg.get("sliding_window") or 128)
        if SLIDING_ATTENTION in types and window < 1:
            raise ValueError(f"config.json: sliding_window {window} is below 1 token")
        return cls.moe_shape(
            {**cfg, "num_local_experts": cfg.get("num_local_experts", 8)},
            moe_layers=tuple(range(layers)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size") or 0),
            layer_types=types,
            sliding_window=window if SLIDING_ATTENTION in types else None,
            attention_sinks=True,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """Norm epsilon, the rope bases per layer and the multipliers.

        Raises:
            ValueError: hidden_act other than silu; StartupError: a rope_type other than
                default.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        theta = rope_theta_of(hf_config)
        layers = hf_config.num_hidden_layers
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps, rope_theta=theta,
            layer_rope_theta=tuple(float(t) for t in (
                getattr(hf_config, "layer_rope_theta", None) or [theta] * layers)),
            embedding_multiplier=float(hf_config.embedding_multiplier),
            residual_multiplier=float(hf_config.residual_multiplier),
            attention_multiplier=float(hf_config.attention_multiplier),
            logits_scaling=float(hf_config.logits_scaling), use_rope=True,
        )  # fmt: skip

    def build_layer(self, spec: GraniteMoeSWASpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """A `HybridDecoderLayer`: attention with sinks (sliding or full, this layer's rope),
        then the experts (+ the shared MLP)."""
        theta = spec.layer_rope_theta[index]
        if not theta:
            rotary = None  # NoPE
        elif theta != spec.rope_theta:
            rotary = RotaryEmbedding(spec.head_dim, rotary.max_position, theta)
        sliding = spec.layer_types[index] == SLIDING_ATTENTION
        attn = Attention(spec, dtype, rotary, spec.sliding_window if sliding else None,
                         o_bias=spec.o_proj_bias, sinks=True, scale=spec.attention_multiplier)
        norm = self.build_norm
        return HybridDecoderLayer("self_attn", attn, "block_sparse_moe", self._moe(spec, dtype),
                                  norm(spec, spec.hidden_size, dtype),
                                  "post_attention_layernorm", norm(spec, spec.hidden_size, dtype),
                                  spec.residual_multiplier)
