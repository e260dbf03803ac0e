"""Mixtral (Jiang et al., "Mixtral of Experts", 2024; HF `MixtralForCausalLM`).

Llama-style decoder where every layer is a sparse MoE block; routing is softmax, top-k, then
renormalised over the k chosen experts.
"""

from __future__ import annotations

from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.moe_decoder import ArchSpec, MoeCausalLM


class MixtralForCausalLM(MoeCausalLM):
    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:
        c = hf_config
        if getattr(c, "sliding_window", None):
            raise ValueError(
                f"sliding_window={c.sliding_window}: sliding-window Mixtral is not supported yet "
                "(set sliding_window to null in config.json for full attention)"
            )
        return ArchSpec(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=rope_theta_of(c),
            max_position=c.max_position_embeddings,
            num_experts=c.num_local_experts,
            top_k=c.num_experts_per_tok,
            moe_intermediate_size=c.intermediate_size,
            dense_intermediate_size=c.intermediate_size,
            moe_layers=frozenset(range(c.num_hidden_layers)),
            renormalize=True,
            qk_norm=False,
            attention_bias=False,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )
