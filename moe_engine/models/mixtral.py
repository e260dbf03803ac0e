"""Mixtral (Jiang et al., "Mixtral of Experts", 2024; HF `MixtralForCausalLM`).

Llama-style decoder where every layer is a sparse MoE block; routing is softmax, top-k, then
always renormalised over the k chosen experts.
"""

from __future__ import annotations

from moe_engine.models.layers.rotary import rope_theta_of
from moe_engine.models.moe_decoder import ArchSpec, MoeCausalLM
from moe_engine.plan import ModelShape


class MixtralForCausalLM(MoeCausalLM):
    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:
        if getattr(hf_config, "sliding_window", None):
            raise ValueError(
                f"sliding_window={hf_config.sliding_window}: sliding-window Mixtral is not "
                "supported yet (set sliding_window to null in config.json for full attention)"
            )
        return ArchSpec.from_shape(
            ModelShape.from_hf_config(hf_config.to_dict()),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config),
            norm_topk_prob=True,
            qk_norm=False,
        )
