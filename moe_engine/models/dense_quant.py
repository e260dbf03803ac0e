"""`--quantized-layers all`: the dense projections in 4 bits, as a Q4_0 GGUF holds them.

With the routed experts 4-bit (`--quantization int4|mxfp4`), a batch-1 decode step of the
benchmark's model still reads most of its bytes from the bfloat16 attention projections and LM
head (bench/NOTES.md section 20). `quantize_dense_layers` quantizes every dense `Linear` of the
model with the experts' method (int4: symmetric, `--quant-group-size`; MXFP4: blocks of 32),
except the layers whose precision routing or attention depends on directly: the routers and
gates (`mlp.gate`, shared-expert gates, Qwen3-Next's `in_proj_b`/`in_proj_a`/`in_proj_ba`),
and MLA's `kv_b_proj`, whose weight the absorbed attention reads itself. The embeddings and
norms keep the model dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.models.layers.linear import Linear

logger = logging.getLogger(__name__)

#: Module names (their last component) that stay in the model dtype.
KEPT_DENSE = frozenset({"gate", "expert_gate", "kv_b_proj", "in_proj_b", "in_proj_a",
                        "in_proj_ba"})


def dense_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    """The (name, module) pairs `quantize_dense_layers` quantizes, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and name.rsplit(".", 1)[-1] not in KEPT_DENSE]


def quantize_dense_layers(model: nn.Module, method: str, group_size: int,
                          scale_dtype: torch.dtype) -> int:
    """Quantize the model's dense projections (`dense_layers`) to 4 bits; returns the bytes
    the 4-bit copies hold (codes and scales).

    Args:
        model: the loaded model (weights in place, before `bind_kernels`).
        method: "int4" or "mxfp4"; group_size: int4 values per scale; scale_dtype: the int4
            scales' dtype.

    Raises:
        StartupError: a layer whose input width the group (MXFP4: 32) does not divide; the
            message names the layer, its width and the group sizes that fit.
    """
    group = 32 if method == "mxfp4" else group_size
    total = before = 0
    layers = dense_layers(model)
    for name, layer in layers:
        k = layer.in_features
        if k % group:
            fits = [g for g in (32, 64, 128) if k % g == 0]
            hint = (f"--quant-group-size {' or '.join(map(str, fits))} fits it" if fits and
                    method == "int4" else "leave --quantized-layers at experts")
            raise StartupError(f"--quantized-layers all: {name} has {k} inputs, not a multiple "
                               f"of the {method} group of {group}; {hint}")
        try:
            layer.quantize(method, group, scale_dtype)
        except ValueError as e:
            raise StartupError(f"--quantized-layers all: {name}: {e}") from e
        total += layer.q4_packed().nbytes
        before += layer.weight.numel() * layer.weight.element_size()
    logger.info("dense layers quantized to %s: %d projections, %.1f MiB (from %.1f MiB)",
                method, len(layers), total / 2**20, before / 2**20)
    return total
