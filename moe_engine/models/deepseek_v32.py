"""DeepSeek-V3.2 (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with
DeepSeek Sparse Attention", 2025; HF `DeepseekV32ForCausalLM`, transformers 5.24
models/deepseek_v32/modeling_deepseek_v32.py).

DeepSeek-V3 (`deepseek_v3.py`: MLA, sigmoid group-limited routing with the correction bias,
ungated shared experts, dense-first layers) plus DeepSeek Sparse Attention in every layer: a
lightning indexer (`layers/indexer.py`) scores each query against every earlier token's
indexer key and the MLA attention reads only the `index_topk` best (`layers/sparse_mla.py`).
Beside the Llama-style decoder, then, it differs as V3 does and in:
- the query LoRA is required (the indexer reads q_resid, the normalised compressed query);
- MLA rope is always on interleaved pairs (transformers drops `rope_interleave`), the
  indexer's on rotate-half pairs over the first qk_rope_head_dim dims of its heads;
- MoE layers follow config.json `mlp_layer_types` ("dense" / "sparse") when it is there,
  else `first_k_dense_replace`.

KV cache: one MLA group whose spec carries the indexer keys (`kv_cache.MLAAttentionSpec`,
`index_head_dim`): per layer the latent [c_kv | k_pe] and the indexer key at the same slots
and block ids, so prefix caching reuses both. Checkpoint names are V3's plus
`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}` (`k_norm` a LayerNorm with a bias). The
`num_nextn_predict_layers` MTP layers are not built (their attention is sparse too):
`--speculative-method mtp` is refused; n-gram drafts are verified as prefill rows.

Refused before any weight is read (ValueError naming the field): V3's refusals, a missing
`index_topk` / `index_n_heads` / `index_head_dim`, a null `q_lora_rank`, and an
`index_head_dim` below qk_rope_head_dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from moe_engine.models.config_fields import required_int
from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Spec
from moe_engine.models.layers.indexer import LightningIndexer
from moe_engine.models.layers.sparse_mla import SparseMLAAttention
from moe_engine.models.spec import FamilyCard


@dataclasses.dataclass(frozen=True)
class DeepseekV32Spec(DeepseekV3Spec):
    """`DeepseekV3Spec` plus the indexer's numbers.

    Attributes:
        index_topk: keys each query attends.
        indexer_rope_interleaved: the indexer's rope on interleaved pairs (GLM-5).
        indexer_layers: layers with their own indexer (the rest reuse the latest one's keys).
    """

    index_topk: int = 0
    indexer_rope_interleaved: bool = False
    indexer_layers: tuple[int, ...] = ()


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 on the engine's layers (see the module doc)."""

    card = FamilyCard(
        "DeepSeek-V3.2", ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-ai/DeepSeek-V3.2"),
        "MLA + DeepSeek Sparse Attention (lightning indexer, top-k keys per query)",
        cache=("mla + indexer keys",), speculation=("ngram",),
    )
    spec_class = DeepseekV32Spec
    model_types = ("deepseek_v32",)
    mtp_layers_field = None
    sparse_attention = True
    #: More `SparseMLAAttention` arguments of a variant (A.X-K2's `output_gate`).
    attention_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def moe_layers_of(cls, cfg: dict) -> tuple[int, ...]:
        """Layers whose `mlp_layer_types` entry is "sparse" (V3's rule without the list).

        Raises:
            ValueError: a list of another length than num_hidden_layers, or another entry.
        """
        types = cfg.get("mlp_layer_types")
        if types is None:
            return super().moe_layers_of(cfg)
        if len(types) != required_int(cfg, "num_hidden_layers") or set(types) - {"dense",
                                                                             "sparse"}:
            raise ValueError(
                f"config.json: mlp_layer_types {types!r} must list 'dense' or 'sparse' for "
                "each of num_hidden_layers layers"
            )
        return tuple(i for i, t in enumerate(types) if t == "sparse")

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """V3's fields plus the indexer's heads and width.

        Raises:
            ValueError: a missing index field or q_lora_rank, index_n_heads or index_topk
                below 1, or index_head_dim below qk_rope_head_dim.
        """
        fields = super().shape_fields(cfg)
        heads, width = required_int(cfg, "index_n_heads"), required_int(cfg, "index_head_dim")
        topk = required_int(cfg, "index_topk")
        for key, value in (("index_n_heads", heads), ("index_topk", topk)):
            if value < 1:
                raise ValueError(f"config.json: {key} {value} must be >= 1")
        if not fields.get("q_lora_rank"):
            raise ValueError(
                f"config.json: q_lora_rank {cfg.get('q_lora_rank')!r}: {cls.__name__}'s "
                "lightning indexer reads the query LoRA (q_lora_rank >= 1 is required)"
            )
        if width < fields["qk_rope_head_dim"]:
            raise ValueError(
                f"config.json: index_head_dim {width} must be >= qk_rope_head_dim "
                f"{fields['qk_rope_head_dim']} (the indexer ropes that many of its dims)"
            )
        return {**fields, "index_n_heads": heads, "index_head_dim": width}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """V3's, interleaved MLA rope, index_topk, every layer with its own indexer."""
        return {
            **super().spec_fields(hf_config),
            "rope_interleave": True,
            "index_topk": int(hf_config.index_topk),
            "indexer_layers": tuple(range(hf_config.num_hidden_layers)),
        }

    def build_attention(
        self, spec: DeepseekV32Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """`SparseMLAAttention` with this layer's indexer, or the latest earlier one's keys."""
        indexer = None
        if index in spec.indexer_layers:
            indexer = LightningIndexer(
                spec.hidden_size, spec.q_lora_rank, spec.index_n_heads, spec.index_head_dim,
                spec.qk_rope_head_dim, spec.index_topk, spec.indexer_rope_interleaved, dtype,
            )
        source = max(i for i in spec.indexer_layers if i <= index)
        return SparseMLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias, dtype=dtype, indexer=indexer, topk_source=source,
            **self.attention_options,
        )
