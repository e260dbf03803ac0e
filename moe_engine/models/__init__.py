"""Model registry keyed by config.json "architectures": one line per architecture, naming the
module (under `moe_engine/models/`) whose class of that name implements it (`base.py` says
what such a file holds). Modules are imported on first use.
"""

from __future__ import annotations

import importlib

from moe_engine.errors import StartupError
from moe_engine.models.base import ArchSpec, MoeCausalLM
from moe_engine.plan import ModelShape

#: config.json architecture name -> the module holding the class of that name.
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "moe_engine.models.qwen3_moe",
    "MixtralForCausalLM": "moe_engine.models.mixtral",
    "GptOssForCausalLM": "moe_engine.models.gpt_oss",
    "Glm4MoeForCausalLM": "moe_engine.models.glm4_moe",
    "Qwen2MoeForCausalLM": "moe_engine.models.qwen2_moe",
}


def architecture_class(name: str) -> type[MoeCausalLM]:
    """The model class registered as `name` (imports its module)."""
    return getattr(importlib.import_module(ARCHITECTURES[name]), name)


def _unsupported(archs: list) -> StartupError:
    return StartupError(
        f"architectures {archs} in config.json are not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


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
    raise _unsupported(archs)


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
    raise _unsupported(archs or [cfg.get("model_type")])


def model_shape(cfg: dict) -> ModelShape:
    """The `ModelShape` of a config.json dict, read by its architecture's file (what
    `ModelShape.from_hf_config` returns).

    Raises:
        StartupError: an unsupported architecture; ValueError: a missing or malformed field.
    """
    return resolve_config_dict(cfg)[1].model_shape(cfg)


__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "MoeCausalLM",
    "architecture_class",
    "model_shape",
    "resolve_architecture",
    "resolve_config_dict",
]
