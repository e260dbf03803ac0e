"""LongCat-Flash (Meituan LongCat Team, "LongCat-Flash Technical Report", arXiv:2509.01322,
2025; HF `LongcatFlashForCausalLM`, transformers 5.24 `models/longcat_flash/
modeling_longcat_flash.py`).

Against the Llama-style decoder it differs in:
- every one of the `num_layers` layers is two attention + dense-MLP sublayers and one
  "shortcut" MoE: the MoE reads the first sublayer's post-attention norm output and its
  result is added after the second sublayer (ScMoE, the report's sec. 2.2):
      h1 = h + attn0(norm(h)); x = norm'(h1); s = moe(x); h2 = h1 + mlp0(x)
      h3 = h2 + attn1(norm(h2)); out = h3 + mlp1(norm'(h3)) + s
  The engine builds the 2 x num_layers sublayers as its decoder layers (`ShortcutSublayer`,
  one MLA KV-cache layer each, as transformers' `num_hidden_layers` = 2 x num_layers counts
  them); the shortcut MoE sits in the even ones and its output rides to the odd one;
- multi-head latent attention (`layers/mla.py`) with a query LoRA always, rope on
  interleaved pairs, the query scaled by sqrt(hidden_size / q_lora_rank) (a factor of the
  softmax scale) and the latent c_kv by sqrt(hidden_size / kv_lora_rank) (`latent_scale`):
  transformers' `LongcatFlashMLA`;
- routing (`LongcatFlashTopkRouter`): softmax over the `n_routed_experts` + `zero_expert_num`
  experts, the float32 `e_score_correction_bias` choosing (not weighting) the `moe_topk`,
  weights times `routed_scaling_factor`, never renormalised (`layers/routing.
  SigmoidGroupedTopKRouter` with softmax scores); the `zero_expert_num` zero-computation
  experts return their input times their weight (`FusedMoE(zero_experts=)`,
  `routing.split_zero_experts`): they never reach dispatch or an expert kernel.

Checkpoint names (`LongcatWeightMapping`): `model.layers.{i}.self_attn.{j}.*`,
`.mlps.{j}.*`, `.input_layernorm.{j}`, `.post_attention_layernorm.{j}` are sublayer 2i + j's
`self_attn`, `dense_mlp` and norms; `model.layers.{i}.mlp.router.classifier.weight` /
`.router.e_score_correction_bias` are sublayer 2i's `mlp.gate.*`; `mlp.experts.{e}.*` its
experts (the checkpoint's gate/up rows of zero experts, e >= n_routed_experts, are skipped
unread). `model.mtp.*` (the MTP head) is skipped unread, as transformers does. KV cache: one
MLA latent group of the 2 x num_layers sublayers; prefix caching applies.

Refused (ValueError naming the field): `zero_expert_type` other than "identity",
`mla_scale_q_lora` / `mla_scale_kv_lora` false (transformers scales always), `router_bias`
true (transformers' router never adds the bias it holds), a null `q_lora_rank`, `qk_head_dim`
other than qk_nope_head_dim + qk_rope_head_dim, `head_dim` (the rope's width) other than
qk_rope_head_dim, no routed experts, `hidden_act` other than silu.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, mla_shape_fields, required_int
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.decoder import DenseMLP
from moe_engine.models.layers.mla import MLA_STACKED, MLAAttention
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import (
    RotaryEmbedding,
    YarnScaling,
    rope_with_scaling_of,
    yarn_softmax_scale_factor,
)
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: checkpoint sublayer module -> the engine sublayer's attribute
_SUBLAYER_PARTS = {"self_attn": "self_attn", "mlps": "dense_mlp",
                   "input_layernorm": "input_layernorm",
                   "post_attention_layernorm": "post_attention_layernorm"}
_CHECKPOINT_PART = {v: k for k, v in _SUBLAYER_PARTS.items()}
_CKPT_SUBLAYER = re.compile(rf"model\.layers\.(\d+)\.({'|'.join(_SUBLAYER_PARTS)})\.([01])\.")
_CKPT_MOE = re.compile(r"model\.layers\.(\d+)\.mlp\.")
_ENGINE_PART = re.compile(rf"model\.layers\.(\d+)\.({'|'.join(_CHECKPOINT_PART)}|mlp)\.")


@dataclasses.dataclass(frozen=True)
class LongcatWeightMapping(WeightMapping):
    """`WeightMapping` with LongCat's layer split: checkpoint layer i, part j -> engine
    sublayer 2i + j (module doc); the shortcut MoE `model.layers.{i}.mlp.*` -> sublayer 2i."""

    def model_name(self, name: str) -> str:
        name = super().model_name(name)
        if m := _CKPT_SUBLAYER.match(name):
            index = 2 * int(m[1]) + int(m[3])
            return f"model.layers.{index}.{_SUBLAYER_PARTS[m[2]]}.{name[m.end():]}"
        if m := _CKPT_MOE.match(name):
            return f"model.layers.{2 * int(m[1])}.mlp.{name[m.end():]}"
        return name

    def checkpoint_name(self, name: str) -> str:
        if m := _ENGINE_PART.match(name):
            layer, part, rest = int(m[1]) // 2, m[2], name[m.end():]
            name = (f"model.layers.{layer}.mlp.{rest}" if part == "mlp" else
                    f"model.layers.{layer}.{_CHECKPOINT_PART[part]}.{int(m[1]) % 2}.{rest}")
        return super().checkpoint_name(name)


@dataclasses.dataclass(frozen=True)
class LongcatFlashSpec(ArchSpec):
    """`ArchSpec` plus YaRN (None: plain RoPE) and the routed experts' scaling."""

    yarn: YarnScaling | None = None
    routed_scaling_factor: float = 1.0


class ShortcutSublayer(nn.Module):
    """One of a LongCat layer's two sublayers: pre-norm attention and dense MLP; the first
    (`mlp` set) also runs the shortcut MoE on its MLP input, the second adds its output.

    Args:
        self_attn: `MLAAttention`; dense_mlp: `DenseMLP`; input_layernorm,
        post_attention_layernorm: RMSNorms; mlp: the shortcut `FusedMoE` (first sublayer)
        or None (second).
    """

    def __init__(self, self_attn: nn.Module, dense_mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, mlp: FusedMoE | None) -> None:
        super().__init__()
        self.self_attn, self.dense_mlp, self.mlp = self_attn, dense_mlp, mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.timer = None  # `MoeCausalLM.attach_timer`: the attention phase

    def forward(self, h: torch.Tensor, shortcut: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [T, H] the stream; shortcut: [T, H] the first sublayer's MoE output (second
        sublayer) or None; kv_cache: this sublayer's latent cache. Returns (the new stream,
        the MoE output for the second sublayer or None)."""
        if self.timer is not None:
            with self.timer.phase("attention"):
                h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_cache)
        else:
            h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_cache)
        x = self.post_attention_layernorm(h)
        out = h + self.dense_mlp(x)
        if self.mlp is not None:
            return out, self.mlp(x)
        return out + shortcut, None


def check_longcat_fields(cfg: dict) -> None:
    """Refuse what LongCat-Flash's config.json may say that transformers computes otherwise or
    the engine does not implement (module doc).

    Raises:
        ValueError: naming the field, its value and what is supported.
    """
    check_hidden_act(cfg, "LongcatFlashForCausalLM")
    if (cfg.get("zero_expert_type") or "identity") != "identity":
        raise ValueError(f"config.json: zero_expert_type {cfg['zero_expert_type']!r} is not "
                         "supported (supported: 'identity')")
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if cfg.get(key) not in (None, True):
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported: transformers' "
                             "LongcatFlashMLA always scales (supported: true)")
    if cfg.get("router_bias"):
        raise ValueError("config.json: router_bias true is not supported: transformers' router "
                         "holds the bias but never adds it, so the intended logits are ambiguous")
    if not cfg.get("q_lora_rank") or not cfg.get("kv_lora_rank"):
        raise ValueError(f"config.json: q_lora_rank {cfg.get('q_lora_rank')!r} and kv_lora_rank "
                         f"{cfg.get('kv_lora_rank')!r} must both be set (LongCat's MLA)")
    rope, nope = required_int(cfg, "qk_rope_head_dim"), required_int(cfg, "qk_nope_head_dim")
    if int(cfg.get("qk_head_dim") or rope + nope) != rope + nope:
        raise ValueError(f"config.json: qk_head_dim {cfg['qk_head_dim']} must be "
                         f"qk_nope_head_dim + qk_rope_head_dim = {rope + nope}")
    if int(cfg.get("head_dim") or 64) != rope:
        raise ValueError(f"config.json: head_dim {cfg.get('head_dim', 64)} (the rope's width) "
                         f"must equal qk_rope_head_dim {rope}")
    if required_int(cfg, "n_routed_experts") < 1:
        raise ValueError("config.json: n_routed_experts must be >= 1")


class LongcatFlashForCausalLM(MoeCausalLM):
    """LongCat-Flash on the engine's layers (module docstring)."""

    card = FamilyCard(
        "LongCat-Flash", ("meituan-longcat/LongCat-Flash-Chat",),
        "MLA, two attention sublayers per layer, shortcut MoE with zero-computation experts",
        cache=("mla",),
    )

    spec_class = LongcatFlashSpec
    model_types = ("longcat_flash",)
    weight_mapping = LongcatWeightMapping(
        renames=((".mlp.router.classifier.weight", ".mlp.gate.weight"),
                 (".mlp.router.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")),
        stacked_params=MLA_STACKED, skipped=(r"^model\.mtp\.",),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "expert_ffn_hidden_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """2 x num_layers sublayers (the even ones MoE, all with a dense MLP of
        `ffn_hidden_size`), experts `n_routed_experts` of `expert_ffn_hidden_size`, top-k
        `moe_topk`, `zero_expert_num` zero-computation experts, MLA sizes, a float32 router
        with a correction bias, weights not renormalised.

        Raises:
            ValueError: a missing, malformed or refused field (`check_longcat_fields`).
        """
        check_longcat_fields(cfg)
        sublayers = 2 * required_int(cfg, "num_layers")
        view = {**cfg, "num_hidden_layers": sublayers,
                "intermediate_size": required_int(cfg, "ffn_hidden_size"),
                "num_experts_per_tok": required_int(cfg, "moe_topk")}
        return cls.moe_shape(
            view, moe_layers=tuple(range(0, sublayers, 2)), norm_topk_prob=False,
            router_correction_bias=True, router_float32=True,
            zero_experts=int(cfg.get("zero_expert_num") or 0), dense_mlp_in_moe_layers=True,
            **mla_shape_fields(cfg),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """rms_norm_eps, rope_theta with YaRN, routed_scaling_factor.

        Raises:
            StartupError: a rope_type other than default or yarn.
        """
        theta, yarn = rope_with_scaling_of(hf_config)
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=theta, yarn=yarn,
                    routed_scaling_factor=float(hf_config.routed_scaling_factor))

    def build_rotary(self, spec: LongcatFlashSpec, max_position: int) -> nn.Module:
        """RoPE over the qk_rope_head_dim dims on interleaved pairs, with YaRN if set."""
        return RotaryEmbedding(spec.qk_rope_head_dim, max_position, spec.rope_theta, spec.yarn,
                               interleaved=True)

    def build_attention(self, spec: LongcatFlashSpec, index: int, dtype: torch.dtype,
                        rotary: nn.Module) -> nn.Module:
        """`MLAAttention` with LongCat's LoRA scales: sqrt(H / q_lora_rank) on the softmax
        scale (the query's), sqrt(H / kv_lora_rank) on the latent."""
        qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        scale = qk_head_dim**-0.5 * yarn_softmax_scale_factor(spec.yarn)
        return MLAAttention(
            spec.hidden_size, spec.num_heads, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rotary=rotary,
            attention_bias=spec.attention_bias,
            softmax_scale=scale * (spec.hidden_size / spec.q_lora_rank) ** 0.5,
            latent_scale=(spec.hidden_size / spec.kv_lora_rank) ** 0.5, dtype=dtype,
        )

    def build_mlp(self, spec: LongcatFlashSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """The shortcut MoE of the sublayers in `moe_layers`: softmax routing over the routed
        and zero-computation experts with the correction bias, weights scaled."""
        router = SigmoidGroupedTopKRouter(
            spec.hidden_size, spec.num_experts + spec.zero_experts, spec.top_k, 1, 1, False,
            spec.routed_scaling_factor, scoring="softmax",
        )
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size, False,
            dtype, router=router, zero_experts=spec.zero_experts,
        )

    def build_layer(self, spec: LongcatFlashSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """Sublayer `index` (`ShortcutSublayer`): the MoE in the even ones."""
        return ShortcutSublayer(
            self.build_attention(spec, index, dtype, rotary),
            DenseMLP(spec.hidden_size, spec.intermediate_size, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
            self.build_mlp(spec, index, dtype) if index in spec.moe_layers else None,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H]: the sublayers in
        order, each first one's MoE output carried to the next."""
        h = self.model.embed_tokens(input_ids)
        shortcut = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, shortcut = layer(h, shortcut, positions, meta, kv_cache)
        return self.model.norm(h)
