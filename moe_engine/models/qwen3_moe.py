"""Qwen3-MoE (Qwen team, "Qwen3 Technical Report", 2025; HF `Qwen3MoeForCausalLM`).

Llama-style decoder with per-head q/k RMSNorm, softmax-then-top-k routing renormalised when
`norm_topk_prob`, and dense MLP layers where `mlp_only_layers` or `decoder_sparse_step` say so
(the layer rule lives in `plan.ModelShape`, which reads the same config.json).
"""

from __future__ import annotations

from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.moe_decoder import ArchSpec, MoeCausalLM
from moe_engine.plan import ModelShape


class Qwen3MoeForCausalLM(MoeCausalLM):
    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:
        return ArchSpec.from_shape(
            ModelShape.from_hf_config(hf_config.to_dict()),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            qk_norm=True,
        )
