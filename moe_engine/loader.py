"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a model.

Safetensors only (never pickle); single file, sharded with `model.safetensors.index.json`, or
any `*.safetensors` in the directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moe_engine.errors import StartupError
from moe_engine.models import MoeCausalLM
from quant.compressed_tensors import CompressedTensorsConfig, assemble_pack_quantized

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files, in a stable order.

    Raises:
        StartupError: when the directory has no .safetensors file.
    """
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise StartupError(f"model: no *.safetensors files in {str(root)!r} (pickle is not loaded)")
    return files


def iterate_weights(
    model_dir: str | Path,
    dtype: torch.dtype,
    progress: bool = True,
    wants: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor `wants(name)` accepts (default: all), floating
    ones cast to `dtype`; tensors it refuses are never read from disk."""
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if wants is not None and not wants(name):
                    continue
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor


def load_model(
    model: MoeCausalLM,
    model_dir: str | Path,
    dtype: torch.dtype,
    checkpoint_quant: CompressedTensorsConfig | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint.

    Args:
        checkpoint_quant: config.json's compressed-tensors config when the checkpoint stores
            Linears pack-quantized: their tensors are assembled into int4 weights
            (`quant.compressed_tensors.assemble_pack_quantized`); scales are cast to `dtype`
            like every floating tensor (as vLLM loads them in the model dtype).

    Raises:
        StartupError: a parameter the checkpoint does not provide, or a tensor that does not fit.
    """
    try:
        weights = iterate_weights(model_dir, dtype, wants=model.wants_weight)
        if checkpoint_quant is not None:
            weights = assemble_pack_quantized(weights, checkpoint_quant)
        loaded = model.load_weights(weights)
    except ValueError as e:
        raise StartupError(str(e)) from e
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        raise StartupError(
            f"checkpoint {str(model_dir)!r} lacks {len(missing)} weight(s), e.g. {missing[:8]}"
        )
    logger.info("loaded %d parameter tensors from %s", len(loaded), model_dir)
