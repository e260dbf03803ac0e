"""DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024; HF
`DeepseekV3ForCausalLM`), also DeepSeek-R1 / V3.1 and Kimi-K2 (config.json model_type
"kimi_k2", architectures ["DeepseekV3ForCausalLM"]).

A Llama-style pre-norm decoder that differs in:
- multi-head latent attention (`layers/mla.py`, DeepSeek-V2 paper sec. 2.1): the KV cache
  holds the latent [c_kv | k_pe] only (`kv_lora_rank + qk_rope_head_dim` values per token and
  layer, `kv_cache.MLAAttentionSpec`); query LoRA (`q_lora_rank`; null: a direct q_proj);
  rope on interleaved pairs when `rope_interleave` (default true), YaRN with DeepSeek's
  mscale / mscale_all_dim (`rope_scaling` + `rope_theta`, or transformers 5's
  `rope_parameters`), whose mscale_all_dim also scales the softmax;
- dense SwiGLU MLPs of `intermediate_size` in the first `first_k_dense_replace` layers; MoE in
  layer i when i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's reference
  `modeling_deepseek.py`; transformers 5.24 drops the `moe_layer_freq` test, and every published
  config says 1);
- routing (`layers/routing.sigmoid_grouped_topk`, "noaux_tc"): sigmoid scores, the correction
  bias `e_score_correction_bias` choosing (never weighting) the experts, `n_group` groups
  ranked by their top-2 biased scores, the best `topk_group` kept, top-k in them, weights
  renormalised when `norm_topk_prob`, times `routed_scaling_factor`;
- `n_shared_experts` ungated shared experts (one MLP of width moe_intermediate_size x
  n_shared_experts) beside the routed ones (`layers/shared_experts.py`);
- `num_nextn_predict_layers` multi-token-prediction layers shipped as
  `model.layers.{num_hidden_layers + j}.*`: built and loaded for `--speculative-method mtp`
  (`layers/mtp.py`, `MoeCausalLM.build_mtp_layer`), else skipped unread
  (`weight_mapping.beyond_num_layers`).

Checkpoint names are transformers' (and the hub's): `self_attn.{q_proj | q_a_proj,
q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`;
`mlp.{gate,up,down}_proj` (dense); `mlp.gate.weight` / `mlp.gate.e_score_correction_bias`;
`mlp.experts.{e}.{gate,up,down}_proj.weight` or transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj`; `mlp.shared_experts.{gate,up,down}_proj.weight`.
`q_a_proj` and `kv_a_proj_with_mqa` fill the rows of the attention's `fused_qkv_a_proj`
(`layers/mla.MLA_STACKED`). FP8 block checkpoints (DeepSeek-V3/R1, Kimi-K2) load through
`quant/fp8.py`.

Refused before any weight is read (ValueError naming the field): a missing kv_lora_rank or
q_lora_rank key, a hidden_act other than silu, `index_topk` (DeepSeek-V3.2's sparse
indexer), a topk_method other than "noaux_tc", a scoring_func other than "sigmoid", and group
limits `check_sigmoid_group_limits` refuses.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import (
    check_hidden_act,
    mla_shape_fields,
    num_experts_of,
    required_int,
)
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.mla import MLA_STACKED, MLAAttention
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import RotaryEmbedding, YarnScaling, rope_with_scaling_of
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.routing import check_sigmoid_group_limits
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: The sparse-attention fields of DeepSeek-V3.2 (`deepseek_v32.py`), refused on V3.
SPARSE_INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Spec(ArchSpec):
    """`ArchSpec` plus what DeepSeek's forward pass needs beyond sizes.

    Attributes:
        yarn: YaRN rotary scaling (None: plain RoPE).
        rope_interleave: rope on interleaved pairs (x0, x1), (x2, x3), ...
        n_group, topk_group: experts split into n_group groups, topk_group kept per token.
        routed_scaling_factor: multiplies the routed experts' weights.
        topk_method: "noaux_tc" (V3), "greedy" / "group_limited_greedy" (V2).
    """

    yarn: YarnScaling | None = None
    rope_interleave: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"


def deepseek_moe_layers(cfg: dict) -> tuple[int, ...]:
    """Layer i is MoE when the config has routed experts, i >= `first_k_dense_replace` and
    i % `moe_layer_freq` == 0 (DeepSeek's reference `DeepseekV3DecoderLayer`).

    Raises:
        ValueError: moe_layer_freq below 1.
    """
    freq = int(cfg.get("moe_layer_freq") or 1)
    if freq < 1:
        raise ValueError(f"config.json: moe_layer_freq {freq} must be >= 1")
    first = int(cfg.get("first_k_dense_replace") or 0)
    if not num_experts_of(cfg):
        return ()
    return tuple(
        i for i in range(required_int(cfg, "num_hidden_layers")) if i >= first and i % freq == 0
    )


def check_mla_fields(cfg: dict, sparse: bool = False) -> None:
    """Refuse an MLA config.json without `kv_lora_rank` or the `q_lora_rank` key (null means
    a direct q_proj; an absent key would leave transformers' default, 1536, unstated), or with
    DeepSeek-V3.2's sparse indexer unless `sparse` (an architecture that builds it).

    Raises:
        ValueError: naming the field and the reason.
    """
    for key in () if sparse else SPARSE_INDEXER_FIELDS:
        if cfg.get(key) is not None:
            raise ValueError(
                f"config.json: {key}={cfg[key]!r}: DeepSeek Sparse Attention (the lightning "
                "indexer choosing index_topk keys per query, DeepSeek-V3.2) is not supported; "
                "this engine implements dense MLA only"
            )
    if not cfg.get("kv_lora_rank"):
        raise ValueError(
            f"config.json: kv_lora_rank is {cfg.get('kv_lora_rank')!r}: multi-head latent "
            "attention needs the latent width (e.g. 512)"
        )
    if "q_lora_rank" not in cfg:
        raise ValueError(
            "config.json: missing required field 'q_lora_rank' (the query LoRA width, or null "
            "for a direct q_proj)"
        )


class DeepseekV3ForCausalLM(MoeCausalLM):
    """DeepSeek-V3 on the engine's layers (see the module doc)."""
    card = FamilyCard(
        "DeepSeek-V3 / R1 / V3.1, Kimi-K2",
        ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1", "moonshotai/Kimi-K2-Instruct"),
        "MLA (latent-only cache, absorbed decode)", cache=("mla",),
        speculation=("ngram", "mtp"),
    )

    spec_class = DeepseekV3Spec
    model_types = ("deepseek_v3",)
    weight_mapping = WeightMapping(stacked_params=MLA_STACKED)
    mtp_layers_field = "num_nextn_predict_layers"
    #: The architecture builds DeepSeek Sparse Attention (`check_mla_fields` lets its
    #: `index_*` fields through).
    sparse_attention: ClassVar[bool] = False

    @classmethod
    def check_routing(cls, cfg: dict) -> None:
        """V3's routing: topk_method "noaux_tc", scoring_func "sigmoid" (the only ones
        DeepSeek's reference MoEGate implements; absent means them), group limits (when
        config.json states n_group or topk_group).

        Raises:
            ValueError: naming the field, its value and the reason.
        """
        method, scoring = cfg.get("topk_method"), cfg.get("scoring_func")
        if method not in (None, "noaux_tc"):
            raise ValueError(
                f"config.json: topk_method {method!r} is not supported for {cls.__name__} "
                "(supported: 'noaux_tc', sigmoid scores with the correction bias)"
            )
        if scoring not in (None, "sigmoid"):
            raise ValueError(
                f"config.json: scoring_func {scoring!r} is not supported for {cls.__name__} "
                "(supported: 'sigmoid')"
            )
        if cfg.get("n_group") is None and cfg.get("topk_group") is None:
            return  # transformers' defaults (8, 4) apply: checked again on its config's dict
        check_sigmoid_group_limits(
            num_experts_of(cfg), required_int(cfg, "num_experts_per_tok"),
            required_int(cfg, "n_group"), required_int(cfg, "topk_group"),
        )

    @classmethod
    def moe_layers_of(cls, cfg: dict) -> tuple[int, ...]:
        """The MoE layer indices of a config.json (`deepseek_moe_layers`; a family that names
        them otherwise overrides this)."""
        return deepseek_moe_layers(cfg)

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """MLA sizes, MoE layers (`moe_layers_of`), shared experts of width
        moe_intermediate_size x n_shared_experts, a float32 router with a correction bias.

        Raises:
            ValueError: a missing or malformed field, or a refused one (module doc).
        """
        check_mla_fields(cfg, sparse=cls.sparse_attention)
        check_hidden_act(cfg, cls.__name__)
        required_int(cfg, "n_routed_experts")
        cls.check_routing(cfg)
        width = required_int(cfg, "moe_intermediate_size")
        return cls.moe_shape(
            cfg,
            moe_layers=cls.moe_layers_of(cfg),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
            router_correction_bias=True,
            router_float32=True,
            **mla_shape_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta with YaRN, rope_interleave, the group limits and scaling
        (transformers' defaults where config.json is silent).

        Raises:
            StartupError: a rope_type other than default or yarn.
        """
        theta, yarn = rope_with_scaling_of(hf_config)
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            yarn=yarn,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
            n_group=int(hf_config.n_group or 1),
            topk_group=int(hf_config.topk_group or 1),
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
        )

    def build_rotary(self, spec: DeepseekV3Spec, max_position: int) -> nn.Module:
        """RoPE over the qk_rope_head_dim dims, interleaved when `rope_interleave`."""
        return RotaryEmbedding(
            spec.qk_rope_head_dim, max_position, spec.rope_theta, spec.yarn,
            interleaved=spec.rope_interleave,
        )

    def build_attention(
        self, spec: DeepseekV3Spec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """`MLAAttention` (softmax scale from the rotary's YaRN mscale_all_dim)."""
        return MLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias, dtype=dtype,
        )

    def build_router(self, spec: DeepseekV3Spec) -> nn.Module:
        """The sigmoid group-limited router with its correction bias (float32)."""
        return SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts, spec.top_k, spec.n_group, spec.topk_group,
            spec.norm_topk_prob, spec.routed_scaling_factor,
        )

    def build_mlp(self, spec: DeepseekV3Spec, index: int, dtype: torch.dtype) -> nn.Module:
        """A `DenseMLP` of intermediate_size outside `moe_layers`; else `FusedMoE` with
        `build_router` and the shared experts."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        shared = None
        if spec.shared_expert_intermediate_size:
            shared = SharedExperts(spec.hidden_size, spec.shared_expert_intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype, router=self.build_router(spec), shared_experts=shared,
        )
