"""dots3 note (model card dots-studio/dots3-note-prev; HF `Dots3NoteForCausalLM`, transformers
5.24 models/dots3_note/modeling_dots3_note.py): the text decoder of the multimodal dots3 note,
served as a causal LM. `AutoModelForCausalLM` builds `Dots3NoteForCausalLM` for config.json
`model_type` "dots3_note_text" and for "dots3_note" (the published layout: text fields at the
top level, vision / audio encoder configs beside them, read here from its `text_config`); the
vision and audio encoders are not part of it.

DeepSeek-V3.2's decoder (`deepseek_v32.py`: MLA with DeepSeek Sparse Attention, sigmoid
group-limited routing with the correction bias, ungated shared experts, `mlp_layer_types`),
with, in every attention layer (`layers/mla.py` options):
- latent rescaling: the normalised compressed query is multiplied by sqrt(hidden_size /
  q_lora_rank) (a factor of the softmax scale here: q enters the dot products linearly, and
  the indexer's top-k is unchanged by a positive factor of its query) and c_kv by
  sqrt(hidden_size / kv_lora_rank) (`latent_scale`, what the cache holds);
- an RMSNorm over the shared k_pe before its rope (`k_rope_only_layernorm`, `rope_key_norm`);
- a per-head sigmoid output gate from the layer input (`g_proj` [H -> heads], `head_gate`);
- the indexer's rope on interleaved pairs (as GLM-5's), rope base
  `rope_parameters["indexed_attention"]["rope_theta"]`, over qk_rope_head_dim dims;
- shared experts of width shared_experts_intermediate_size x n_shared_experts, and dense
  layers by transformers' rule (first_k_dense_replace default 1, moe_layer_freq) when
  config.json has no `mlp_layer_types`. `pyramid_num_routed` (per-layer expert counts) belongs
  to the vision encoder's config; the text MoE layers all have n_routed_experts.

KV cache: V3.2's (one MLA group, latent + indexer keys at the same slots). Checkpoint names
are V3.2's plus `self_attn.g_proj` and `self_attn.k_rope_only_layernorm` (loaded as
`k_pe_norm`).

Refused (ValueError naming the field): V3.2's refusals; `layer_types` other than all
"indexed_attention": "sliding_attention" layers are sliding-window MLA with their own sizes
(`per_layer_config`: swa kv_lora_rank, heads, head dims) and rope base, and the engine's MLA
cache (`kv_cache.MLAAttentionSpec`) keeps every token of the context with one latent width
for all layers (no sliding-window MLA group, no second latent width); "full_attention"
(use_dsa false) layers are dense MLA beside the sparse ones, not built here; a non-empty
`per_layer_config`; a rope_type other than "default".
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.models.config_fields import required_int
from moe_engine.models.deepseek_v32 import DeepseekV32ForCausalLM, DeepseekV32Spec
from moe_engine.models.layers.indexer import LightningIndexer
from moe_engine.models.layers.mla import MLA_STACKED
from moe_engine.models.layers.sparse_mla import SparseMLAAttention
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: The layer type served (MLA + DeepSeek Sparse Attention indexer).
INDEXED = "indexed_attention"
#: transformers' default shared-expert width when config.json states none.
DEFAULT_SHARED_WIDTH = 1536


def dots3_moe_layers(cfg: dict) -> tuple[int, ...]:
    """transformers' `Dots3NoteTextConfig` rule without `mlp_layer_types`: layer i is MoE when
    i >= first_k_dense_replace (default 1) and moe_layer_freq (an int, default 1, or a per-layer
    list of flags) says so."""
    first = int(cfg.get("first_k_dense_replace", 1))
    freq = cfg.get("moe_layer_freq", 1)
    return tuple(
        i for i in range(required_int(cfg, "num_hidden_layers"))
        if i >= first and (bool(freq[i]) if isinstance(freq, list | tuple) else i % freq == 0)
    )


class Dots3NoteForCausalLM(DeepseekV32ForCausalLM):
    """dots3's text decoder on the engine's layers (see the module doc)."""

    card = FamilyCard(
        "dots3 note (text)", ("dots-studio/dots3-note-prev",),
        "gated MLA + DeepSeek Sparse Attention on every layer (sliding-window MLA layers, the "
        "released default, are refused)",
        cache=("mla + indexer keys",), speculation=("ngram",),
    )
    model_types = ("dots3_note_text", "dots3_note")
    attention_options: ClassVar[dict] = {"head_gate": True, "rope_key_norm": True}
    weight_mapping = WeightMapping(
        renames=((".self_attn.k_rope_only_layernorm.", ".self_attn.k_pe_norm."),),
        stacked_params=MLA_STACKED,
    )

    @classmethod
    def arch_spec(cls, hf_config):
        """V3.2's, from `text_config` when config.json is the multimodal "dots3_note" one."""
        text = getattr(hf_config, "text_config", None)
        return super().arch_spec(hf_config if text is None else text)

    @classmethod
    def moe_layers_of(cls, cfg: dict) -> tuple[int, ...]:
        """`mlp_layer_types` when config.json has it (V3.2's rule), else `dots3_moe_layers`."""
        if cfg.get("mlp_layer_types") is None:
            return dots3_moe_layers(cfg)
        return super().moe_layers_of(cfg)

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """V3.2's fields with dots3's shared-expert width; only all-indexed layers.

        Raises:
            ValueError: V3.2's refusals, a `layer_types` entry other than "indexed_attention"
                (or sliding layers implied by its absence), a non-empty `per_layer_config`, or
                n_shared_experts below 1.
        """
        layers = required_int(cfg, "num_hidden_layers")
        types = cfg.get("layer_types")
        if types is None:  # transformers' default: sliding from layer 2 on, except i % 4 == 1
            sliding = cfg.get("use_sliding_window", True)
            types = [INDEXED if not sliding or i < 2 or i % 4 == 1 else "sliding_attention"
                     for i in range(layers)]
        if cfg.get("use_dsa") is False or set(types) != {INDEXED}:
            raise ValueError(
                f"config.json: layer_types {types!r} (use_dsa {cfg.get('use_dsa')!r}): "
                f"{cls.__name__} serves only '{INDEXED}' layers (MLA + DeepSeek Sparse "
                "Attention). 'sliding_attention' layers are sliding-window MLA with their own "
                "latent width, heads and rope base (per_layer_config, swa_*): the engine's MLA "
                "cache (kv_cache.make_kv_cache_groups) has one latent width for every MLA "
                "layer and no sliding-window MLA spec, and MLAAttention no window mask; "
                "'full_attention' (dense MLA beside sparse layers) is not built"
            )
        if cfg.get("per_layer_config"):
            raise ValueError(
                f"config.json: per_layer_config {cfg['per_layer_config']!r}: per-layer "
                f"attention sizes are not supported by {cls.__name__} (supported: none, every "
                "layer with the top-level sizes)"
            )
        shared = int(cfg.get("n_shared_experts", 1) or 0)
        if shared < 1:
            raise ValueError(f"config.json: n_shared_experts {shared} must be >= 1 (dots3)")
        width = cfg.get("shared_experts_intermediate_size",
                        cfg.get("moe_shared_expert_intermediate_size", DEFAULT_SHARED_WIDTH))
        return {**super().shape_fields(cfg),
                "shared_expert_intermediate_size": int(width) * shared}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """V3.2's, with the indexed layers' rope base and the interleaved indexer rope.

        Raises:
            StartupError: a rope_type other than "default" for the indexed layers.
        """
        params = dict(hf_config.rope_parameters[INDEXED])
        if params.get("rope_type", "default") != "default":
            raise StartupError(
                f"config.json: rope_parameters[{INDEXED!r}] rope_type "
                f"{params['rope_type']!r} is not supported for {cls.__name__} (supported: "
                "default)"
            )
        fields = super().spec_fields(_RopeView(hf_config, params))
        return {**fields, "rope_theta": float(params["rope_theta"]), "yarn": None,
                "indexer_rope_interleaved": True}

    def build_attention(
        self, spec: DeepseekV32Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """`SparseMLAAttention` with its indexer, the latent scales, k_pe norm and head gate."""
        indexer = LightningIndexer(
            spec.hidden_size, spec.q_lora_rank, spec.index_n_heads, spec.index_head_dim,
            spec.qk_rope_head_dim, spec.index_topk, spec.indexer_rope_interleaved, dtype,
        )
        qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q_scale = (spec.hidden_size / spec.q_lora_rank) ** 0.5
        return SparseMLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias, dtype=dtype, indexer=indexer, topk_source=index,
            norm_eps=spec.rms_norm_eps, softmax_scale=qk_head_dim**-0.5 * q_scale,
            latent_scale=(spec.hidden_size / spec.kv_lora_rank) ** 0.5,
            **self.attention_options,
        )


class _RopeView:
    """`hf_config` seen with the indexed layers' flat `rope_parameters` (V3's `spec_fields`
    reads a flat dict)."""

    def __init__(self, hf_config, params: dict) -> None:
        self._hf_config, self.rope_parameters = hf_config, params

    def __getattr__(self, name: str):
        return getattr(self._hf_config, name)
