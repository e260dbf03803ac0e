"""Nemotron-H (NVIDIA, "Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer
Models", arXiv:2504.03624; Nemotron-3 Nano MoE; HF `NemotronHForCausalLM`, transformers 5.24
`modeling_nemotron_h.py`).

Every checkpoint layer is one pre-norm residual block h + mixer(norm(h)) whose mixer is named
by `layers_block_type` (older configs: `hybrid_override_pattern`, M * - E): a Mamba-2 layer
("linear_attention", `layers/mamba2.Mamba2Mixer`), GQA attention without position embedding
("full_attention"), a non-gated relu^2 MLP ("mlp") or an MoE block ("moe"). It differs from
the Llama-style decoder in:
- blocks, not layers: the engine groups each Mamba or attention block with the MLP / MoE
  blocks that follow it (those before the first join it in front) into one engine layer
  (`layers/hybrid.BlockSequenceLayer`) that owns one KV cache or state slot; engine layer j
  holds checkpoint layers `spec.block_groups[j]` (the weight names are renamed per instance);
- Mamba-2 layers keep a fixed per-request state (`kv_cache.state`): prefix caching and
  speculative decoding are refused at startup (`build.check_linear_attention`); the prefill
  scan clamps dt at `time_step_min` as transformers does (the decode step does not);
- MoE: sigmoid routing with a correction bias (selection only), group-limited top-k,
  renormalised when `norm_topk_prob`, scaled by `routed_scaling_factor`
  (`routers.SigmoidGroupedTopKRouter`, DeepSeek-V3's rule); non-gated relu^2 experts
  (`kernels.moe.activation.RELU2`: up -> relu^2 -> down, run by the torch expert path, as the
  startup plan says) plus a non-gated relu^2 shared expert.

Checkpoint names: `backbone.embeddings`, `backbone.layers.{i}.norm`, `.mixer.*`
(`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`; `q/k/v/o_proj`;
`up_proj`, `down_proj`; `gate.weight`, `gate.e_score_correction_bias`,
`experts.{e}.{up,down}_proj`, `shared_experts.{up,down}_proj`), `backbone.norm_f`, `lm_head`.
KV cache: one full-attention group of the attention layers; the Mamba layers' state slots.
Nemotron-3's MTP layers (`mtp.*`) are not read, as transformers ignores them.
Not supported (refused naming the field): `moe_latent_size`, an `mlp_hidden_act` other than
relu2, a `mamba_hidden_act` other than silu, two MoE blocks between two mixers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kernels.moe.activation import RELU2
from moe_engine.kv_cache.spec import FULL_ATTENTION, LINEAR_ATTENTION
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.config_fields import remap_layer_types, required_int
from moe_engine.models.layers.decoder import NonGatedMLP
from moe_engine.models.layers.hybrid import BlockSequenceLayer, ResidualBlock
from moe_engine.models.layers.mamba2 import Mamba2Mixer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightMapping

#: `hybrid_override_pattern` characters -> block types (`NemotronHConfig._pattern_to_list`).
PATTERN = {"M": LINEAR_ATTENTION, "*": FULL_ATTENTION, "-": "mlp", "E": "moe"}
#: Blocks that own a cache (the others are MLP / MoE blocks).
MIXERS = (LINEAR_ATTENTION, FULL_ATTENTION)
#: `NemotronHConfig` defaults read here.
DEFAULTS = dict(ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
                conv_kernel=4, chunk_size=128, use_conv_bias=True, use_bias=False,
                mlp_bias=False, time_step_min=0.001, n_group=1, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=1.0, layer_norm_epsilon=1e-5)


@dataclasses.dataclass(frozen=True)
class NemotronHSpec(ArchSpec):
    """`ArchSpec` plus the block grouping, Mamba-2 sizes and routing constants."""

    block_groups: tuple[tuple[tuple[int, str], ...], ...] = ()
    fields: tuple[tuple[str, object], ...] = ()


def _get(cfg: dict, key: str):
    return DEFAULTS[key] if cfg.get(key) is None else cfg[key]


def block_types(cfg: dict) -> list[str]:
    """Each checkpoint layer's block type: `layers_block_type` (or `layer_types`; legacy
    "mamba" / "attention" read as transformers 5 does), else the `hybrid_override_pattern`
    string.

    Raises:
        ValueError: none of them, or an unknown type (named)."""
    types = remap_layer_types(cfg.get("layers_block_type") or cfg.get("layer_types"))
    if not types and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        if set(pattern) - set(PATTERN):
            raise ValueError(f"config.json: hybrid_override_pattern {pattern!r} has characters "
                             f"outside {sorted(PATTERN)}")
        types = [PATTERN[c] for c in pattern]
    if not types or set(types) - {*MIXERS, "mlp", "moe"}:
        raise ValueError(f"config.json: layers_block_type {types} must list 'linear_attention', "
                         "'full_attention', 'mlp' or 'moe' per layer")
    return list(types)


def group_blocks(types: list[str]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """The engine layers: each Mamba / attention block with the MLP / MoE blocks after it (the
    blocks before the first mixer lead the first layer), as ((checkpoint index, type), ...).

    Raises:
        ValueError: no Mamba or attention block, or two MoE blocks in one engine layer."""
    groups: list[list[tuple[int, str]]] = []
    leading: list[tuple[int, str]] = []
    for i, t in enumerate(types):
        if t in MIXERS:
            groups.append([*leading, (i, t)])
            leading = []
        else:
            (groups[-1] if groups else leading).append((i, t))
    if not groups:
        raise ValueError(f"config.json: layers_block_type {types} has no Mamba or attention "
                         "block (every engine layer owns one cache)")
    for g in groups:
        if sum(t == "moe" for _, t in g) > 1:
            raise ValueError(f"config.json: layers {[i for i, _ in g]} hold two MoE blocks "
                             "between two Mamba/attention blocks; not supported")
    return tuple(tuple(g) for g in groups)


def _check(cfg: dict) -> None:
    """Raises: ValueError naming a config value this file does not implement."""
    if cfg.get("moe_latent_size") is not None:
        raise ValueError(f"config.json: moe_latent_size {cfg['moe_latent_size']}: latent MoE "
                         "projections are not supported (null is)")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"config.json: mlp_hidden_act {cfg['mlp_hidden_act']!r} is not "
                         "supported (relu2 is)")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: mamba_hidden_act {cfg['mamba_hidden_act']!r} is not "
                         "supported (silu is)")


class NemotronHForCausalLM(MoeCausalLM):
    """Nemotron-H on the engine's layers (module docstring)."""

    model_types = ("nemotron_h",)
    spec_class = NemotronHSpec
    card = FamilyCard(
        "Nemotron-H", ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",),
        "Mamba-2 + GQA (NoPE); relu^2 experts (torch expert path)",
        cache=("full", "state"), native_4bit=(), speculation=(), load_time_4bit=False,
    )

    def __init__(self, spec: NemotronHSpec, dtype: torch.dtype,
                 max_position: int | None = None) -> None:
        super().__init__(spec, dtype, max_position)
        renames = [("backbone.embeddings.", "model.embed_tokens."),
                   ("backbone.norm_f.", "model.norm.")]
        for j, group in enumerate(spec.block_groups):
            renames += [(f"backbone.layers.{i}.", f"model.layers.{j}.blocks.{k}.")
                        for k, (i, _) in enumerate(group)]
        #: this model's grouping of the checkpoint layers (module docstring)
        self.weight_mapping = WeightMapping(renames=tuple(renames))

    def wants_weight(self, name: str) -> bool:
        """As `MoeCausalLM.wants_weight`, and False for the checkpoint's MTP layers (`mtp.*`,
        which transformers ignores too: `_keys_to_ignore_on_load_unexpected`)."""
        return not name.startswith("mtp.") and super().wants_weight(name)

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:
        """Engine layers by `group_blocks`; MoE layers those holding an MoE block; the
        Mamba-2 state and parameter counts. The dense width counts on every non-MoE engine
        layer (an upper bound: the startup plan's weight bytes).

        Raises:
            ValueError: a missing field (named), a malformed block list, an unsupported value.
        """
        _check(cfg)
        groups = group_blocks(block_types(cfg))
        hidden = required_int(cfg, "hidden_size")
        sizes = dict(num_heads=int(_get(cfg, "mamba_num_heads")),
                     head_dim=int(_get(cfg, "mamba_head_dim")),
                     n_groups=int(_get(cfg, "n_groups")),
                     state_size=int(_get(cfg, "ssm_state_size")),
                     conv_kernel=int(_get(cfg, "conv_kernel")))
        has_mlp = any(t == "mlp" for g in groups for _, t in g)
        fields = cls.moe_shape(
            {**cfg, "num_hidden_layers": len(groups)},
            moe_layers=tuple(j for j, g in enumerate(groups) if any(t == "moe" for _, t in g)),
            attention_bias=False,
            norm_topk_prob=bool(_get(cfg, "norm_topk_prob")),
            shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size")
                                                or 0),
            router_correction_bias=True,
            layer_types=tuple(t for g in groups for _, t in g if t in MIXERS),
            linear_mixer="Mamba-2",
            linear_state=Mamba2Mixer.state_shapes(**sizes),
            linear_mixer_params=Mamba2Mixer.num_params(
                hidden, **sizes, proj_bias=bool(_get(cfg, "use_bias")),
                conv_bias=bool(_get(cfg, "use_conv_bias"))),
        )
        return {**fields, "intermediate_size": int(cfg["intermediate_size"]) if has_mlp else 0}

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The grouping, norm epsilon, Mamba and routing constants (no rope)."""
        cfg = hf_config.to_dict()
        keys = ("ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
                "conv_kernel", "chunk_size", "use_conv_bias", "use_bias", "mlp_bias",
                "time_step_min", "n_group", "topk_group", "routed_scaling_factor")
        return dict(rms_norm_eps=float(_get(cfg, "layer_norm_epsilon")),
                    block_groups=group_blocks(block_types(cfg)),
                    fields=tuple((k, _get(cfg, k)) for k in keys))

    def build_rotary(self, spec: NemotronHSpec, max_position: int) -> None:
        """None: no position embedding (NoPE, `Attention(rotary=None)`)."""
        return None

    def build_layer(self, spec: NemotronHSpec, index: int, dtype: torch.dtype,
                    rotary: nn.Module) -> nn.Module:
        """Engine layer `index`: its checkpoint blocks in order."""
        blocks = [ResidualBlock(self.build_norm(spec, spec.hidden_size, dtype),
                                self._mixer(spec, kind, dtype, rotary), kind in MIXERS)
                  for _, kind in spec.block_groups[index]]
        return BlockSequenceLayer(blocks)

    def _mixer(self, spec: NemotronHSpec, kind: str, dtype: torch.dtype,
               rotary: nn.Module) -> nn.Module:
        """One block's mixer of type `kind`."""
        f, h = dict(spec.fields), spec.hidden_size
        if kind == LINEAR_ATTENTION:
            return Mamba2Mixer(
                h, f["mamba_num_heads"], f["mamba_head_dim"], f["n_groups"],
                f["ssm_state_size"], f["conv_kernel"], spec.rms_norm_eps, dtype,
                proj_bias=bool(f["use_bias"]), conv_bias=bool(f["use_conv_bias"]),
                dt_limit=(float(f["time_step_min"]), float("inf")),
            )  # fmt: skip
        if kind == FULL_ATTENTION:
            return Attention(spec, dtype, rotary, qkv_bias=False, o_bias=False)
        bias = bool(f["mlp_bias"])
        if kind == "mlp":
            return NonGatedMLP(h, spec.intermediate_size, RELU2, dtype, bias)
        router = SigmoidGroupedTopKRouter(
            h, spec.num_experts, spec.top_k, int(f["n_group"]), int(f["topk_group"]),
            spec.norm_topk_prob, float(f["routed_scaling_factor"]),
        )  # fmt: skip
        shared = NonGatedMLP(h, spec.shared_expert_intermediate_size, RELU2, dtype, bias)
        return FusedMoE(spec.num_experts, spec.top_k, h, spec.moe_intermediate_size,
                        spec.norm_topk_prob, dtype, router=router, activation=RELU2,
                        shared_experts=shared)
