"""Llama 4 text model (Meta, "The Llama 4 herd", 2025, Scout 17B-16E / Maverick 17B-128E;
HF `Llama4ForCausalLM`, model_type "llama4_text", transformers `models/llama4/modeling_llama4.py`).

A decoder-only MoE transformer that differs from the Llama family (`layers/decoder.py`) in:
- iRoPE: most layers are RoPE layers of *chunked local attention* (`attention_chunk_size` C,
  `layer_types` "chunked_attention"): a query at position p sees only keys [floor(p / C) * C,
  p]; every `no_rope_layer_interval`-th layer (`no_rope_layers[i] == 0`) is a NoPE layer
  (no rotary embedding) of full causal attention;
- the rope rotates complex pairs (x0, x1), (x2, x3), ... (`apply_rotary_emb`'s
  `view_as_complex`: the interleaved `RotaryEmbedding`), and RoPE layers then L2-normalise q
  and k per head without a weight (`Llama4TextL2Norm`, `use_qk_norm`);
- NoPE layers scale q by the attention temperature 1 + attn_scale * log1p(floor((p + 1) /
  floor_scale)) at position p (`attn_temperature_tuning`; arXiv:2501.19399);
- MoE every `interleave_moe_layer_step`-th layer (or `moe_layers`), dense SwiGLU MLPs of width
  `intermediate_size_mlp` between; the router takes the top-k logits and weights them by
  sigmoid, with no renormalisation (`Llama4Router`: the grouped sigmoid router with one
  group), the weight multiplies the expert's *input* (`FusedMoE(apply_router_weight_on_input)`),
  and a shared expert of width `intermediate_size` is added (`Llama4TextMoe`).

KV cache: NoPE layers form a full-attention group, chunked layers a chunked-local group
(`kv_cache.spec.ChunkedLocalAttentionSpec`) whose blocks before the current chunk go back to
the pool, and whose attention runs per chunk as virtual requests over the paged cache
(`layers/chunked_attention.py`). A cache kind rather than a mask: a mask over the whole
context would keep every block of 3 layers in 4 and cost each query all the keys before its
chunk, where the kind frees them (Scout's 8192-token chunks at a 10M context) and every paged
kernel (native, Triton) runs the chunks as plain causal attention. Prefix caching applies: a
cached prefix needs, in the chunked group, only the blocks of the chunk its end falls in.
`attention_chunk_size` must be a multiple of the KV block size (startup refuses it otherwise).

Checkpoint names (`model.layers.{i}.` + ...): `self_attn.{q,k,v,o}_proj`,
`feed_forward.router.weight` [E, H], `feed_forward.experts.gate_up_proj` [E, H, 2I] (gate
columns then up columns) and `feed_forward.experts.down_proj` [E, I, H], stored [E, in, out]
and transposed into w13 / w2; `feed_forward.shared_expert.{gate,up,down}_proj`; dense layers'
`feed_forward.{gate,up,down}_proj`; `input_layernorm`, `post_attention_layernorm`. Meta's
releases are `Llama4ForConditionalGeneration` checkpoints (the text model's config under
`text_config`, its weights under `language_model.`, beside the vision tower): they serve here
once their text model is extracted as a `Llama4ForCausalLM` checkpoint (the engine does not
read nested multimodal configs).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, num_experts_of, required_int
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import (
    Llama3Scaling,
    RotaryEmbedding,
    rope_with_llama3_of,
)
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

#: `Llama4TextConfig` defaults.
DEFAULT_NO_ROPE_INTERVAL = 4
DEFAULT_CHUNK = 8192
DEFAULT_FLOOR_SCALE = 8192
DEFAULT_ATTN_SCALE = 0.1


@dataclasses.dataclass(frozen=True)
class Llama4Spec(ArchSpec):
    """`ArchSpec` plus Llama 4's attention extras.

    Attributes:
        rope_layers: per layer, whether it applies the rotary embedding (`no_rope_layers`).
        l2_qk_norm: RoPE layers L2-normalise q and k after the rope (`use_qk_norm`).
        temperature: NoPE layers scale q by the attention temperature
            (`attn_temperature_tuning`), of `floor_scale` (tokens) and `attn_scale`.
        llama3: Llama 3 RoPE scaling (Scout's `rope_parameters` rope_type "llama3"), or None.
    """

    rope_layers: tuple[bool, ...] = ()
    l2_qk_norm: bool = True
    temperature: bool = True
    floor_scale: float = DEFAULT_FLOOR_SCALE
    attn_scale: float = DEFAULT_ATTN_SCALE
    llama3: Llama3Scaling | None = None


def llama4_moe_layers(cfg: dict) -> tuple[int, ...]:
    """`moe_layers`, else every `interleave_moe_layer_step`-th layer from step - 1
    (`Llama4TextConfig`)."""
    layers = required_int(cfg, "num_hidden_layers")
    if cfg.get("moe_layers") is not None:
        return tuple(int(i) for i in cfg["moe_layers"])
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    return tuple(range(step - 1, layers, step))


def llama4_attention_fields(cfg: dict) -> dict:
    """`layer_types` ("chunked_attention" on RoPE layers when `attention_chunk_size` is set,
    else "full_attention", as `Llama4TextConfig`) and the chunk size.

    Raises:
        ValueError: a `layer_types` entry other than the two, or of the wrong length; chunked
            layers without an attention_chunk_size >= 1.
    """
    layers = required_int(cfg, "num_hidden_layers")
    chunk = cfg.get("attention_chunk_size", DEFAULT_CHUNK)
    types = cfg.get("layer_types") or [
        CHUNKED_LOCAL_ATTENTION if rope and chunk is not None else FULL_ATTENTION
        for rope in rope_layers_of(cfg)
    ]
    if len(types) != layers or not set(types) <= {CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION}:
        raise ValueError(
            f"config.json: layer_types {types} must give 'chunked_attention' or "
            f"'full_attention' for each of the {layers} layers"
        )
    chunked = CHUNKED_LOCAL_ATTENTION in types
    if chunked and (chunk is None or int(chunk) < 1):
        raise ValueError(f"config.json: attention_chunk_size {chunk!r} must be >= 1 token")
    return dict(layer_types=tuple(types), attention_chunk_size=int(chunk) if chunked else None)


def rope_layers_of(cfg: dict) -> tuple[bool, ...]:
    """Per layer, whether it is a RoPE layer: `no_rope_layers[i]` (1: RoPE), default every
    `no_rope_layer_interval`-th layer NoPE."""
    layers = required_int(cfg, "num_hidden_layers")
    flags = cfg.get("no_rope_layers") or [
        int((i + 1) % int(cfg.get("no_rope_layer_interval") or DEFAULT_NO_ROPE_INTERVAL) != 0)
        for i in range(layers)
    ]
    return tuple(bool(f) for f in flags[:layers])


class RopeL2Norm(nn.Module):
    """A RoPE layer's position step: the rope, then q and k normalised per head to unit RMS
    (x * rsqrt(mean(x^2) + eps) in float32, rounded back; `Llama4TextL2Norm`, no weight).

    Args:
        rope: the shared interleaved `RotaryEmbedding`; eps: `rms_norm_eps`.
    """

    def __init__(self, rope: nn.Module, eps: float) -> None:
        super().__init__()
        self.rope, self.eps = rope, eps

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] int64, q [T, Hq, D], k [T, Hkv, D] -> (q, k), same shapes/dtypes."""
        q, k = self.rope(positions, q, k)
        return self._l2(q), self._l2(k)

    def _l2(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class AttentionTemperature(nn.Module):
    """A NoPE layer's position step: no rope; q times 1 + attn_scale * log1p(floor((p + 1) /
    floor_scale)) at position p (float32, rounded back), k unchanged (Llama 4's temperature
    tuning).
    """

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] int64, q [T, Hq, D], k [T, Hkv, D] -> (q, k), same shapes/dtypes."""
        floor = torch.floor((positions.float() + 1.0) / self.floor_scale)
        scale = torch.log1p(floor) * self.attn_scale + 1.0
        return (q * scale[:, None, None]).to(q.dtype), k


class Llama4ForCausalLM(MoeCausalLM):
    """Llama 4's text model on the engine's layers (module docstring)."""

    card = FamilyCard(
        "Llama 4 (text)",
        ("meta-llama/Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Maverick-17B-128E"),
        "GQA, chunked local (RoPE, L2 q/k norm) + NoPE full layers (the text model: Meta's "
        "multimodal releases need it extracted)", cache=("full", "chunked"),
        native_4bit=(),
    )

    spec_class = Llama4Spec
    model_types = ("llama4_text",)
    weight_mapping = WeightMapping(
        renames=(
            (".feed_forward.router.", ".mlp.gate."),
            (".feed_forward.shared_expert.", ".mlp.shared_experts."),
            (".feed_forward.", ".mlp."),
        ),
        experts=ExpertMapping(fused_in_out=True),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Experts `num_local_experts` of width `intermediate_size` on `llama4_moe_layers`,
        a shared expert of that width, dense MLPs of `intermediate_size_mlp`; chunked and full
        layers (`llama4_attention_fields`); no renormalisation.

        Raises:
            ValueError: a required field missing, a malformed layer_types / chunk size.
        """
        moe_layers = llama4_moe_layers(cfg)
        dense = len(moe_layers) < required_int(cfg, "num_hidden_layers")
        return cls.moe_shape(
            cfg,
            moe_layers=moe_layers if num_experts_of(cfg) else (),
            intermediate_size=int(cfg.get("intermediate_size_mlp") or 0) if dense else 0,
            shared_expert_intermediate_size=required_int(cfg, "intermediate_size"),
            norm_topk_prob=False,
            **llama4_attention_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta (with Llama 3 scaling), the RoPE layers, the L2 q/k norm
        and the temperature.

        Raises:
            StartupError: a rope_type other than default or llama3; ValueError: hidden_act
                other than silu.
        """
        cfg = hf_config.to_dict()
        check_hidden_act(cfg, cls.__name__)
        theta, llama3 = rope_with_llama3_of(hf_config)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            llama3=llama3,
            rope_layers=rope_layers_of(cfg),
            l2_qk_norm=bool(cfg.get("use_qk_norm", True)),
            temperature=bool(cfg.get("attn_temperature_tuning", True)),
            floor_scale=float(cfg.get("floor_scale") or DEFAULT_FLOOR_SCALE),
            attn_scale=float(cfg.get("attn_scale", DEFAULT_ATTN_SCALE)),
        )

    def build_rotary(self, spec: Llama4Spec, max_position: int) -> nn.Module:
        """The complex-pair rope (`apply_rotary_emb`): the interleaved `RotaryEmbedding`, with
        Llama 3 scaling where configured."""
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, interleaved=True,
                               llama3=spec.llama3)

    def build_attention(
        self, spec: Llama4Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """RoPE layers: the rope then the L2 norm (when `use_qk_norm`); NoPE layers: the
        temperature (when `attn_temperature_tuning`, else nothing); chunked local attention
        where `layer_types` says."""
        if spec.rope_layers[index]:
            position = RopeL2Norm(rotary, spec.rms_norm_eps) if spec.l2_qk_norm else rotary
        elif spec.temperature:
            position = AttentionTemperature(spec.floor_scale, spec.attn_scale)
        else:
            position = None  # NoPE
        chunked = spec.layer_types[index] == CHUNKED_LOCAL_ATTENTION
        return Attention(
            spec, dtype, position, qk_norm=False,
            attention_chunk_size=spec.attention_chunk_size if chunked else None,
        )

    def build_mlp(self, spec: Llama4Spec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP of `intermediate_size_mlp` off `moe_layers`; else top-k sigmoid
        routing (the grouped router with one group, in the model dtype as `Llama4Router`),
        the weight on the experts' input, the shared expert."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, 1, 1, False, 1.0,
            correction_bias=False, dtype=dtype,
        )
        shared = SharedExperts(spec.hidden_size, spec.shared_expert_intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            False, dtype, router=router, shared_experts=shared,
            apply_router_weight_on_input=True,
        )
