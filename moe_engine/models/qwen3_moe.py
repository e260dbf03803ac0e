"""Qwen3-MoE (Qwen team, "Qwen3 Technical Report", 2025; HF `Qwen3MoeForCausalLM`).

Llama-style decoder with per-head q/k RMSNorm, softmax-then-top-k routing renormalised when
`norm_topk_prob`, and dense MLP layers where `mlp_only_layers` or `decoder_sparse_step` say so.
"""

from __future__ import annotations

from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.moe_decoder import ArchSpec, MoeCausalLM


class Qwen3MoeForCausalLM(MoeCausalLM):
    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:
        c = hf_config
        num_layers = c.num_hidden_layers
        step = getattr(c, "decoder_sparse_step", 1) or 1
        dense = set(getattr(c, "mlp_only_layers", None) or [])
        num_experts = getattr(c, "num_experts", None) or c.num_local_experts
        moe_layers = frozenset(
            i
            for i in range(num_layers)
            if i not in dense and num_experts > 0 and (i + 1) % step == 0
        )
        return ArchSpec(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=num_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=rope_theta_of(c),
            max_position=c.max_position_embeddings,
            num_experts=num_experts,
            top_k=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            dense_intermediate_size=c.intermediate_size,
            moe_layers=moe_layers,
            renormalize=bool(c.norm_topk_prob),
            qk_norm=True,
            attention_bias=bool(getattr(c, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )
