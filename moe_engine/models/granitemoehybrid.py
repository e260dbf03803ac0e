"""Granite-4.0-H (IBM, "Granite 4.0" model cards, 2025; HF `GraniteMoeHybridForCausalLM`,
transformers 5.24 `modeling_granitemoehybrid.py`).

A hybrid decoder: layers whose `layer_types` entry is "linear_attention" mix tokens with a
Mamba-2 layer (`layers/mamba2.Mamba2Mixer`, grouped B/C, gated group RMSNorm), the
"full_attention" ones with GQA attention. It differs from the Llama-style decoder in:
- Mamba-2 layers keep a fixed per-request state instead of a KV cache (`kv_cache.state`), so
  prefix caching and speculative decoding are refused at startup
  (`build.check_linear_attention`);
- the attention has no rope unless `position_embedding_type` is "rope" (NoPE otherwise) and
  its softmax scale is `attention_multiplier`, not head_dim ** -0.5;
- Granite's multipliers: embeddings times `embedding_multiplier`, each block's output times
  `residual_multiplier` before its residual add, logits divided by `logits_scaling`;
- every layer's feed-forward is the routed experts (top-k of the router logits, then softmax
  over the k: `topk_softmax`, experts of width `intermediate_size`) plus a shared SwiGLU MLP
  (`shared_mlp`, width `shared_intermediate_size`: the block's `SharedExperts`).

Checkpoint names: `model.layers.{i}.mamba.*` (`Mamba2Mixer`) or `.self_attn.{q,k,v,o}_proj`,
`.block_sparse_moe.input_linear.weight` [E, 2I, H] (gate rows, then up), `.output_linear.
weight` [E, H, I], `.router.layer.weight` [E, H], `.shared_mlp.input_linear` [2S, H] and
`.output_linear`, `input_layernorm`, `post_attention_layernorm`. KV cache: one full-attention
group of the attention layers; the Mamba layers' state slots beside it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import check_hidden_act, remap_layer_types, required_int
from moe_engine.models.layers.hybrid import HybridDecoderLayer
from moe_engine.models.layers.mamba2 import Mamba2Mixer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `GraniteMoeHybridConfig` defaults of the Mamba-2 layers.
MAMBA_DEFAULTS = dict(mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
                      mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)


@dataclasses.dataclass(frozen=True)
class GraniteMoeHybridSpec(ArchSpec):
    """`ArchSpec` (whose `embedding_multiplier` and `logits_scaling` the base applies) plus the
    Mamba-2 sizes, Granite's attention and residual multipliers, rope on or off."""

    mamba: tuple[tuple[str, object], ...] = ()
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    use_rope: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))


def mamba_sizes(cfg: dict) -> dict:
    """The Mamba-2 layer sizes of a Granite-4.0-H config.json (its defaults applied; head dim
    "auto": mamba_expand x hidden_size / mamba_n_heads).

    Raises:
        ValueError: an intermediate size the heads do not divide.
    """
    m = {k: v if cfg.get(k) is None else cfg[k] for k, v in MAMBA_DEFAULTS.items()}
    inter = int(m["mamba_expand"]) * required_int(cfg, "hidden_size")
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inter // int(m["mamba_n_heads"]) if head_dim in (None, "auto") else int(head_dim)
    if head_dim * int(m["mamba_n_heads"]) != inter:
        raise ValueError(f"config.json: mamba_n_heads {m['mamba_n_heads']} x mamba_d_head "
                         f"{head_dim} must equal mamba_expand x hidden_size = {inter}")
    return dict(num_heads=int(m["mamba_n_heads"]), head_dim=head_dim,
                n_groups=int(m["mamba_n_groups"]), state_size=int(m["mamba_d_state"]),
                conv_kernel=int(m["mamba_d_conv"]), proj_bias=bool(m["mamba_proj_bias"]),
                conv_bias=bool(m["mamba_conv_bias"]))


class GraniteMoeHybridForCausalLM(MoeCausalLM):
    """Granite-4.0-H on the engine's layers (module docstring)."""

    model_types = ("granitemoehybrid",)
    spec_class = GraniteMoeHybridSpec
    weight_mapping = WeightMapping(renames=(
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
        (".shared_mlp.input_linear.", ".block_sparse_moe.shared_experts.gate_up_proj."),
        (".shared_mlp.output_linear.", ".block_sparse_moe.shared_experts.down_proj."),
    ))
    card = FamilyCard(
        "Granite-4.0-H", ("ibm-granite/granite-4.0-h-tiny", "ibm-granite/granite-4.0-h-small"),
        "Mamba-2 + GQA (NoPE or rope), Granite multipliers, a shared MLP",
        cache=("full", "state"), native_4bit=(), speculation=(),
    )

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        return "intermediate_size"

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Every layer MoE with a shared MLP; `layer_types` (default all Mamba) and the
        Mamba-2 state and parameter counts.

        Raises:
            ValueError: a required field missing (named), num_local_experts 0 (a dense
                Granite-4.0-H), a malformed layer_types.
        """
        layers = required_int(cfg, "num_hidden_layers")
        if not int(cfg.get("num_local_experts", 8) or 0):
            raise ValueError("config.json: num_local_experts 0 (a dense Granite-4.0-H) is not "
                             "supported: this architecture file serves the MoE variants")
        types = tuple(remap_layer_types(cfg.get("layer_types") or cfg.get("layers_block_type"))
                      or (LINEAR_ATTENTION,) * layers)
        if len(types) != layers or not set(types) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
            raise ValueError(f"config.json: layer_types {list(types)} must give "
                             f"'linear_attention' or 'full_attention' for each of {layers} layers")
        sizes = mamba_sizes(cfg)
        state = Mamba2Mixer.state_shapes(**{k: sizes[k] for k in (
            "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel")})
        return cls.moe_shape(
            {**cfg, "num_local_experts": cfg.get("num_local_experts", 8)},
            moe_layers=tuple(range(layers)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
            layer_types=types,
            linear_mixer="Mamba-2",
            linear_state=state,
            linear_mixer_params=Mamba2Mixer.num_params(required_int(cfg, "hidden_size"), **sizes),
        )

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """Norm epsilon, rope, the Mamba sizes and the multipliers.

        Raises:
            ValueError: hidden_act other than silu; StartupError: a rope_type other than
                default.
        """
        cfg = hf_config.to_dict()
        check_hidden_act(cfg, cls.__name__)
        use_rope = getattr(hf_config, "position_embedding_type", None) == "rope"
        limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
        return dict(
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta_of(hf_config) if use_rope else 10000.0,
            mamba=tuple(mamba_sizes(cfg).items()),
            embedding_multiplier=float(hf_config.embedding_multiplier),
            residual_multiplier=float(hf_config.residual_multiplier),
            attention_multiplier=float(hf_config.attention_multiplier),
            logits_scaling=float(hf_config.logits_scaling),
            use_rope=use_rope,
            dt_limit=(float(limit[0]), float(limit[1])),
        )

    def build_rotary(self, spec: GraniteMoeHybridSpec, max_position: int) -> nn.Module | None:
        """Plain rope when `position_embedding_type` is "rope", else None (NoPE)."""
        if spec.use_rope:
            return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta)
        return None

    def build_layer(self, spec: GraniteMoeHybridSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """A `HybridDecoderLayer`: Mamba-2 or attention, then the experts + shared MLP."""
        if spec.layer_types[index] == LINEAR_ATTENTION:
            m = dict(spec.mamba)
            name, mixer = "mamba", Mamba2Mixer(
                spec.hidden_size, m["num_heads"], m["head_dim"], m["n_groups"],
                m["state_size"], m["conv_kernel"], spec.rms_norm_eps, dtype,
                proj_bias=m["proj_bias"], conv_bias=m["conv_bias"], dt_limit=spec.dt_limit,
            )  # fmt: skip
        else:
            name, mixer = "self_attn", Attention(spec, dtype, rotary, o_bias=spec.o_proj_bias,
                                                 scale=spec.attention_multiplier)
        norm = self.build_norm
        return HybridDecoderLayer(name, mixer, "block_sparse_moe", self._moe(spec, dtype),
                                  norm(spec, spec.hidden_size, dtype),
                                  "post_attention_layernorm", norm(spec, spec.hidden_size, dtype),
                                  spec.residual_multiplier)

    @staticmethod
    def _moe(spec: GraniteMoeHybridSpec, dtype: torch.dtype) -> FusedMoE:
        """The routed experts (top-k then softmax) with the shared MLP (`shared_mlp`: one
        fused gate|up projection) as their shared experts, when it has a width."""
        width = spec.shared_expert_intermediate_size
        shared = None
        if width:
            shared = SharedExperts(spec.hidden_size, width, dtype, fused_gate_up=True)
        return FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size,
                        spec.moe_intermediate_size, True, dtype, routing="topk_softmax",
                        shared_experts=shared)

