"""`MoeCausalLM`, the base of every architecture file (its numbers: `models.spec.ArchSpec`).

An architecture is one file under `moe_engine/models/` with one subclass of `MoeCausalLM`
named as config.json's "architectures" entry, registered by one line in `models/__init__.py`.
The subclass states, as class attributes and hooks:
- config.json -> numbers: `shape_fields(cfg)` (the `model_shape.ModelShape` sizes the startup
  arithmetic needs, from the raw dict), `spec_fields(hf_config)` (what the forward pass needs
  beyond sizes, from the transformers config), `spec_class` (an `ArchSpec` subclass when it
  has more fields), `model_types` (config.json `model_type` values, for configs without
  "architectures"), `experts_width_field`;
- modules: `build_rotary`, `build_norm`, `build_attention(spec, index, ...)`,
  `build_mlp(spec, index, ...)` and, for a layer of another structure, `build_layer`; the
  defaults are the Llama-style blocks of `layers/decoder.py`;
- checkpoint names: `weight_mapping` (`weight_mapping.WeightMapping`), applied by the shared
  `WeightLoader`;
- KV cache: `kv_cache_groups_for(spec)`, the layers by attention kind;
- the README's families-table row: `card` (`models.spec.FamilyCard`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from moe_engine.kv_cache.spec import AttentionGroup
from moe_engine.models.config_fields import moe_shape_fields
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.decoder import Backbone, DecoderLayer, DenseMLP
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.mtp import MTPLayer
from moe_engine.models.layers.native_decode import DecodeStep
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, rope_theta_of
from moe_engine.models.layers.self_attention import Attention
from moe_engine.models.spec import ArchSpec, FamilyCard
from moe_engine.models.weight_mapping import WeightLoader, WeightMapping
from moe_engine.phase_timer import PhaseTimer
from moe_engine.startup.model_shape import ModelShape


class MoeCausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm, LM head (module names as the
    Hugging Face checkpoints': `model.embed_tokens`, `model.layers.{i}.self_attn` / `.mlp` /
    `.input_layernorm` / `.post_attention_layernorm`, `model.norm`, `lm_head`).

    Args:
        spec: the architecture's numbers (`arch_spec`); dtype: parameter dtype.
        max_position: positions the rotary table covers (tokens); default the model's
            max_position_embeddings (the engine passes max_model_len).
    """

    #: The spec dataclass `arch_spec` builds.
    spec_class: ClassVar[type[ArchSpec]] = ArchSpec
    #: config.json `model_type` values of this architecture (configs without "architectures").
    model_types: ClassVar[tuple[str, ...]] = ()
    #: How the checkpoint's names map onto the modules.
    weight_mapping: ClassVar[WeightMapping] = WeightMapping()
    #: The config.json field counting the checkpoint's MTP layers (None: the architecture
    #: has none this engine can build, `build_mtp_layer`).
    mtp_layers_field: ClassVar[str | None] = None
    #: What the README's families table says of it (`models/families.py`; every registered
    #: class has one).
    card: ClassVar[FamilyCard | None] = None

    def __init__(self, spec: ArchSpec, dtype: torch.dtype, max_position: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        rotary = self.build_rotary(spec, max_position or spec.max_position_embeddings)
        layers = [self.build_layer(spec, i, dtype, rotary) for i in range(spec.num_layers)]
        embed = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.model = Backbone(embed, layers, self.build_norm(spec, spec.hidden_size, dtype))
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=spec.lm_head_bias,
                              dtype=dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        #: The MTP layers (`layers/mtp.py`), empty unless `spec.num_mtp_layers`.
        self.mtp_layers = nn.ModuleList(
            self.build_mtp_layer(spec, j, dtype, rotary) for j in range(spec.num_mtp_layers)
        )

    # -- config.json -------------------------------------------------------------------------

    @classmethod
    def shape_fields(cls, cfg: dict) -> dict:  # pragma: no cover - abstract
        """The `ModelShape` fields from a config.json dict (`config_fields` has the common
        readers). Reads sizes only: nothing here may need transformers' defaults.

        Raises:
            ValueError: a missing or malformed field, naming it.
        """
        raise NotImplementedError

    @classmethod
    def spec_fields(cls, hf_config) -> dict:
        """The `spec_class` fields beyond `ModelShape`'s, from a transformers config; default
        `rms_norm_eps` and `rope_theta` (plain RoPE).

        Raises:
            StartupError: a rope_type this engine does not implement.
        """
        return dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=rope_theta_of(hf_config))

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str:
        """The config.json key holding one routed expert's width I (errors name it)."""
        return "moe_intermediate_size"

    def float32_weight_names(self) -> frozenset[str]:
        """Parameters and persistent buffers the model holds in float32 while its dtype is
        lower (the float32 routers and correction biases of DeepSeek and GLM, transformers'
        `_keep_in_fp32_modules_strict`): the loader leaves their checkpoint tensors unrounded.
        Empty for a float32 model."""
        if self.lm_head.weight.dtype == torch.float32:
            return frozenset()
        tensors = [*self.named_parameters(), *self.named_buffers()]
        return frozenset(name for name, t in tensors if t.dtype == torch.float32)

    @classmethod
    def moe_shape(cls, cfg: dict, *, moe_layers: tuple[int, ...], **fields) -> dict:
        """`config_fields.moe_shape_fields` with this class's name and `experts_width_field`
        (what every `shape_fields` passes), then `fields`, the architecture's own.

        Raises:
            ValueError: a required field missing (named).
        """
        return moe_shape_fields(
            cfg,
            architecture=cls.__name__,
            experts_width_field=cls.experts_width_field(cfg),
            moe_layers=moe_layers,
            **fields,
        )

    @classmethod
    def checkpoint_expert_name(cls, layer: int, expert: int, projection: str) -> str:
        """The checkpoint module name of one expert projection ("gate" | "up" | "down") in
        decoder layer `layer` (compressed-tensors schemes are looked up by it), e.g.
        "model.layers.0.block_sparse_moe.experts.0.w1"."""
        name = cls.weight_mapping.experts.name_of(projection)
        model_name = f"model.layers.{layer}.mlp.experts.{expert}.{name}"
        return cls.weight_mapping.checkpoint_name(model_name)

    @classmethod
    def model_shape(cls, cfg: dict) -> ModelShape:
        """The `ModelShape` of a config.json dict (the startup plan's input)."""
        return ModelShape(**cls.shape_fields(cfg))

    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:
        """The spec from a transformers config: `shape_fields` of its dict, `spec_fields`.

        Raises:
            ValueError: a missing or malformed field; StartupError: an unsupported feature.
        """
        return cls.spec_class(**cls.shape_fields(hf_config.to_dict()), **cls.spec_fields(hf_config))

    @classmethod
    def kv_cache_groups_for(cls, spec: ArchSpec) -> list[AttentionGroup]:
        """The layers by attention kind, (kind, sliding window or None, layer indices), from
        which the engine makes its KV-cache groups (`kv_cache.make_kv_cache_groups`) before the
        model is built; default `spec.attention_groups()` (config.json `layer_types`: one
        full-attention group with every layer unless some layers are sliding). MTP layers
        (`num_mtp_layers`) join the first group as layers num_layers.. (their KV sits at the
        same positions and block ids as the main model's)."""
        return with_mtp_layers(spec.attention_groups(), spec)

    def kv_cache_groups(self) -> list[AttentionGroup]:
        """`kv_cache_groups_for(self.spec)`."""
        return self.kv_cache_groups_for(self.spec)

    # -- modules -----------------------------------------------------------------------------

    def build_rotary(self, spec: ArchSpec, max_position: int) -> nn.Module:
        """The rotary module every layer's attention shares; default plain RoPE over the whole
        head."""
        return RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta)

    def build_norm(self, spec: ArchSpec, size: int, dtype: torch.dtype) -> nn.Module:
        """A norm over `size` features (the layers' two and the final one)."""
        return RMSNorm(size, spec.rms_norm_eps, dtype=dtype)

    def build_attention(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Layer `index`'s attention; default `Attention`, sliding where `layer_types` says,
        without rotary in `spec.nope_layers`."""
        sliding = bool(spec.layer_types) and spec.layer_types[index] == "sliding_attention"
        rotary = None if index in spec.nope_layers else rotary
        return Attention(spec, dtype, rotary, spec.sliding_window if sliding else None)

    def build_mlp(self, spec: ArchSpec, index: int, dtype: torch.dtype) -> nn.Module:
        """Layer `index`'s MLP; default a softmax-top-k `FusedMoE` on `spec.moe_layers`, a
        `DenseMLP` of `intermediate_size` elsewhere."""
        if index not in spec.moe_layers:
            return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)
        return FusedMoE(
            spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.norm_topk_prob, dtype,
        )

    def build_layer(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """Decoder layer `index`: the pre-norm `DecoderLayer` of the hooks above."""
        return DecoderLayer(
            self.build_attention(spec, index, dtype, rotary),
            self.build_mlp(spec, index, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
            self.build_norm(spec, spec.hidden_size, dtype),
        )

    def build_mtp_layer(
        self, spec: ArchSpec, j: int, dtype: torch.dtype, rotary: nn.Module
    ) -> nn.Module:
        """MTP layer `j` (`layers/mtp.py`, decoder index num_layers + j): the architecture's
        own block, its attention as the last decoder layer's (same kind), an MoE MLP when the
        model has routed experts (DeepSeek-V3's and GLM-4.5's MTP layers are MoE layers)."""
        index = spec.num_layers + j
        mlp_spec = dataclasses.replace(spec, moe_layers=(index,)) if spec.moe_layers else spec
        norm = self.build_norm
        return MTPLayer(
            self.build_attention(spec, spec.num_layers - 1, dtype, rotary),
            self.build_mlp(mlp_spec, index, dtype),
            norm(spec, spec.hidden_size, dtype), norm(spec, spec.hidden_size, dtype),
            enorm=norm(spec, spec.hidden_size, dtype), hnorm=norm(spec, spec.hidden_size, dtype),
            head_norm=norm(spec, spec.hidden_size, dtype), hidden_size=spec.hidden_size,
            dtype=dtype,
        )  # fmt: skip

    def moe_layers(self) -> list[tuple[int, FusedMoE]]:
        """(decoder layer index, its `FusedMoE` block) for every layer that has one, in layer
        order."""
        return [
            (i, m) for i, layer in enumerate(self.model.layers)
            for m in layer.modules() if isinstance(m, FusedMoE)
        ]

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H]. The layers share one
        `DecodeStep` (a decode step's checked inputs, None where no native kernel could take
        the step); one with a native decode kernel updates h in place (the embedding's fresh
        output)."""
        h = self.model.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            h = h * self.spec.embedding_multiplier
        layers = self.model.layers
        step = DecodeStep.of(h, positions, meta, self.spec.top_k, len(layers))
        residual = None  # the stream is h + residual: each add is fused into the next norm
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(h, residual, positions, meta, kv_cache, step)
        if step is not None:  # the native layers' routing, as FusedMoE.forward records its own
            step.record_routing()
        if residual is None:
            return self.model.norm(h)
        return self.model.norm(h, residual)[0]

    def attach_timer(self, timer: PhaseTimer) -> None:
        """Time attention and the MoE blocks' phases of every layer into `timer`."""
        for layer in self.model.layers:
            layer.timer = timer
        for _, moe in self.moe_layers():
            moe.timer = timer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] float32 (divided by `spec.logits_scaling`, in
        the model dtype as transformers' Granite does, where it is not 1)."""
        logits = self.lm_head(hidden)
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        return logits.float()

    # -- weights -----------------------------------------------------------------------------

    def expected_weight_names(self) -> set[str]:
        """Every piece `load_weights` must fill (`WeightLoader.expected_names`)."""
        return WeightLoader(self).expected_names()

    def zero_absent_weights(self, missing: Iterable[str]) -> list[str]:
        """Zero the `missing` pieces (of `expected_weight_names`) the checkpoint may lack
        (`WeightMapping.optional`); returns the rest (`WeightLoader.zero_absent`)."""
        return WeightLoader(self).zero_absent(missing)

    def checkpoint_names_of(self, pieces: Iterable[str]) -> list[str]:
        """`expected_weight_names` pieces as checkpoint tensor names
        (`WeightLoader.checkpoint_names`)."""
        return WeightLoader(self).checkpoint_names(pieces)

    def wants_weight(self, name: str) -> bool:
        """False for a checkpoint tensor of an expert this rank does not hold, or of a layer
        beyond num_layers (a multi-token-prediction layer): the loader then never reads it;
        True for everything else."""
        return self._weight_loader().wants(name)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_experts_loaded: Callable[[FusedMoE], None] | None = None,
    ) -> set[str]:
        """Copy checkpoint tensors into the parameters through `weight_mapping`; returns the
        pieces filled (names as in `expected_weight_names`). `on_experts_loaded` is called
        with each MoE block once its local float experts are all in (`WeightLoader`).

        Raises:
            ValueError: an unexpected tensor name or a shape mismatch (names both shapes).
        """
        try:
            return WeightLoader(self, on_experts_loaded).load(weights)
        finally:  # it holds the parameters as they were: the float experts a 4-bit block drops
            self.__dict__.pop("_wants_loader", None)

    def _weight_loader(self) -> WeightLoader:
        """The loader `wants_weight` asks, made once per load: it reads only the module tree and
        the blocks' expert slots, which neither sharding nor loading replace (`load_weights` and
        `expected_weight_names` make their own, as loading swaps parameters); `load_weights`
        drops it when done."""
        loader = self.__dict__.get("_wants_loader")
        if loader is None:
            loader = self.__dict__["_wants_loader"] = WeightLoader(self)
        return loader

    def weight_bytes_by_kind(self) -> dict[str, int]:
        """Bytes the loaded weights take, by kind, read from the tensors themselves
        (parameters, persistent buffers and 4-bit expert copies; a tied lm_head counts once).

        With `--quantized-layers all` a dense projection counts its float weight and its 4-bit
        copy (`Linear.quantized_copy_bytes`): both are held.

        Returns:
            experts: routed experts (float w13/w2, or the 4-bit weights with their scales);
            attention: q/k/v/o projections and q/k norms; embeddings: embed_tokens and
            lm_head; other: router gates (and their correction biases), shared experts
            (replicated on every rank, like the dense MLPs), dense MLPs, layer norms and the
            rest (bytes).
        """
        sizes = dict.fromkeys(("experts", "attention", "embeddings", "other"), 0)
        tensors = list(self.named_parameters())
        for prefix, module in self.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    tensors.append((f"{prefix}.{name}", buf))
        for name, t in tensors:
            sizes[_weight_kind(name)] += t.numel() * t.element_size()
        for prefix, module in self.named_modules():
            if isinstance(module, Linear):
                sizes[_weight_kind(f"{prefix}.weight")] += module.quantized_copy_bytes()
        for _, moe in self.moe_layers():
            if moe.quantized is not None:
                sizes["experts"] += moe.quantized.nbytes
        return sizes


def with_mtp_layers(groups: list[AttentionGroup], spec: ArchSpec) -> list[AttentionGroup]:
    """`groups` with the MTP layers' indices (num_layers..) added to the first one (full
    attention or MLA, which every architecture with MTP layers uses throughout)."""
    if not spec.num_mtp_layers:
        return groups
    kind, window, layers = groups[0]
    mtp = tuple(range(spec.num_layers, spec.num_layers + spec.num_mtp_layers))
    return [(kind, window, layers + mtp), *groups[1:]]


def _weight_kind(name: str) -> str:
    """"experts", "attention", "embeddings" or "other" for a parameter or buffer name."""
    if name.endswith((".w13", ".w2", ".b13", ".b2")):
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return "embeddings"
    return "other"
