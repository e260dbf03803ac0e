"""DeepSeek-V2 (DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", arXiv:2405.04434, 2024; HF `DeepseekV2ForCausalLM`), also
DeepSeek-V2-Lite and V2.5.

DeepSeek-V3's decoder (`deepseek_v3.py`: MLA with its latent cache, dense first layers,
shared experts, the same checkpoint names) with V2's differences:
- routing by softmax over all experts (`layers/routing.softmax_grouped_topk`): `topk_method`
  "greedy" (top-k of all) or "group_limited_greedy" (groups ranked by their best score, the
  best `topk_group` of `n_group` kept), weights times `routed_scaling_factor`, never
  renormalised (transformers 5.24 ignores `norm_topk_prob`; DeepSeek's reference code
  renormalises when it is true, so such a config is refused rather than served one way);
- no correction bias; the router weight is float32 (`_keep_in_fp32_modules_strict`);
- rope always on interleaved pairs (V2's complex multiplication; `layers/rotary.py` says why
  the de-interleaved output gives the same attention);
- `mlp_bias` (biases on dense and shared MLPs) is refused: no published V2 checkpoint has
  them.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from moe_engine.models.config_fields import num_experts_of, required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Spec
from moe_engine.models.layers.mla import MLA_STACKED
from moe_engine.models.layers.routers import SoftmaxGroupedTopKRouter
from moe_engine.models.layers.routing import check_v2_routing
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class DeepseekV2Spec(DeepseekV3Spec):
    """`DeepseekV3Spec` with V2's defaults (topk_method "greedy", interleaved rope)."""

    topk_method: str = "greedy"


def _int_or_none(cfg: dict, key: str) -> int | None:
    return None if cfg.get(key) is None else int(cfg[key])


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 on the engine's layers (see the module doc)."""
    card = FamilyCard(
        "DeepSeek-V2", ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2"),
        "MLA (latent-only cache, absorbed decode)", cache=("mla",),
    )

    spec_class = DeepseekV2Spec
    model_types = ("deepseek_v2",)
    weight_mapping = WeightMapping(stacked_params=MLA_STACKED)

    @classmethod
    def check_routing(cls, cfg: dict) -> None:
        """V2's routing: softmax scores (`scoring_func` absent or "softmax"), topk_method
        "greedy" (default) or "group_limited_greedy" with its group limits, norm_topk_prob
        false, no mlp_bias.

        Raises:
            ValueError: naming the field, its value and the reason.
        """
        if cfg.get("scoring_func") not in (None, "softmax"):
            raise ValueError(
                f"config.json: scoring_func {cfg['scoring_func']!r} is not supported for "
                f"{cls.__name__} (supported: 'softmax')"
            )
        if cfg.get("norm_topk_prob"):
            raise ValueError(
                "config.json: norm_topk_prob true is not supported for DeepseekV2ForCausalLM: "
                "transformers ignores it and DeepSeek's reference code renormalises, so the "
                "intended routing weights are ambiguous"
            )
        if cfg.get("mlp_bias"):
            raise ValueError(
                "config.json: mlp_bias true is not supported for DeepseekV2ForCausalLM (dense "
                "and shared-expert MLPs without biases only)"
            )
        check_v2_routing(
            num_experts_of(cfg), required_int(cfg, "num_experts_per_tok"),
            cfg.get("topk_method") or "greedy", _int_or_none(cfg, "n_group"),
            _int_or_none(cfg, "topk_group"),
        )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """`DeepseekV3ForCausalLM.shape_fields` without the correction bias, never
        renormalised."""
        fields = super().shape_fields(cfg)
        return {**fields, "router_correction_bias": False, "norm_topk_prob": False}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """V3's, with rope always interleaved and `topk_method`; n_group / topk_group only
        matter for "group_limited_greedy"."""
        fields = super().spec_fields(hf_config)
        return {**fields, "rope_interleave": True, "topk_method": hf_config.topk_method}

    def build_router(self, spec: DeepseekV2Spec) -> nn.Module:
        """The softmax (group-limited) greedy router (float32)."""
        return SoftmaxGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.topk_method, spec.n_group,
            spec.topk_group, spec.routed_scaling_factor,
        )
