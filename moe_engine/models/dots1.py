"""dots.llm1 (rednote-hilab, "dots.llm1 Technical Report", arXiv:2506.05767, 2025; HF
`Dots1ForCausalLM`, transformers 5.24 `modeling_dots1.py`).

Qwen3's attention over DeepSeek-V3's MoE block, so the GLM-4.5 file's hooks do most of it
(`glm4_moe.Glm4MoeForCausalLM`). It differs from the Llama-style decoder in:
- per-head q/k RMSNorm before the rope (always), full RoPE; biases on q/k/v *and* o_proj when
  `attention_bias`;
- `layer_types` (default: layers i >= `max_window_layers` sliding when `sliding_window` is
  set, `Dots1Config.__post_init__`): sliding layers attend the last `sliding_window` tokens;
- the first `first_k_dense_replace` (default 0) layers are dense SwiGLU MLPs of
  `intermediate_size`; the rest are MoE blocks routed as DeepSeek-V3 (sigmoid scores,
  `e_score_correction_bias` for the choice only, group-limited top-k over `n_group` /
  `topk_group`, renormalised when `norm_topk_prob` (default false), times
  `routed_scaling_factor`: `layers/routers.SigmoidGroupedTopKRouter`, float32) plus
  `n_shared_experts` ungated shared experts as one MLP of width `moe_intermediate_size *
  n_shared_experts`.

Checkpoint names are the base mapping's (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.*` or the fused
`mlp.experts.gate_up_proj` / `down_proj`, `mlp.shared_experts.*`). KV cache: a full-attention
group, plus a sliding-window group when some layer slides.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import layer_types_fields, required_int
from moe_engine.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeSpec
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import FamilyCard

#: `Dots1Config.sliding_window` and `max_window_layers` defaults.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 62


def window_layer_fields(cfg: dict, default_types: list[str], default_window: int) -> dict:
    """`layer_types` / `sliding_window` of a config.json that lists `layer_types` or whose
    config class derives them (`default_types`); {} when no layer slides.

    Raises:
        ValueError: a malformed layer_types, or a window below 1 token.
    """
    fields = layer_types_fields({**cfg, "layer_types": cfg.get("layer_types") or default_types},
                                default_window)
    return fields if fields["sliding_window"] is not None else {}


def shared_width(cfg: dict, key: str, default: int | None) -> int:
    """`moe_intermediate_size * cfg[key]` (the shared-experts MLP width; `default` when the key
    is absent).

    Raises:
        ValueError: the count missing with no default (transformers' block would fail too).
    """
    count = cfg.get(key, default)
    if count is None:
        raise ValueError(f"config.json: missing required field {key!r} (shared experts)")
    return required_int(cfg, "moe_intermediate_size") * int(count)


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """dots.llm1 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "dots.llm1", ("rednote-hilab/dots.llm1.inst",),
        "GQA, q/k norm, optional sliding layers", cache=("full", "sliding"),
    )

    model_types = ("dots1",)
    mtp_layers_field = None

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MoE layers from `first_k_dense_replace` (default 0); q/k norm; attention biases on
        q/k/v/o from `attention_bias`; shared experts of `n_shared_experts` (required);
        `layer_types` as `Dots1Config` derives them.

        Raises:
            ValueError: a required field missing (named), a malformed layer_types / window.
        """
        layers = required_int(cfg, "num_hidden_layers")
        window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        max_window = int(cfg.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS) or 0)
        types = ["sliding_attention" if window is not None and i >= max_window
                 else "full_attention" for i in range(layers)]
        first = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = tuple(range(first, layers)) if cfg.get("n_routed_experts") else ()
        return cls.moe_shape(
            cfg,
            moe_layers=moe_layers,
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=shared_width(cfg, "n_shared_experts", None),
            router_correction_bias=True,
            router_float32=True,
            **window_layer_fields(cfg, types, DEFAULT_SLIDING_WINDOW),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """GLM-4.5's (rope, group limits, scaling), the rope over the whole head.

        Raises:
            StartupError: a rope_type other than default; ValueError: see
                `Glm4MoeForCausalLM.spec_fields`.
        """
        fields = super().spec_fields(hf_config)
        return {**fields, "rotary_dim": 0}

    def build_rotary(self, spec: Glm4MoeSpec, max_position: int) -> nn.Module:
        return MoeCausalLM.build_rotary(self, spec, max_position)

    def build_attention(
        self, spec: Glm4MoeSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Qwen3's attention: q/k norm, biases on q/k/v/o from `attention_bias`, sliding where
        `layer_types` says, no rope in `spec.nope_layers`."""
        sliding = bool(spec.layer_types) and spec.layer_types[index] == "sliding_attention"
        window = spec.sliding_window if sliding else None
        rotary = None if index in spec.nope_layers else rotary
        return Attention(spec, dtype, rotary, window, o_bias=spec.attention_bias)
