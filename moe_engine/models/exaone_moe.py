"""K-EXAONE (LG AI Research, "K-EXAONE Technical Report", 2026; HF `ExaoneMoeForCausalLM`,
transformers 5.24 `modeling_exaone_moe.py`).

EXAONE-4's attention over DeepSeek-V3's MoE block (`dots1.Dots1ForCausalLM` does the rest).
It differs from the Llama-style decoder in:
- per-head q/k RMSNorm before the rope; no attention biases;
- a local/global mix: `layer_types`, by default every `sliding_window_pattern`-th layer global
  and the others sliding over `sliding_window` tokens (`ExaoneMoeConfig.__post_init__`); with
  a `sliding_window` set, the global layers use no position embedding at all (NoPE; the rope
  is only applied when `sliding_window` is None or the layer slides);
- `mlp_layer_types` ("dense" / "sparse"; default the first `first_k_dense_replace` = 1 dense):
  dense SwiGLU MLPs of `intermediate_size`, or MoE blocks routed as DeepSeek-V3 (sigmoid
  scores, `e_score_correction_bias` for the choice only, group-limited top-k, renormalised
  when `norm_topk_prob`, times `routed_scaling_factor`; float32 router) over `num_experts`
  experts, plus `num_shared_experts` ungated shared experts of width `moe_intermediate_size *
  num_shared_experts`.

Checkpoint names are the base mapping's (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`mlp.gate.weight`, `mlp.experts.*`, `mlp.shared_experts.*`), except the correction bias: the
hub's `mlp.e_score_correction_bias` -> `mlp.gate.e_score_correction_bias` (transformers'
`conversion_mapping`; that name loads as it is too). Released checkpoints'
multi-token-prediction tensors (`mtp.*`, ignored by transformers) are not read by this engine
either. KV cache: a full-attention group and a sliding-window group.
"""

from __future__ import annotations

from moe_engine.kv_cache.spec import FULL_ATTENTION, SLIDING_ATTENTION
from moe_engine.models.config_fields import check_hidden_act, required_int
from moe_engine.models.dots1 import Dots1ForCausalLM, shared_width, window_layer_fields
from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `ExaoneMoeConfig` defaults.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_SLIDING_WINDOW_PATTERN = 4


def exaone_layer_types(cfg: dict) -> list[str]:
    """config.json's `layer_types`, or every `sliding_window_pattern`-th layer full and the
    others sliding (all full without a window), as `ExaoneMoeConfig.__post_init__`.

    Raises:
        ValueError: a `sliding_window_pattern` that is not a positive integer.
    """
    layers = required_int(cfg, "num_hidden_layers")
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW) is None:
        return [FULL_ATTENTION] * layers
    pattern = cfg.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"config.json: sliding_window_pattern {pattern!r} is not supported without "
            "layer_types (supported: a positive integer period)"
        )
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]


def mlp_layer_types_moe_layers(cfg: dict, default_first_dense: int) -> tuple[int, ...]:
    """The MoE layers of a config.json with `mlp_layer_types` ("dense" / "sparse" per layer),
    or, without it, layers from `first_k_dense_replace` (default `default_first_dense`) on;
    () without experts.

    Raises:
        ValueError: an `mlp_layer_types` of the wrong length or with an unknown entry.
    """
    layers = required_int(cfg, "num_hidden_layers")
    first = int(cfg.get("first_k_dense_replace", default_first_dense) or 0)
    types = cfg.get("mlp_layer_types") or ["dense" if i < first else "sparse"
                                           for i in range(layers)]
    if len(types) != layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(
            f"config.json: mlp_layer_types {types} must give 'dense' or 'sparse' for each of "
            f"the {layers} layers"
        )
    if not (cfg.get("num_experts") or cfg.get("n_routed_experts")):
        return ()
    return tuple(i for i, t in enumerate(types) if t == "sparse")


class ExaoneMoeForCausalLM(Dots1ForCausalLM):
    """K-EXAONE on the engine's layers (module docstring)."""

    card = FamilyCard(
        "K-EXAONE (EXAONE-MoE)", ("LGAI-EXAONE/K-EXAONE-236B-A23B",),
        "GQA, q/k norm, sliding RoPE / global NoPE mix", cache=("full", "sliding"),
    )

    model_types = ("exaone_moe",)
    # transformers' `conversion_mapping` for exaone_moe: the hub's block-level bias name
    weight_mapping = WeightMapping(
        renames=((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers by `mlp_layer_types`; q/k norm, no attention biases; shared experts of
        `num_shared_experts` (default 1); `norm_topk_prob` default true; `layer_types` as
        `ExaoneMoeConfig` derives them.

        Raises:
            ValueError: a required field missing (named), malformed layer types or window.
        """
        types = exaone_layer_types(cfg)
        return cls.moe_shape(
            cfg,
            moe_layers=mlp_layer_types_moe_layers(cfg, 1),
            attention_bias=False,
            o_proj_bias=False,
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=shared_width(cfg, "num_shared_experts", 1),
            router_correction_bias=True,
            router_float32=True,
            **window_layer_fields(cfg, types, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta, the group limits and scaling of the `num_experts`
        experts, and the NoPE layers: the global ones when `sliding_window` is set.

        Raises:
            StartupError: a rope_type other than default; ValueError: hidden_act other than
                silu, group limits `check_sigmoid_group_limits` refuses.
        """
        check_hidden_act(hf_config.to_dict(), cls.__name__)
        n_group, topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
        check_sigmoid_group_limits(
            int(hf_config.num_experts), int(hf_config.num_experts_per_tok), n_group, topk_group
        )
        nope = ()
        if hf_config.sliding_window is not None:
            nope = tuple(i for i, t in enumerate(hf_config.layer_types) if t != SLIDING_ATTENTION)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            nope_layers=nope,
        )
