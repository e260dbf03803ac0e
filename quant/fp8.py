"""FP8 block-quantized checkpoints (e4m3 weights, one ``weight_scale_inv`` per block).

The format DeepSeek-V3/R1/V3.1 and many Qwen3 releases ship, and the layout of vLLM's
``block_quant`` FP8 and transformers' ``FineGrainedFP8``:

- Source of the scheme: DeepSeek-V3 Technical Report (arXiv:2412.19437), section 3.3
  ("fine-grained quantization"): weights are scaled per 128 x 128 block (activations per
  1 x 128 tile, on the fly, which is what ``activation_scheme: "dynamic"`` means).
- Layout (transformers 5.24 ``integrations/finegrained_fp8.py``, ``Fp8Quantize`` /
  ``Fp8Dequantize``; vLLM ``model_executor/layers/quantization/fp8.py`` with
  ``weight_block_size``): a Linear ``M`` is stored as ``M.weight`` ``float8_e4m3fn``
  ``[..., N, K]`` (out, in) and ``M.weight_scale_inv`` float32 (or bf16) ``[..., ceil(N / b0),
  ceil(K / b1)]`` for ``weight_block_size [b0, b1]``; edge blocks are partial. A fused tensor
  not named ``*.weight`` (transformers' ``experts.gate_up_proj`` [E, 2I, H]) keeps its scale
  beside it as ``<name>_scale_inv`` (``Fp8Quantize._quantize_one``'s naming rule).
- Dequantization: ``w[n, k] = float(weight[n, k]) * scale_inv[n // b0, k // b1]``, in float32,
  then cast to the compute dtype (``Fp8Dequantize._dequantize_one``: the same single float32
  multiply, so the results are bit-identical to transformers' dequantization).
- config.json: ``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
  [...]}`` (``ignored_layers`` is MiniMax's alias; ``scale_fmt: "ue8m0"``, DeepSeek-V3.1, means
  the scales are powers of two, stored as float32 or as E8M0 bytes).

The engine serves these weights dequantized (dense layers in the compute dtype; routed experts
likewise, or re-quantized to 4 bits at load time): no FP8 GEMM runs on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

QUANT_METHOD = "fp8"
#: The weight dtype this reader takes (OCP FP8 E4M3, "fn": finite, no infinities).
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3fn magnitude.
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_E8M0_DTYPES = tuple(
    d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None
)
#: Static activation quantization stores one input scale per Linear; this reader has none.
_ACTIVATION_SCALE_SUFFIXES = (".activation_scale", ".input_scale", "_activation_scale")


@dataclass(frozen=True)
class Fp8BlockConfig:
    """A parsed FP8 block ``quantization_config``.

    Attributes:
        weight_block_size: ``(b0, b1)``: output rows and input columns per scale.
        scale_fmt: "float" (any float scale) or "ue8m0" (power-of-two scales; E8M0 bytes are
            accepted as well as float tensors).
        modules_to_not_convert: modules the checkpoint keeps unquantized (informational: the
            stored dtype decides, every float8 tensor needs its scale, nothing else is touched).
    """

    weight_block_size: tuple[int, int]
    scale_fmt: str = "float"
    modules_to_not_convert: tuple[str, ...] = ()


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json quantization_config (fp8): {field} {value!r} {why}")


def parse_fp8_config(hf_config: dict) -> Fp8BlockConfig | None:
    """Read config.json's ``quantization_config`` when its ``quant_method`` is "fp8".

    Args:
        hf_config: config.json as a dict.

    Returns:
        The parsed config, or None for no ``quantization_config`` or another method.

    Raises:
        ValueError: naming the field and value: ``fmt`` other than "e4m3";
            ``activation_scheme`` other than "dynamic" (static needs per-Linear input scales,
            which this engine does not apply); ``weight_block_size`` that is not two positive
            ints (None, per-tensor scales, included); ``scale_fmt`` other than "float" or
            "ue8m0"; ``expert_dtype`` other than "fp8" (DeepSeek-V4's FP4 experts).
    """
    cfg = hf_config.get("quantization_config")
    if not isinstance(cfg, dict) or cfg.get("quant_method") != QUANT_METHOD:
        return None
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "is not supported (only 'e4m3', float8_e4m3fn weights)")
    scheme = cfg.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        raise _refuse(
            "activation_scheme", scheme, "is not supported: only 'dynamic' (a static scheme "
            "stores per-Linear activation scales, which this engine does not apply)"
        )
    block = cfg.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise _refuse(
            "weight_block_size", block, "must be two positive ints [rows, cols] (per-tensor "
            "scales are not supported)"
        )
    scale_fmt = cfg.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise _refuse("scale_fmt", scale_fmt, "is not supported (only 'float' or 'ue8m0')")
    expert_dtype = cfg.get("expert_dtype", "fp8")
    if expert_dtype != "fp8":
        raise _refuse("expert_dtype", expert_dtype, "is not supported (only 'fp8')")
    skip = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or ()
    return Fp8BlockConfig((block[0], block[1]), scale_fmt, tuple(skip))


def scale_inv_name(weight_name: str) -> str:
    """The name of a weight's scale: ``M.weight`` -> ``M.weight_scale_inv``, any other name
    ``X`` -> ``X_scale_inv`` (transformers' ``Fp8Quantize`` rule; both end in the same
    suffix)."""
    return weight_name + SCALE_SUFFIX


def _scale_grid(shape: torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _float_scales(name: str, scale_inv: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """``scale_inv`` as float32 (E8M0 bytes, "ue8m0" only: ``2 ** (byte - 127)``)."""
    if scale_inv.dtype in _FLOAT_SCALE_DTYPES:
        return scale_inv.float()
    if scale_fmt == "ue8m0" and scale_inv.dtype in _E8M0_DTYPES:
        return torch.exp2(scale_inv.view(torch.uint8).float() - 127.0)
    raise ValueError(
        f"fp8: {name}{SCALE_SUFFIX} has dtype {scale_inv.dtype}; expected float32, bfloat16 "
        f"or float16 (or E8M0 bytes with scale_fmt 'ue8m0')"
    )


def dequantize_fp8_block(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype,
    scale_fmt: str = "float",
) -> torch.Tensor:
    """Dequantize one block-quantized FP8 weight: ``float(weight) * scale_inv`` per block.

    Args:
        name: the weight's checkpoint name, for error messages.
        weight: ``[..., N, K]`` ``float8_e4m3fn`` (leading dims: stacked experts).
        scale_inv: ``[..., ceil(N / b0), ceil(K / b1)]`` float32/bf16/fp16 (or E8M0 bytes
            under ``scale_fmt`` "ue8m0"); the block of ``weight[n, k]`` is ``[n // b0, k //
            b1]``, edge blocks partial.
        block_size: ``(b0, b1)`` from ``weight_block_size``.
        dtype: output dtype.

    Returns:
        ``[..., N, K]`` ``dtype``: the float32 product, rounded once to ``dtype``.

    Raises:
        ValueError: a weight that is not float8_e4m3fn or has fewer than 2 dims, or a
            scale_inv whose dtype or shape does not fit (names both shapes).
    """
    if weight.dtype != FP8_DTYPE or weight.dim() < 2:
        raise ValueError(
            f"fp8: {name} must be float8_e4m3fn [..., N, K], got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    want = _scale_grid(weight.shape, block_size)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"fp8: {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight "
            f"{tuple(weight.shape)} with weight_block_size {list(block_size)} needs "
            f"{want} (ceil(N / {block_size[0]}), ceil(K / {block_size[1]}))"
        )
    n, k = weight.shape[-2:]
    scales = _float_scales(name, scale_inv, scale_fmt)
    scales = scales.repeat_interleave(block_size[0], dim=-2)[..., :n, :]
    scales = scales.repeat_interleave(block_size[1], dim=-1)[..., :k]
    return (weight.float() * scales).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` to e4m3 with one float32 scale per block (edge blocks partial), as
    transformers' ``Fp8Quantize`` and DeepSeek's release scripts do: ``scale_inv = amax / 448``
    per block (1 for an all-zero block), ``weight = e4m3(w / scale_inv)``.

    Args:
        w: ``[..., N, K]`` floating, finite.
        block_size: ``(b0, b1)``.

    Returns:
        ``weight`` ``[..., N, K]`` float8_e4m3fn, ``scale_inv`` ``[..., ceil(N/b0),
        ceil(K/b1)]`` float32.

    Raises:
        ValueError: ``w`` not floating with at least 2 dims.
    """
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"w must be a floating tensor [..., N, K], got {w.dtype} {w.dim()}-d")
    n, k = w.shape[-2:]
    b0, b1 = block_size
    rows, cols = -(-n // b0), -(-k // b1)
    padded = torch.zeros(*w.shape[:-2], rows * b0, cols * b1, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    blocks = padded.reshape(*w.shape[:-2], rows, b0, cols, b1)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(padded.shape)[..., :n, :k].contiguous(), scale_inv


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: Fp8BlockConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The loader's stream transform for FP8 checkpoints: pair every float8 tensor with its
    ``_scale_inv`` and yield it dequantized; pass every other tensor through as it is.

    A weight and its scale may arrive in either order and from different shards; the pair is
    yielded (under the weight's name) once both are there. Per-expert names
    (``...experts.E.gate_proj.weight``, DeepSeek-V3's and transformers' saved layout) and
    fused ones (``...experts.gate_up_proj`` + ``gate_up_proj_scale_inv``) both work.

    Args:
        weights: ``(name, tensor)`` pairs as stored (float8 tensors must not have been cast).
        config: the checkpoint's parsed ``quantization_config``.
        dtype: the dtype dequantized weights are yielded in.

    Raises:
        ValueError: a float8 dtype other than e4m3fn, a static activation scale, a weight
            whose scale_inv is missing when the checkpoint ends (or a scale_inv without its
            FP8 weight), or a shape/dtype error of :func:`dequantize_fp8_block`.
    """
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_ACTIVATION_SCALE_SUFFIXES):
            raise ValueError(f"fp8: {name}: static activation scales are not supported")
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name in weights_waiting:
                yield weight_name, _dequantize(
                    weight_name, weights_waiting.pop(weight_name), tensor, config, dtype
                )
            else:
                scales_waiting[weight_name] = tensor
        elif _is_fp8(name, tensor):
            if name in scales_waiting:
                yield name, _dequantize(name, tensor, scales_waiting.pop(name), config, dtype)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting:
        raise ValueError(
            f"fp8: {len(weights_waiting)} float8 weight(s) without their scale, e.g. "
            f"{next(iter(weights_waiting))!r} lacks {scale_inv_name(next(iter(weights_waiting)))!r}"
        )
    if scales_waiting:
        raise ValueError(
            f"fp8: {len(scales_waiting)} scale(s) without a float8 weight, e.g. "
            f"{scale_inv_name(next(iter(scales_waiting)))!r} (no float8_e4m3fn "
            f"{next(iter(scales_waiting))!r} in the checkpoint)"
        )


def is_float8(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds an 8-bit float dtype (any of torch's float8 variants)."""
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


def _is_fp8(name: str, tensor: torch.Tensor) -> bool:
    if not is_float8(tensor) or tensor.dtype in _E8M0_DTYPES:
        return False
    if tensor.dtype != FP8_DTYPE:
        raise ValueError(
            f"fp8: {name} is {tensor.dtype}; only float8_e4m3fn weights (fmt 'e4m3') are "
            f"supported"
        )
    return True


def _dequantize(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, config: Fp8BlockConfig,
    dtype: torch.dtype,
) -> torch.Tensor:
    return dequantize_fp8_block(
        name, weight, scale_inv, config.weight_block_size, dtype, config.scale_fmt
    )
