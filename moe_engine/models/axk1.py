"""A.X-K1 (SK Telecom, model card skt/A.X-K1, 2026; HF `AXK1ForCausalLM`, transformers 5.24
`models/axk1/modeling_axk1.py`).

DeepSeek-V3's decoder (`deepseek_v3.py`: MLA with a query LoRA and its latent cache,
sigmoid group-limited routing with the correction bias, shared experts) with A.X-K1's one
change: an RMSNorm `post_mlp_layernorm` on the MoE block's output (routed + shared experts)
before the residual add (`DecoderLayer(post_mlp_layernorm=)`), in the MoE layers only. Each
layer's MLP is named by `mlp_layer_types` ("dense" / "sparse"), by default from the legacy
`first_k_dense_replace` (default 1) and `moe_layer_freq` (default 1) as
`AXK1Config.__post_init__` derives it; n_group / topk_group default 8 / 4.

Checkpoint names are DeepSeek-V3's plus `model.layers.{i}.post_mlp_layernorm.weight` (the
released checkpoints' and transformers' saved name; `mlp.post_mlp_layernorm` is read too).
The released checkpoints also hold the norm for the dense layers, which use none, and may lack
`mlp.gate.e_score_correction_bias` (routing without a bias): the former are skipped unread,
the latter is zero (`WeightMapping.skipped` / `optional`, transformers'
`_keys_to_ignore_on_load_unexpected` / `_on_load_missing`). Multi-token-prediction layers
beyond num_hidden_layers are skipped unread. KV cache: one MLA latent group of every layer;
prefix caching applies.

Refused (ValueError naming the field): DeepSeek-V3's refusals (`deepseek_v3.py`), a
malformed `mlp_layer_types`.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.config_fields import mlp_layer_types_moe_layers, required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.mla import MLA_STACKED
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


def axk1_moe_layers(cfg: dict) -> tuple[int, ...]:
    """`mlp_layer_types`, else layer i sparse when i >= `first_k_dense_replace` (default 1)
    and i % `moe_layer_freq` (default 1) == 0 -> the MoE layers.

    Raises:
        ValueError: a malformed `mlp_layer_types`, or moe_layer_freq below 1.
    """
    first = int(cfg.get("first_k_dense_replace", 1) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if freq < 1:
        raise ValueError(f"config.json: moe_layer_freq {freq} must be >= 1")
    default = [
        "sparse" if i >= first and i % freq == 0 else "dense"
        for i in range(required_int(cfg, "num_hidden_layers"))
    ]
    return mlp_layer_types_moe_layers(cfg, default)


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K1 on the engine's layers (module docstring)."""

    card = FamilyCard(
        "A.X-K1", ("skt/A.X-K1",), "MLA (latent-only cache, absorbed decode)", cache=("mla",)
    )

    model_types = ("axk1",)
    mtp_layers_field = None
    weight_mapping = WeightMapping(
        renames=((".mlp.post_mlp_layernorm.", ".post_mlp_layernorm."),),
        stacked_params=MLA_STACKED,
        skipped=(r"\.post_mlp_layernorm\.", r"\.inv_freq$"),
        optional=(r"\.mlp\.gate\.e_score_correction_bias$",),
    )

    @classmethod
    def moe_layers_of(cls, cfg: dict) -> tuple[int, ...]:
        """`axk1_moe_layers`."""
        return axk1_moe_layers(cfg)

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """DeepSeek-V3's fields with the MoE layers of `mlp_layer_types` and A.X-K1's default
        n_shared_experts 1 (the post-MLP norms, H values per MoE layer, are left out of the
        startup plan's parameter count: under a millionth of the weights).

        Raises:
            ValueError: a missing, malformed or refused field (module doc).
        """
        return super().shape_fields({**cfg, "n_shared_experts": cfg.get("n_shared_experts", 1)})

    def build_layer(
        self, spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """DeepSeek-V3's layer; an MoE layer's output goes through `post_mlp_layernorm`."""
        norm = self.build_norm
        post = norm(spec, spec.hidden_size, dtype) if index in spec.moe_layers else None
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            post_mlp_layernorm=post,
        )
