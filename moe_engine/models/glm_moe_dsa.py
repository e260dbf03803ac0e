"""GLM-5 (Z.ai, HF `GlmMoeDsaForCausalLM`, transformers 5.24
models/glm_moe_dsa/modeling_glm_moe_dsa.py): DeepSeek-V3.2's decoder (`deepseek_v32.py`: MLA
with DeepSeek Sparse Attention, sigmoid routing with the correction bias, shared experts,
`mlp_layer_types`) with two differences in the indexer:
- its rope is on interleaved pairs, as the MLA rope (V3.2's indexer uses rotate-half pairs);
- cross-layer top-k sharing: config.json `indexer_types` names each layer "full" (its own
  indexer) or "shared" (no indexer: it attends the keys the latest "full" layer chose for the
  same query, `layers/sparse_mla.py`); transformers derives the list from `index_topk_freq`
  and `index_skip_topk_offset` (or `index_topk_pattern`) when config.json lacks it.

KV cache: V3.2's (the MLA latent and the indexer keys at the same slots in every layer; a
shared layer's indexer-key tensor stays unwritten). Checkpoint names are V3.2's; shared layers
have no `self_attn.indexer.*`. Refused (ValueError naming the field): V3.2's refusals, and an
`indexer_types` whose first layer is not "full" or with another entry.
"""

from __future__ import annotations

from moe_engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from moe_engine.models.spec import FamilyCard

#: `indexer_types` entries: a layer with its own indexer, a layer reusing the previous one's.
INDEXER_TYPES = ("full", "shared")


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 on the engine's layers (see the module doc)."""

    card = FamilyCard(
        "GLM-5", ("zai-org/GLM-5",),
        "MLA + DeepSeek Sparse Attention (interleaved-rope indexer, top-k shared across layers)",
        cache=("mla + indexer keys",), speculation=("ngram",),
    )
    model_types = ("glm_moe_dsa",)

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """V3.2's, with the interleaved indexer rope and the "full" layers of `indexer_types`.

        Raises:
            ValueError: `indexer_types` of another length than the layers, another entry, or
                a first layer that is not "full".
        """
        types = list(hf_config.indexer_types)
        layers = hf_config.num_hidden_layers
        if len(types) != layers or set(types) - set(INDEXER_TYPES) or types[0] != "full":
            raise ValueError(
                f"config.json: indexer_types {types!r} must give one of {INDEXER_TYPES} for each "
                f"of the {layers} layers, the first 'full'"
            )
        return {
            **super().spec_fields(hf_config),
            "indexer_rope_interleaved": True,
            "indexer_layers": tuple(i for i, t in enumerate(types) if t == "full"),
        }
