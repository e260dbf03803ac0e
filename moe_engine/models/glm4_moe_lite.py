"""GLM-4.7-Flash (Zhipu AI / Z.ai, model card zai-org/GLM-4.7-Flash, 2026; HF
`Glm4MoeLiteForCausalLM`, transformers 5.24 `models/glm4_moe_lite/modeling_glm4_moe_lite.py`).

DeepSeek-V3's decoder (`deepseek_v3.py`) with GLM-4.5's MoE block; against the Llama-style
decoder it differs in:
- multi-head latent attention (`layers/mla.py`, transformers' `DeepseekV3Attention` itself):
  query LoRA (`q_lora_rank`), the latent cache of `kv_lora_rank + qk_rope_head_dim` values per
  token and layer (`kv_cache.MLAAttentionSpec`), rope over the `qk_rope_head_dim` dims on
  interleaved pairs when `rope_interleave` (default true), YaRN with DeepSeek's mscale when
  `rope_parameters` says "yarn";
- each layer's MLP named by `mlp_layer_types` ("dense": a SwiGLU MLP of `intermediate_size`,
  "sparse": MoE; default layer 0 dense, the rest MoE, as `Glm4MoeLiteConfig.__post_init__`);
- GLM-4.5's router (`Glm4MoeTopkRouter`, DeepSeek-V3's "noaux_tc"): sigmoid scores, the
  float32 `e_score_correction_bias` choosing the experts, `n_group` / `topk_group` limits
  (default 1 / 1: none), weights renormalised when `norm_topk_prob`, times
  `routed_scaling_factor` (`layers/routers.SigmoidGroupedTopKRouter`), plus
  `n_shared_experts` (default 1) ungated shared experts as one MLP of width
  `moe_intermediate_size * n_shared_experts`.

Checkpoint names are DeepSeek-V3's (`deepseek_v3.py`): `self_attn.{q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}` (q_a / kv_a stacked into
`fused_qkv_a_proj`), `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, per-expert or
fused experts, `mlp.shared_experts.*`. The released checkpoint's MTP layer
(`model.layers.47.*`, `num_nextn_predict_layers`) is built for `--speculative-method mtp`,
else skipped unread as transformers does. KV cache: one MLA latent group of every layer;
prefix caching applies.

Refused (ValueError naming the field): DeepSeek-V3's refusals (`deepseek_v3.py`), a
`partial_rotary_factor` other than 1 (transformers would rotate fewer dims than
qk_rope_head_dim and fail), a `first_k_dense_replace` that disagrees with `mlp_layer_types`
(transformers reads only the latter).
"""

from __future__ import annotations

from moe_engine.models.config_fields import mlp_layer_types_moe_layers, required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe_engine.models.layers.rotary import partial_rotary_factor_of
from moe_engine.models.spec import FamilyCard


def glm_lite_moe_layers(cfg: dict) -> tuple[int, ...]:
    """`mlp_layer_types` (default ["dense"] + ["sparse"] * (layers - 1)) -> the MoE layers.

    Raises:
        ValueError: a malformed `mlp_layer_types`, or a `first_k_dense_replace` that
            disagrees with it (transformers ignores that field; the two would serve
            differently).
    """
    layers = required_int(cfg, "num_hidden_layers")
    moe = mlp_layer_types_moe_layers(cfg, ["dense"] + ["sparse"] * (layers - 1))
    first = cfg.get("first_k_dense_replace")
    dense = [i for i in range(layers) if i not in moe]
    if first is not None and moe and dense != list(range(int(first))):
        raise ValueError(
            f"config.json: first_k_dense_replace {first} disagrees with the dense layers "
            f"{dense} of mlp_layer_types; transformers' Glm4MoeLiteForCausalLM reads only "
            "mlp_layer_types (set it, or make the two agree)"
        )
    return moe


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash on the engine's layers (module docstring)."""

    card = FamilyCard(
        "GLM-4.7-Flash", ("zai-org/GLM-4.7-Flash",), "MLA (latent-only cache, absorbed decode)",
        cache=("mla",), speculation=("ngram", "mtp"),
    )

    model_types = ("glm4_moe_lite",)

    @classmethod
    def moe_layers_of(cls, cfg: dict) -> tuple[int, ...]:
        """`glm_lite_moe_layers`."""
        return glm_lite_moe_layers(cfg)

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """DeepSeek-V3's fields with the MoE layers of `mlp_layer_types` and GLM's default
        n_shared_experts 1.

        Raises:
            ValueError: a missing, malformed or refused field (module doc).
        """
        return super().shape_fields({**cfg, "n_shared_experts": cfg.get("n_shared_experts", 1)})

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """DeepSeek-V3's (rope, YaRN, interleave, group limits, scaling).

        Raises:
            ValueError: a partial_rotary_factor other than 1; StartupError: a rope_type other
                than default or yarn.
        """
        factor = partial_rotary_factor_of(hf_config)
        if factor != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor {factor} is not supported for "
                f"{cls.__name__}: the rope covers all qk_rope_head_dim dims (supported: 1.0)"
            )
        return super().spec_fields(hf_config)
