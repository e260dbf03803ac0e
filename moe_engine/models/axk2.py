"""A.X-K2 (SK Telecom, HF `AXK2ForCausalLM`, transformers 5.24 models/axk2/modeling_axk2.py):
DeepSeek-V3.2's decoder (`deepseek_v32.py`: MLA with DeepSeek Sparse Attention, its
rotate-half-rope indexer in every layer, sigmoid routing with the correction bias, shared
experts, `mlp_layer_types`) with:
- a gated query: one `q_gate_proj` [2 q_lora_rank -> heads x (qk_head_dim + v_head_dim)] over
  [q_a_layernorm(q_a) | q_a] gives each head's query and an output gate; the attention output
  is multiplied by sigmoid(gate) before o_proj (`layers/mla.py`, `output_gate`);
- gated norms: `input_layernorm` of every layer and `post_attention_layernorm` of MoE layers
  are RMSNorms times a low-rank sigmoid gate of their output (`layers/gated_norm.py`,
  `gated_norm_rank`); dense layers' post-attention norm is a plain RMSNorm;
- routing without groups when config.json's n_group / topk_group are null (A.X-K2-Light):
  sigmoid top-k with the correction bias over all experts.

KV cache: V3.2's (latent + indexer keys, one MLA group). Checkpoint names are V3.2's, with
`self_attn.q_b_proj` holding the fused query + gate rows (loaded as `q_gate_proj`, as
transformers renames it) and the gated norms' `{input,post_attention}_layernorm.{norm.weight,
W_down.weight, W_up.weight}` (loaded as `mlp.fc1` / `mlp.fc2`). Refused as V3.2 (ValueError
naming the field), and without `gated_norm_rank`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.models.config_fields import required_int
from moe_engine.models.deepseek_v32 import DeepseekV32ForCausalLM, DeepseekV32Spec
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.gated_norm import LowRankGatedRMSNorm
from moe_engine.models.layers.mla import MLA_STACKED
from moe_engine.models.spec import FamilyCard
from moe_engine.models.weight_mapping import WeightMapping


@dataclasses.dataclass(frozen=True)
class AXK2Spec(DeepseekV32Spec):
    """`DeepseekV32Spec` plus the gated norms' bottleneck.

    Attributes:
        gated_norm_rank: fc1/fc2 width of each gated norm's gate.
    """

    gated_norm_rank: int = 0


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    """A.X-K2 on the engine's layers (see the module doc)."""

    card = FamilyCard(
        "A.X-K2", ("skt/A.X-K2",),
        "MLA with a gated query + DeepSeek Sparse Attention; gated RMSNorms",
        cache=("mla + indexer keys",), speculation=("ngram",),
    )
    spec_class = AXK2Spec
    model_types = ("axk2",)
    attention_options = {"output_gate": True}
    weight_mapping = WeightMapping(
        renames=((".W_down.", ".mlp.fc1."), (".W_up.", ".mlp.fc2."),
                 (".self_attn.q_b_proj.", ".self_attn.q_gate_proj.")),
        stacked_params=MLA_STACKED,
    )

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """V3.2's fields with the output gate (`attn_output_gate`).

        Raises:
            ValueError: as V3.2's, or a missing gated_norm_rank.
        """
        required_int(cfg, "gated_norm_rank")
        return {**super().shape_fields(cfg), "attn_output_gate": True}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """V3.2's plus gated_norm_rank."""
        return {**super().spec_fields(hf_config), "gated_norm_rank": hf_config.gated_norm_rank}

    def build_layer(
        self, spec: AXK2Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """A pre-norm `DecoderLayer` whose input norm (and post-attention norm in MoE layers)
        is gated."""
        gated = LowRankGatedRMSNorm(spec.hidden_size, spec.gated_norm_rank, spec.rms_norm_eps,
                                    dtype)
        post = (LowRankGatedRMSNorm(spec.hidden_size, spec.gated_norm_rank, spec.rms_norm_eps,
                                    dtype)
                if index in spec.moe_layers else self.build_norm(spec, spec.hidden_size, dtype))
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary), self.build_mlp(spec, index, dtype),
            gated, post,
        )
