"""Granite MoE (IBM, PowerMoE / Granite 3.0 MoE: Shen et al., "Power Scheduler", arXiv:2408.13359,
2024; HF `GraniteMoeForCausalLM`, transformers 5.24 `modeling_granitemoe.py`) and Granite MoE
with a shared expert (HF `GraniteMoeSharedForCausalLM`, `modeling_granitemoeshared.py`).

A Mixtral-style decoder (every layer an MoE block of `num_local_experts` experts of width
`intermediate_size`) that differs from the Llama-style one in four scalars:
- `embedding_multiplier` scales the token embeddings;
- `attention_multiplier` is the softmax scale (instead of head_dim ** -0.5);
- `residual_multiplier` scales the attention's and the MoE block's outputs before each
  residual add (`DecoderLayer(residual_multiplier=...)`);
- `logits_scaling` divides the logits;
and in its routing: top-k of the router logits, then softmax over those k (`topk_softmax`, as
gpt-oss). GraniteMoeShared adds a SwiGLU shared MLP of width `shared_intermediate_size` (0:
none), run on every token beside the routed experts and added to their output before the
residual multiplier. Biases on q/k/v/o when `attention_bias`.

Checkpoint names: the MoE block is `block_sparse_moe`, with all experts fused as
`input_linear.weight` [E, 2I, H] (gate rows, then up rows) and `output_linear.weight`
[E, H, I], the router `router.layer.weight` [E, H]; the shared MLP is `shared_mlp.input_linear`
[2I_s, H] (gate; up) and `shared_mlp.output_linear` [H, I_s]; transformers 5's own names
(`block_sparse_moe.router.weight`, `block_sparse_moe.experts.gate_up_proj` / `down_proj`)
load too. KV cache: one full-attention group of every layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, every_layer_moe
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class GraniteMoeSpec(ArchSpec):
    """`ArchSpec` plus Granite's attention scale and residual multiplier (the embedding and
    logit scalars are `ArchSpec`'s).

    Attributes:
        attention_multiplier: the softmax scale.
        residual_multiplier: scales each sublayer's output before its residual add.
    """

    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0


def _positive(hf_config, field: str) -> float:
    """`hf_config.<field>` (default 1.0) as a float.

    Raises:
        ValueError: a value <= 0, naming the field.
    """
    value = getattr(hf_config, field, None)
    value = 1.0 if value is None else float(value)
    if value <= 0:
        raise ValueError(f"config.json: {field} {value} must be > 0")
    return value


class GraniteMoeForCausalLM(MoeCausalLM):
    """Granite MoE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Granite MoE", ("ibm-granite/granite-3.1-3b-a800m-instruct", "ibm/PowerMoE-3b"),
        "GQA, embedding/attention/residual/logit multipliers", native_4bit=(),
    )

    spec_class = GraniteMoeSpec
    model_types = ("granitemoe",)
    # Released names first (their router name holds transformers 5's as a prefix);
    # `checkpoint_name` undoes them last first.
    weight_mapping = WeightMapping(
        renames=(
            (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
            (".block_sparse_moe.router.layer.", ".mlp.gate."),
            (".block_sparse_moe.router.", ".mlp.gate."),
            (".block_sparse_moe.experts.", ".mlp.experts."),
            (".shared_mlp.input_linear.", ".mlp.shared_experts.gate_up_proj."),
            (".shared_mlp.output_linear.", ".mlp.shared_experts.down_proj."),
        ),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE of width `intermediate_size`; q/k/v/o biases from `attention_bias`;
        a shared MLP of `shared_intermediate_size` (GraniteMoeShared; default 0: none).

        Raises:
            ValueError: a required field missing (named).
        """
        return cls.moe_shape(
            cfg,
            moe_layers=every_layer_moe(cfg),
            qk_norm=False,
            norm_topk_prob=False,
            shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size") or 0),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta and the four multipliers.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu, a multiplier <= 0 (named).
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            embedding_multiplier=_positive(hf_config, "embedding_multiplier"),
            logits_scaling=_positive(hf_config, "logits_scaling"),
            attention_multiplier=_positive(hf_config, "attention_multiplier"),
            residual_multiplier=_positive(hf_config, "residual_multiplier"),
        )

    def build_attention(
        self, spec: GraniteMoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """q/k/v/o biases from `attention_bias`; the softmax scale `attention_multiplier`."""
        return Attention(
            spec, dtype, rotary, o_bias=spec.attention_bias, scale=spec.attention_multiplier
        )

    def build_mlp(self, spec: GraniteMoeSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Top-k then softmax routing; the shared MLP (gate and up in one tensor) where the
        config has one."""
        width = spec.shared_expert_intermediate_size
        shared = None
        if width:
            shared = SharedExperts(spec.hidden_size, width, dtype, fused_gate_up=True)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            False, dtype, routing="topk_softmax", shared_experts=shared,
        )

    def build_layer(
        self, spec: GraniteMoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """The pre-norm layer with `residual_multiplier` on both sublayers' outputs."""
        norm = self.build_norm
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            residual_multiplier=spec.residual_multiplier,
        )


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with its shared MLP (`shared_intermediate_size`; module docstring)."""

    card = FamilyCard(
        "Granite MoE Shared", ("ibm-research/moe-7b-1b-active-shared-experts",),
        "GQA, embedding/attention/residual/logit multipliers, a shared MLP", native_4bit=(),
    )

    model_types = ("granitemoeshared",)
