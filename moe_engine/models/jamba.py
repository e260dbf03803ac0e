"""Jamba (AI21, Lieber et al. 2024, "Jamba: A Hybrid Transformer-Mamba Language Model",
arXiv:2403.19887; HF `JambaForCausalLM`, transformers 5.24 `modeling_jamba.py`).

A hybrid decoder: layer i mixes tokens with attention when i % `attn_layer_period` ==
`attn_layer_offset`, else with a Mamba-1 layer (`layers/mamba.MambaMixer`: the selective
scan, with Jamba's RMSNorms on dt, B and C); its feed-forward is a sparse MoE block when
i % `expert_layer_period` == `expert_layer_offset`, else a dense SwiGLU MLP of the same width
(`intermediate_size`). It differs from the Llama-style decoder in:
- Mamba layers keep a fixed per-request state instead of a KV cache (`kv_cache.state`), so
  prefix caching and speculative decoding are refused at startup
  (`build.check_linear_attention`);
- attention has no position embedding (NoPE: the Mamba layers carry the order);
- routing is softmax then top-k, the k weights left unnormalised (Mixtral renormalises).

Checkpoint names: `model.layers.{i}.mamba.*` (`MambaMixer`) or `.self_attn.{q,k,v,o}_proj`,
`.feed_forward.{gate,up,down}_proj` (dense) or `.feed_forward.router.weight` and
`.feed_forward.experts.{e}.{gate,up,down}_proj`, `.input_layernorm`, `.pre_ff_layernorm`;
the final norm `model.final_layernorm`. KV cache: one full-attention group of the attention
layers; the Mamba layers' state slots beside it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.hybrid import HybridDecoderLayer
from moe_engine.models.layers.mamba import MambaMixer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `JambaConfig` defaults of the layout and the Mamba layers.
DEFAULTS = dict(attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                expert_layer_offset=1, num_experts=16, mamba_d_state=16, mamba_d_conv=4,
                mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)


@dataclasses.dataclass(frozen=True)
class JambaSpec(ArchSpec):
    """`ArchSpec` plus the Mamba-1 sizes (`mamba_sizes`)."""

    mamba: tuple[tuple[str, object], ...] = ()


def _field(cfg: dict, key: str):
    """config.json's `key`, or `JambaConfig`'s default when absent or null."""
    return DEFAULTS[key] if cfg.get(key) is None else cfg[key]


def mamba_sizes(cfg: dict) -> dict:
    """The Mamba-1 layer sizes of a Jamba config.json (`mamba_dt_rank` "auto": ceil(H / 16))."""
    hidden = required_int(cfg, "hidden_size")
    rank = cfg.get("mamba_dt_rank", "auto")
    return dict(intermediate_size=int(_field(cfg, "mamba_expand")) * hidden,
                state_size=int(_field(cfg, "mamba_d_state")),
                conv_kernel=int(_field(cfg, "mamba_d_conv")),
                dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
                proj_bias=bool(_field(cfg, "mamba_proj_bias")),
                conv_bias=bool(_field(cfg, "mamba_conv_bias")))


def periodic(cfg: dict, period_key: str, offset_key: str) -> tuple[int, ...]:
    """The layers i with i % cfg[period_key] == cfg[offset_key].

    Raises:
        ValueError: an offset not below its period (named)."""
    period, offset = int(_field(cfg, period_key)), int(_field(cfg, offset_key))
    if not 0 <= offset < period:
        raise ValueError(f"config.json: {offset_key} {offset} must be in [0, {period_key} "
                         f"{period})")
    return tuple(i for i in range(required_int(cfg, "num_hidden_layers")) if i % period == offset)


class JambaForCausalLM(MoeCausalLM):
    """Jamba on the engine's layers (module docstring)."""

    model_types = ("jamba",)
    spec_class = JambaSpec
    weight_mapping = WeightMapping(renames=(
        (".feed_forward.router.", ".feed_forward.gate."),
        ("model.final_layernorm.", "model.norm."),
    ))
    card = FamilyCard(
        "Jamba", ("ai21labs/AI21-Jamba-Mini-1.5", "ai21labs/AI21-Jamba-Large-1.5"),
        "Mamba-1 + GQA (NoPE), MoE every expert_layer_period layers",
        cache=("full", "state"), native_4bit=(), speculation=(),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def checkpoint_expert_name(cls, layer: int, expert: int, projection: str) -> str:
        """"model.layers.{layer}.feed_forward.experts.{expert}.{gate,up,down}_proj"."""
        name = cls.weight_mapping.experts.name_of(projection)
        return f"model.layers.{layer}.feed_forward.experts.{expert}.{name}"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Attention and MoE layers by their periods; dense MLPs of `intermediate_size`
        elsewhere; the Mamba-1 state and parameter counts.

        Raises:
            ValueError: a required field missing (named), an offset not below its period.
        """
        layers = required_int(cfg, "num_hidden_layers")
        attention = set(periodic(cfg, "attn_layer_period", "attn_layer_offset"))
        experts = int(_field(cfg, "num_experts"))
        moe = periodic(cfg, "expert_layer_period", "expert_layer_offset") if experts > 1 else ()
        sizes = mamba_sizes(cfg)
        fields = cls.moe_shape(
            {**cfg, "num_experts": experts},
            moe_layers=moe,
            norm_topk_prob=False,
            layer_types=tuple(FULL_ATTENTION if i in attention else LINEAR_ATTENTION
                              for i in range(layers)),
            linear_mixer="Mamba",
            linear_state=MambaMixer.state_shapes(
                sizes["intermediate_size"], sizes["state_size"], sizes["conv_kernel"]),
            linear_mixer_params=MambaMixer.num_params(required_int(cfg, "hidden_size"), **sizes,
                                                      inner_norms=True),
        )
        # dense layers have the experts' width (moe_shape zeroes it for an experts field)
        dense = layers - len(moe)
        return {**fields, "intermediate_size": int(cfg["intermediate_size"]) if dense else 0}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """Norm epsilon and the Mamba sizes (no rope).

        Raises:
            ValueError: hidden_act other than silu.
        """
        cfg = hf_config.to_dict()
        check_hidden_act(cfg, cls.__name__)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, mamba=tuple(mamba_sizes(cfg).items()))

    def build_rotary(self, spec: JambaSpec, max_position: int) -> None:
        """None: no position embedding (NoPE, `Attention(rotary=None)`)."""
        return None

    def build_layer(self, spec: JambaSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """A `HybridDecoderLayer`: Mamba-1 or attention, then MoE or a dense MLP."""
        if spec.layer_types[index] == LINEAR_ATTENTION:
            m = dict(spec.mamba)
            name, mixer = "mamba", MambaMixer(
                spec.hidden_size, m["intermediate_size"], m["state_size"], m["conv_kernel"],
                m["dt_rank"], dtype, proj_bias=m["proj_bias"], conv_bias=m["conv_bias"],
                inner_norm_eps=spec.rms_norm_eps,
            )  # fmt: skip
        else:
            name, mixer = "self_attn", Attention(spec, dtype, rotary)
        if index in spec.moe_layers:
            ffn = FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size,
                           spec.moe_intermediate_size, False, dtype)
        else:
            ffn = DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        norm = self.build_norm
        return HybridDecoderLayer(name, mixer, "feed_forward", ffn,
                                  norm(spec, spec.hidden_size, dtype), "pre_ff_layernorm",
                                  norm(spec, spec.hidden_size, dtype))
