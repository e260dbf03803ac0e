"""Model registry keyed by config.json "architectures": one line per architecture, naming the
module (under `moe_engine/models/`) whose class of that name implements it (`base.py` says
what such a file holds). Modules are imported on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from moe_engine.errors import StartupError
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.spec import ArchSpec
from moe_engine.startup import quant_config
from moe_engine.startup.config import read_config_json
from moe_engine.startup.model_shape import ModelShape
from moe_engine.startup.quant_config import QuantConfig

#: config.json architecture name -> the module holding the class of that name.
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "moe_engine.models.qwen3_moe",
    "MixtralForCausalLM": "moe_engine.models.mixtral",
    "GptOssForCausalLM": "moe_engine.models.gpt_oss",
    "Glm4MoeForCausalLM": "moe_engine.models.glm4_moe",
    "Qwen2MoeForCausalLM": "moe_engine.models.qwen2_moe",
    "DeepseekV3ForCausalLM": "moe_engine.models.deepseek_v3",
    "DeepseekV2ForCausalLM": "moe_engine.models.deepseek_v2",
    "Qwen3NextForCausalLM": "moe_engine.models.qwen3_next",
    "Qwen3_5MoeForCausalLM": "moe_engine.models.qwen3_next",
    "Dots1ForCausalLM": "moe_engine.models.dots1",
    "ExaoneMoeForCausalLM": "moe_engine.models.exaone_moe",
    "Cohere2MoeForCausalLM": "moe_engine.models.cohere2_moe",
    "SolarOpenForCausalLM": "moe_engine.models.solar_open",
    "HYV3ForCausalLM": "moe_engine.models.hy_v3",
    "AfmoeForCausalLM": "moe_engine.models.afmoe",
    "OlmoeForCausalLM": "moe_engine.models.olmoe",
    "FlexOlmoForCausalLM": "moe_engine.models.olmoe",
    "PhimoeForCausalLM": "moe_engine.models.phimoe",
    "GraniteMoeForCausalLM": "moe_engine.models.granitemoe",
    "GraniteMoeSharedForCausalLM": "moe_engine.models.granitemoe",
    "DbrxForCausalLM": "moe_engine.models.dbrx",
    "JetMoeForCausalLM": "moe_engine.models.jetmoe",
    "MiniMaxM2ForCausalLM": "moe_engine.models.minimax_m2",
    "HunYuanMoEV1ForCausalLM": "moe_engine.models.hunyuan_v1_moe",
    "Ernie4_5_MoeForCausalLM": "moe_engine.models.ernie4_5_moe",
    "MellumForCausalLM": "moe_engine.models.mellum",
    "AriaTextForCausalLM": "moe_engine.models.aria_text",
    "Llama4ForCausalLM": "moe_engine.models.llama4",
    "FlintForCausalLM": "moe_engine.models.flint",
    "MiMoV2FlashForCausalLM": "moe_engine.models.mimo_v2_flash",
    "Glm4MoeLiteForCausalLM": "moe_engine.models.glm4_moe_lite",
    "LongcatFlashForCausalLM": "moe_engine.models.longcat_flash",
    "Mistral4ForCausalLM": "moe_engine.models.mistral4",
    "AXK1ForCausalLM": "moe_engine.models.axk1",
    "DeepseekV32ForCausalLM": "moe_engine.models.deepseek_v32",
    "Dots3NoteForCausalLM": "moe_engine.models.dots3_note",
    "GlmMoeDsaForCausalLM": "moe_engine.models.glm_moe_dsa",
    "AXK2ForCausalLM": "moe_engine.models.axk2",
    "GraniteMoeHybridForCausalLM": "moe_engine.models.granitemoehybrid",
    "JambaForCausalLM": "moe_engine.models.jamba",
    "GraniteMoeSWAForCausalLM": "moe_engine.models.granitemoe_swa",
    "NemotronHForCausalLM": "moe_engine.models.nemotron_h",
    "Lfm2MoeForCausalLM": "moe_engine.models.lfm2_moe",
    "MiniMaxForCausalLM": "moe_engine.models.minimax",
    "KimiLinearForCausalLM": "moe_engine.models.kimi_linear",
    "Kolibri1ForCausalLM": "moe_engine.models.kolibri1",
    "LagunaForCausalLM": "moe_engine.models.laguna",
    "BeamForCausalLM": "moe_engine.models.beam",
    "LaraMiniForCausalLM": "moe_engine.models.lara_mini",
    "BailingHybridForCausalLM": "moe_engine.models.bailing_hybrid",
}

#: Architectures refused with their reason rather than as merely unknown.
REFUSED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV4ForCausalLM": (
        "DeepSeek-V4 is not supported: its hyper-connections (hc_mult={hc_mult} residual "
        "streams mixed around every layer), compressed sparse attention (HCA / CSA compressors "
        "with their own compressed-KV caches beside a sliding window) and hash routing are not "
        "implemented (this engine has DeepSeek Sparse Attention over uncompressed MLA only)"
    ),
    "HYV4ForCausalLM": (
        "Hunyuan-V4 is not supported: its hyper-connections (DeepSeek-V4's hc_mult={hc_mult} "
        "residual streams mixed around every layer) are not implemented, nor attention sinks "
        "on sparse MLA"
    ),
    "ZayaForCausalLM": (
        "ZAYA's Compressed Convolutional Attention is not implemented: its q/k pass through a "
        "causal depthwise + grouped conv1d (cca_time0={cca_time0}, cca_time1={cca_time1} taps) "
        "and half of each value head comes from the previous token, a per-request conv and "
        "delayed-value state beside the KV cache; nor its router, an MLP fed the previous "
        "layer's router state (EDA) with a skip expert, and float32 residual scaling"
    ),
    "DogeForCausalLM": (
        "Doge's dynamic-mask attention is not implemented (a per-key, per-KV-head additive bias "
        "exp(A * softplus(dt_proj(V))) on the scores, and past keep_window_size="
        "{keep_window_size} keys only the highest-biased ones kept per query); nor its CDMoE "
        "(product-key routing over single-neuron embedding experts, whose router logits are "
        "split across the tokens of a forward pass, so a chunked prefill cannot repeat them)"
    ),
    "Gemma4ForCausalLM": (
        "Gemma 4's text decoder is not supported (enable_moe_block={enable_moe_block}): the "
        "engine lacks gated GELU-tanh experts and MLPs (hidden_activation="
        "{hidden_activation}; its fused experts compute SwiGLU with silu only), an MoE block "
        "beside the dense MLP with its own sandwich norms and a normalised, scaled router with "
        "per-expert scales, global layers of another head dim and KV head count than the "
        "sliding ones in one KV cache (global_head_dim, attention_k_eq_v={attention_k_eq_v}), "
        "KV shared across layers (num_kv_shared_layers={num_kv_shared_layers}) and per-layer "
        "input embeddings (hidden_size_per_layer_input={hidden_size_per_layer_input})"
    ),
    "InklingForCausalLM": (
        "Inkling's text decoder is not implemented: hidden-state-conditioned relative position "
        "logits added to the attention scores (rel_extent={rel_extent} distances), sliding "
        "layers with their own head counts and head dim (swa_head_dim={swa_head_dim}), short "
        "convolutions and a normed embedding"
    ),
    "Inkling2ForCausalLM": (
        "Inkling2's text decoder is not implemented: a relative position bias with L2-clipped "
        "queries and keys (qk_l2_clip_threshold={qk_l2_clip_threshold}), dynamic short "
        "convolutions, softcapped SwiGLU experts (mlp_gate_softcap={mlp_gate_softcap}) and "
        "attention residuals over blocks of n_layers_per_attn_res_block="
        "{n_layers_per_attn_res_block} layers"
    ),
    "Inkling2LoopForCausalLM": (
        "Inkling2-Loop's text decoder is not implemented: Inkling2's layers (relative position "
        "bias, dynamic short convolutions, softcapped SwiGLU experts, block attention "
        "residuals) run loop_num_passes={loop_num_passes} times over layers "
        "{loop_layer_index_start}..{loop_layer_index_end}, mixed by message gates"
    ),
    "Qwen4ExpForCausalLM": (
        "Qwen4-Exp's text decoder is not implemented: QSA attention (an indexer over "
        "compressed key blocks, indexer_budget={indexer_budget}), hashed n-gram per-layer "
        "embeddings (ple_layer_ids) and hyper-connection residual streams (hc_count={hc_count}) "
        "beside its Gated DeltaNet layers"
    ),
    "MiniMaxM3VLForCausalLM": (
        "MiniMax-M3's block-sparse attention is not implemented: its indexer max-pools key "
        "scores into blocks of index_block_size={index_block_size} keys and keeps "
        "index_topk_blocks={index_topk_blocks} blocks plus index_local_blocks="
        "{index_local_blocks} local ones per query, a block-granular selection (the engine's "
        "DeepSeek Sparse Attention selects single keys)"
    ),
}


def architecture_class(name: str) -> type[MoeCausalLM]:
    """The model class registered as `name` (imports its module)."""
    return getattr(importlib.import_module(ARCHITECTURES[name]), name)


def _unsupported(archs: list, cfg: dict | None = None) -> StartupError:
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            reason = REFUSED_ARCHITECTURES[arch].format_map(_Fields(cfg or {}))
            return StartupError(f"architectures {archs} in config.json: {reason}")
    return StartupError(
        f"architectures {archs} in config.json are not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


class _Fields(dict):
    """config.json fields for a refusal's message; an absent one reads as "?"."""

    def __missing__(self, key: str) -> str:
        return "?"


def resolve_architecture(hf_config) -> tuple[str, type[MoeCausalLM]]:
    """The (architecture name, model class) for a transformers config: the first of its
    "architectures" that is registered.

    Raises:
        StartupError: when no listed architecture is supported; lists the supported ones.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, architecture_class(arch)
    raise _unsupported(archs, hf_config.to_dict() if hasattr(hf_config, "to_dict") else None)


def resolve_config_dict(cfg: dict) -> tuple[str, type[MoeCausalLM]]:
    """`resolve_architecture` for a config.json dict; a dict without "architectures" is
    matched by its `model_type` (the classes' `model_types`).

    Raises:
        StartupError: no supported architecture (lists the supported ones).
    """
    archs = list(cfg.get("architectures") or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, architecture_class(arch)
    if not archs:
        for arch in ARCHITECTURES:
            if cfg.get("model_type") in architecture_class(arch).model_types:
                return arch, architecture_class(arch)
    raise _unsupported(archs or [cfg.get("model_type")], cfg)


def model_shape(cfg: dict) -> ModelShape:
    """The `ModelShape` of a config.json dict (transformers 4.x or 5.x keys), read by its
    architecture's file.

    Raises:
        StartupError: an unsupported architecture; ValueError: a missing or malformed field.
    """
    return resolve_config_dict(cfg)[1].model_shape(cfg)


def checkpoint_shape(path: str | Path) -> ModelShape:
    """`model_shape` of `path/config.json`.

    Raises:
        FileNotFoundError, ValueError: `startup.config.read_config_json`'s errors;
        StartupError: an unsupported architecture.
    """
    return model_shape(read_config_json(path))


def resolve_quant_config(
    quant: QuantConfig, hf_config: dict, weight_dtype: torch.dtype | None = None
) -> QuantConfig:
    """`startup.quant_config.resolve_quant_config` with this registry's architectures (its
    checks read the experts' shapes and checkpoint names from the architecture class).

    Raises:
        ValueError: as `startup.quant_config.resolve_quant_config`; StartupError: an
            unsupported architecture, where a check needs it.
    """
    return quant_config.resolve_quant_config(
        quant, hf_config, weight_dtype, architecture=lambda cfg: resolve_config_dict(cfg)[1]
    )


__all__ = [
    "checkpoint_shape",
    "resolve_quant_config",
    "ARCHITECTURES",
    "REFUSED_ARCHITECTURES",
    "ArchSpec",
    "MoeCausalLM",
    "architecture_class",
    "model_shape",
    "resolve_architecture",
    "resolve_config_dict",
]
