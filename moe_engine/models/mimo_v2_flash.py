"""MiMo-V2-Flash (Xiaomi, model card "XiaomiMiMo/MiMo-V2-Flash", 2025; HF
`MiMoV2FlashForCausalLM`, transformers `models/mimo_v2_flash/modeling_mimo_v2_flash.py`).

A decoder-only MoE transformer that differs from the Llama family (`layers/decoder.py`) in:
- attention per `layer_types` (default full on layer 0 and every 6th layer, sliding-window
  elsewhere; window `sliding_window`, or `sliding_window_size` + 1 as transformers reads it);
  sliding layers have 2 x `num_key_value_heads` KV heads and a learned sink per query head
  (`MiMoV2FlashAttention`), full layers `num_key_value_heads` and no sinks;
- q/k heads of `head_dim` (192) and value heads of `v_head_dim` (128), the values multiplied
  by `attention_value_scale`; no o_proj bias;
- a partial rotary embedding (the first int(head_dim * partial_rotary_factor) dims, rotate-half)
  with its own `rope_theta` per layer type (`rope_parameters` keyed by layer type);
- DeepSeek-V3's routing (sigmoid, `e_score_correction_bias` for the choice, group-limited
  top-k, renormalised, `routed_scaling_factor`; float32 router), no shared experts; dense
  layers where `mlp_layer_types` says "dense" (default layer 0).

KV cache: a full-attention group and a sliding-window group. The cache pages of all groups
share one shape (`kv_cache.spec`), [block_size, 2 x num_key_value_heads, head_dim] here: full
layers store each KV head twice (which keeps GQA's query-to-key map) and values are
zero-padded from v_head_dim to head_dim (`Attention(num_kv_heads=, v_head_dim=)`). That is
exact and runs the paged kernels unchanged, at the cost of (head_dim - v_head_dim) /
(2 head_dim) of the sliding layers' cache bytes and half of the full layers'. Prefix caching
as for gpt-oss.

Checkpoint names (`model.layers.{i}.` + ...; transformers' "mimo_v2_flash" conversion
mapping): `self_attn.{q,k,v,o}_proj`, `self_attn.attention_sink_bias` [num_heads] (the sinks);
`mlp.gate.weight` [E, H] and `mlp.gate.e_score_correction_bias` [E] (float32); per-expert
`mlp.experts.{e}.{gate,up,down}_proj` (or fused `gate_up_proj` / `down_proj`); dense layers'
`mlp.{gate,up,down}_proj`. The release's MTP layers (`model.mtp.*`) are not read
(`WeightMapping.skipped`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import PartialRotaryEmbedding
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `MiMoV2FlashConfig` defaults.
DEFAULT_SLIDING_WINDOW = 129
DEFAULT_HEAD_DIM = 192
DEFAULT_V_HEAD_DIM = 128
DEFAULT_VALUE_SCALE = 0.707
DEFAULT_PARTIAL_ROTARY = 0.334
DEFAULT_THETAS = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
KINDS = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class MiMoV2FlashSpec(ArchSpec):
    """`ArchSpec` plus MiMo-V2-Flash's per-layer-type attention and routing.

    Attributes:
        full_kv_heads: KV heads of full layers (`num_key_value_heads`; sliding layers have
            twice as many, the cache's `num_kv_heads`).
        value_head_dim: `v_head_dim`; value_scale: `attention_value_scale`.
        rotary: per layer type, (rope_theta, rotated dims).
        n_group, topk_group, routed_scaling_factor: the routing (`sigmoid_grouped_topk`).
    """

    full_kv_heads: int = 0
    value_head_dim: int = 0
    value_scale: float = 1.0
    rotary: tuple[tuple[str, float, int], ...] = ()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def mimo_layer_types(cfg: dict) -> tuple[str, ...]:
    """`layer_types`, default full on layer 0 and every layer i with (i + 1) % 6 == 0.

    Raises:
        ValueError: the wrong length or an entry other than the two kinds.
    """
    layers = required_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or [
        "full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
        for i in range(layers)
    ]
    if len(types) != layers or not set(types) <= set(KINDS):
        raise ValueError(f"config.json: layer_types {types} must give one of {KINDS} per layer")
    return tuple(types)


def mimo_sliding_window(cfg: dict) -> int:
    """`sliding_window_size` + 1 when set (transformers' reading), else `sliding_window`."""
    if cfg.get("sliding_window_size") is not None:
        return int(cfg["sliding_window_size"]) + 1
    return int(cfg.get("sliding_window") or DEFAULT_SLIDING_WINDOW)


class MiMoV2FlashForCausalLM(MoeCausalLM):
    """MiMo-V2-Flash on the engine's layers (module docstring)."""

    card = FamilyCard(
        "MiMo-V2-Flash", ("XiaomiMiMo/MiMo-V2-Flash",),
        "GQA (2x KV heads on sliding layers), sliding/full mix, sinks, v_head_dim < head_dim",
        cache=("full", "sliding"), native_4bit=(),
    )

    spec_class = MiMoV2FlashSpec
    model_types = ("mimo_v2_flash",)
    weight_mapping = WeightMapping(
        renames=((".self_attn.attention_sink_bias", ".self_attn.sinks"),),
        skipped=(r"^model\.mtp\.",),
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers where `mlp_layer_types` is "sparse" (default all but layer 0), experts
        `n_routed_experts` of `moe_intermediate_size`, dense width `intermediate_size`; the
        cache's KV heads 2 x num_key_value_heads of `head_dim` when a layer slides; sinks,
        a float32 router with a correction bias.

        Raises:
            ValueError: a required field missing, malformed layer_types / mlp_layer_types.
        """
        layers = required_int(cfg, "num_hidden_layers")
        mlp_types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if len(mlp_types) != layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise ValueError(f"config.json: mlp_layer_types {mlp_types} must give 'dense' or "
                             f"'sparse' for each of the {layers} layers")
        types = mimo_layer_types(cfg)
        sliding = "sliding_attention" in types
        kv_heads = int(cfg.get("num_key_value_heads") or required_int(cfg, "num_attention_heads"))
        return cls.moe_shape(
            cfg,
            moe_layers=tuple(i for i, t in enumerate(mlp_types) if t == "sparse"),
            num_kv_heads=kv_heads * (2 if sliding else 1),
            head_dim=int(cfg.get("head_dim") or DEFAULT_HEAD_DIM),
            o_proj_bias=False,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            attention_sinks=True,
            router_correction_bias=True,
            router_float32=True,
            layer_types=types,
            sliding_window=mimo_sliding_window(cfg) if sliding else None,
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, the per-type rotary, the value heads, the routing.

        Raises:
            ValueError: hidden_act not silu, the group limits (`check_sigmoid_group_limits`),
                a rope_type other than default (naming it).
        """
        cfg = hf_config.to_dict()
        check_hidden_act(cfg, cls.__name__)
        n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        check_sigmoid_group_limits(int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
                                   n_group, topk_group)
        head_dim = int(cfg.get("head_dim") or DEFAULT_HEAD_DIM)
        scale = cfg.get("attention_value_scale", DEFAULT_VALUE_SCALE)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            full_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            value_head_dim=int(cfg.get("v_head_dim") or DEFAULT_V_HEAD_DIM),
            value_scale=1.0 if scale is None else float(scale),
            rotary=_rotary_of(cfg.get("rope_parameters") or {}, head_dim),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )

    def build_rotary(self, spec: MiMoV2FlashSpec, max_position: int) -> nn.Module:
        """One partial rotary embedding per layer type (its theta and rotated dims)."""
        return nn.ModuleDict({
            kind: PartialRotaryEmbedding(spec.head_dim, dims, max_position, theta)
            for kind, theta, dims in spec.rotary
        })

    def build_attention(self, spec: MiMoV2FlashSpec, index: int, dtype: torch.dtype,
                        rotary: nn.Module) -> nn.Module:
        """Sliding layers: the window, sinks, the cache's KV heads; full layers: half of them
        (each stored twice); values of v_head_dim, scaled."""
        kind = spec.layer_types[index]
        sliding = kind == "sliding_attention"
        return Attention(
            spec, dtype, rotary[kind], spec.sliding_window if sliding else None, o_bias=False,
            sinks=sliding, num_kv_heads=spec.num_kv_heads if sliding else spec.full_kv_heads,
            v_head_dim=spec.value_head_dim, v_scale=spec.value_scale,
        )

    def build_mlp(self, spec: MiMoV2FlashSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """A dense MLP on "dense" layers; else DeepSeek-V3's routing, no shared experts."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.n_group, spec.topk_group,
            spec.norm_topk_prob, spec.routed_scaling_factor,
        )
        return FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size,
                        spec.moe_intermediate_size, spec.norm_topk_prob, dtype, router=router)


def _rotary_of(params: dict, head_dim: int) -> tuple[tuple[str, float, int], ...]:
    """(layer type, rope_theta, rotated dims) per type from `rope_parameters` keyed by layer
    type (defaults as `MiMoV2FlashConfig`: thetas 5e6 / 1e4, partial factor 0.334).

    Raises:
        ValueError: a rope_type other than default, an odd or empty rotated width.
    """
    out = []
    for kind in KINDS:
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_parameters[{kind!r}] rope_type "
                             f"{p['rope_type']!r} is not supported (supported: default)")
        dims = int(head_dim * float(p.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
        if dims < 2 or dims % 2:
            raise ValueError(f"config.json: rope_parameters[{kind!r}] rotates {dims} of "
                             f"head_dim {head_dim} dims; it must be even and >= 2")
        out.append((kind, float(p.get("rope_theta", DEFAULT_THETAS[kind])), dims))
    return tuple(out)
