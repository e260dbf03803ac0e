"""Model registry keyed by config.json "architectures"."""

from __future__ import annotations

from moe_engine.errors import StartupError
from moe_engine.models.gpt_oss import GptOssForCausalLM
from moe_engine.models.mixtral import MixtralForCausalLM
from moe_engine.models.moe_decoder import ArchSpec, MoeCausalLM
from moe_engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[MoeCausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def resolve_architecture(hf_config) -> tuple[str, type[MoeCausalLM]]:
    """The model class for a transformers config.

    Raises:
        StartupError: when no listed architecture is supported; lists the supported ones.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise StartupError(
        f"architectures {archs} in config.json are not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )


__all__ = ["ArchSpec", "MODEL_REGISTRY", "MoeCausalLM", "resolve_architecture"]
