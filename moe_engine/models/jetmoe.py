"""JetMoE (Shen et al., "JetMoE: Reaching Llama2 Performance with 0.1M Dollars",
arXiv:2404.07413, 2024; HF `JetMoeForCausalLM`, transformers 5.24 `modeling_jetmoe.py`).

A pre-norm decoder whose attention and MLP are both sparse:
- attention is a mixture of attention heads (`layers/mixture_of_attention.MixtureOfAttention`):
  each token's top-k query/output projection experts (of `num_local_experts`) over shared keys
  and values of `num_key_value_heads` heads of `kv_channels` dims, so num_attention_heads =
  num_key_value_heads * num_experts_per_tok; plus an output bias;
- the MLP is an MoE block of the same E and k with SwiGLU experts of width
  `intermediate_size`, plus an output bias (`FusedMoE(output_bias=True)`);
- both route by top-k of the router logits, then softmax over those k (`topk_softmax`);
- the layers' two RMSNorms keep transformers' default epsilon 1e-6 (`JetMoeRMSNorm(
  hidden_size)`); only the final norm reads `rms_norm_eps`.

Checkpoint names: `self_attention.experts.{input_linear,output_linear}.weight` ([E, Hkv D, H],
[E, H, Hkv D]), `self_attention.experts.router.layer.weight`, `self_attention.experts.bias`,
`self_attention.kv_proj.weight` [2 Hkv D, H] (k rows, then v); `mlp.input_linear.weight`
[E, 2I, H] (gate; up), `mlp.output_linear.weight` [E, H, I], `mlp.router.layer.weight`,
`mlp.bias`. KV cache: one full-attention group of Hkv heads of D dims per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import every_layer_moe, required_int
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.mixture_of_attention import MixtureOfAttention
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `JetMoeRMSNorm`'s default epsilon, which the decoder layers' norms keep.
LAYER_NORM_EPS = 1e-6


class JetMoeForCausalLM(MoeCausalLM):
    """JetMoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "JetMoE", ("jetmoe/jetmoe-8b", "jetmoe/jetmoe-8b-chat"),
        "mixture of attention heads (routed q/o projections, shared GQA keys/values)",
        native_4bit=(),
    )

    model_types = ("jetmoe",)
    weight_mapping = WeightMapping(
        renames=(
            (".self_attention.experts.input_linear.weight", ".self_attn.q_experts"),
            (".self_attention.experts.output_linear.weight", ".self_attn.o_experts"),
            (".self_attention.experts.router.layer.", ".self_attn.router."),
            (".self_attention.experts.bias", ".self_attn.o_bias"),
            (".self_attention.", ".self_attn."),
            (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
            (".mlp.router.layer.", ".mlp.gate."),
        ),
        stacked_params=(),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`; attention heads of `kv_channels`
        dims, num_key_value_heads * num_experts_per_tok query heads (as `JetMoeConfig`).

        Raises:
            ValueError: a required field missing (named).
        """
        kv_heads = required_int(cfg, "num_key_value_heads")
        top_k = required_int(cfg, "num_experts_per_tok")
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            num_heads=kv_heads * top_k,
            num_kv_heads=kv_heads,
            head_dim=required_int(cfg, "kv_channels"),
            norm_topk_prob=False,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps (the final norm's), rope_theta.

        Raises:
            StartupError: a rope_type other than default; ValueError: activation_function
                other than silu.
        """
        act = getattr(hf_config, "activation_function", "silu")
        if act != "silu":
            raise ValueError(
                f"config.json: activation_function {act!r} is not supported for {cls.__name__} "
                "(the experts compute SwiGLU with silu; supported: 'silu')"
            )
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta_of(hf_config))

    def build_attention(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """The mixture of attention heads."""
        return MixtureOfAttention(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.num_kv_heads, spec.head_dim,
            rotary, dtype,
        )

    def build_mlp(self, spec: ArchSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Top-k then softmax routing, SwiGLU experts, an output bias."""
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            False, dtype, routing="topk_softmax", output_bias=True,
        )

    def build_layer(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """The pre-norm layer, its two norms of epsilon 1e-6."""
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            RMSNorm(spec.hidden_size, LAYER_NORM_EPS, dtype=dtype),
            RMSNorm(spec.hidden_size, LAYER_NORM_EPS, dtype=dtype),
        )
