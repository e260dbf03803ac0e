"""`QuantConfig` (4-bit routed experts) and its resolution against config.json: what
`--quantization` / `--quant-group-size` ask for, checked against the format the checkpoint
stores (compressed-tensors int4, gpt-oss MXFP4, FP8 blocks) and the dimensions it groups.

User mistakes raise `ValueError` naming the field, the value and the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch


class Architecture(Protocol):
    """What quantization checks need of an architecture class (`models.base.MoeCausalLM`)."""

    @classmethod
    def model_shape(cls, cfg: dict) -> Any: ...

    @classmethod
    def experts_width_field(cls, cfg: dict) -> str: ...

    @classmethod
    def checkpoint_expert_name(cls, layer: int, expert: int, projection: str) -> str: ...


#: config.json dict -> its architecture class (the caller's model registry).
ArchitectureOf = Callable[[dict], Architecture]

#: Dtype names the flags and config.json use.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class QuantConfig:
    """4-bit routed experts.

    Attributes:
        method: "none", "int4" (group-wise symmetric, `quant.int4`) or "mxfp4" (OCP MX v1.0,
            `quant.mxfp4`); the routed experts of a float checkpoint are quantized at load time,
            attention, router and embeddings keep the model dtype. "auto" (like "none") serves
            the experts as the checkpoint stores them; `resolve_quant_config` turns it into
            one of the others.
        group_size: int4 values per scale (32, 64 or 128).
        symmetric: int4 without zero points (load-time quantization is always symmetric; a
            pre-quantized checkpoint may be asymmetric).
        checkpoint_format: None when experts are quantized at load time (or not at all);
            "compressed-tensors" when the checkpoint stores them int4 already
            (`quant.compressed_tensors`), "mxfp4" when it stores them MXFP4 (gpt-oss
            `*_blocks` / `*_scales`); set by `resolve_quant_config`.
        scale_dtype: the int4 scales' dtype, "bfloat16", "float16" or "float32": the
            checkpoint's weight dtype (`resolve_quant_config`), so a 16-bit checkpoint keeps
            16-bit scales; None (unresolved) counts as float32.
        layers: "experts" (the default: only the routed experts are 4-bit) or "all": the
            dense projections too (attention QKV and output, dense and shared-expert MLPs, the
            LM head; not the router, the gates, the embeddings or MLA's kv_b_proj), quantized
            at load time with `method` (int4: symmetric, `group_size`; mxfp4), as a Q4_0 GGUF
            holds them (`--quantized-layers`).
    """

    method: str = "none"
    group_size: int = 128
    symmetric: bool = True
    checkpoint_format: str | None = None
    scale_dtype: str | None = None
    layers: str = "experts"

    @property
    def bits_per_weight(self) -> float | None:
        """Storage per expert weight (bits): 4 plus the scale's share; None when unquantized.

        int4 keeps one `scale_dtype` scale per group (16 or 32 bits; 4.5 bits per weight for
        16-bit scales in groups of 32), plus a uint8 zero point when asymmetric; MXFP4 one
        8-bit E8M0 scale per 32 values. (The native kernel's layout; the torch fallback's
        int4 matmul stores a bfloat16 scale and offset pair per group instead.)
        """
        if self.method == "int4":
            scale_bits = 8 * DTYPES[self.scale_dtype or "float32"].itemsize
            return 4 + (scale_bits + (0 if self.symmetric else 8)) / self.group_size
        if self.method == "mxfp4":
            return 4 + 8 / 32
        return None

    def __post_init__(self) -> None:
        if self.method not in ("none", "auto", "int4", "mxfp4"):
            raise ValueError(
                f"quantization must be one of none, auto, int4, mxfp4; got {self.method!r}"
            )
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"quant group_size must be 32, 64 or 128, got {self.group_size}")
        if self.scale_dtype is not None and self.scale_dtype not in DTYPES:
            raise ValueError(
                f"quant scale_dtype {self.scale_dtype!r} must be one of {', '.join(DTYPES)}"
            )
        if self.layers not in QUANTIZED_LAYERS:
            raise ValueError(
                f"quantized_layers must be one of {', '.join(QUANTIZED_LAYERS)}; got "
                f"{self.layers!r}"
            )
        if self.layers == "all" and self.method == "none":
            raise ValueError(
                "quantized_layers 'all' (--quantized-layers all) needs --quantization int4 or "
                "mxfp4 (or auto with a 4-bit checkpoint); got --quantization none"
            )
        formats = {CHECKPOINT_INT4_FORMAT: "int4", CHECKPOINT_MXFP4_FORMAT: "mxfp4"}
        if self.checkpoint_format is not None and (
            formats.get(self.checkpoint_format) != self.method
        ):
            raise ValueError(
                f"quant checkpoint_format {self.checkpoint_format!r} with method "
                f"{self.method!r}: experts load pre-quantized only as int4 "
                f"({CHECKPOINT_INT4_FORMAT}) or mxfp4 ({CHECKPOINT_MXFP4_FORMAT})"
            )


#: `QuantConfig.layers` values (`--quantized-layers`).
QUANTIZED_LAYERS = ("experts", "all")
#: The pre-quantized expert formats `resolve_quant_config` recognises in config.json.
CHECKPOINT_INT4_FORMAT = "compressed-tensors"
CHECKPOINT_MXFP4_FORMAT = "mxfp4"  # gpt-oss: quantization_config {"quant_method": "mxfp4"}
#: FP8 block-quantized checkpoints (`quant.fp8`): dequantized while loading.
CHECKPOINT_FP8_METHOD = "fp8"
#: model_type values whose checkpoints may store MXFP4 experts (`*_blocks` / `*_scales`).
_MXFP4_MODEL_TYPES = ("gpt_oss",)


def resolve_quant_config(
    quant: QuantConfig,
    hf_config: dict,
    weight_dtype: torch.dtype | None = None,
    *,
    architecture: ArchitectureOf,
) -> QuantConfig:
    """The expert format to run: `--quantization` against what config.json says is stored.

    An FP8 block-quantized checkpoint (quant_method "fp8", `quant.fp8`) is dequantized while
    loading, so its experts arrive as float tensors: every --quantization value applies to it
    as to a float checkpoint (none/auto: dequantized experts; int4/mxfp4: re-quantized).
    A checkpoint whose routed experts are compressed-tensors pack-quantized int4
    (`quant.compressed_tensors`) is served as stored, with --quantization none or auto, or int4
    with the checkpoint's group size; a gpt-oss checkpoint with MXFP4 experts (quant_method
    "mxfp4", `*_blocks` / `*_scales`) likewise, with none, auto or mxfp4. Without such experts,
    "auto" becomes "none" and the others stand (load-time quantization of float experts).

    Args:
        quant: the requested configuration (flags).
        hf_config: config.json as a dict.
        weight_dtype: the dtype the checkpoint's weights load in (`ModelConfig.torch_dtype`):
            int4 scales are kept in it (`QuantConfig.scale_dtype`); None leaves scale_dtype
            as it is.
        architecture: config.json dict -> its architecture class (the model registry's
            `resolve_config_dict(cfg)[1]`); called only when a check needs the shapes.

    Raises:
        ValueError: a quantization_config this engine cannot load, a group size the int4 path
            lacks, or an explicit --quantization / --quant-group-size that conflicts with the
            checkpoint (the message names both and the flag that fixes it).
    """
    resolved = _resolve_method(quant, hf_config, architecture)
    if weight_dtype is not None and resolved.method == "int4" and resolved.scale_dtype is None:
        names = {dtype: name for name, dtype in DTYPES.items()}
        resolved = replace(resolved, scale_dtype=names.get(weight_dtype, "float32"))
    return resolved


def _resolve_method(
    quant: QuantConfig, hf_config: dict, architecture: ArchitectureOf
) -> QuantConfig:
    """`resolve_quant_config` without the scale dtype."""
    from quant.compressed_tensors import parse_quantization_config

    if quant.checkpoint_format is not None:  # resolved already
        return quant
    stored_config = hf_config.get("quantization_config")
    stored = stored_config.get("quant_method") if isinstance(stored_config, dict) else None
    if stored == CHECKPOINT_MXFP4_FORMAT:
        return _resolve_mxfp4_checkpoint(quant, hf_config)
    if stored == CHECKPOINT_FP8_METHOD:
        return _resolve_fp8_checkpoint(quant, hf_config, architecture)
    ct = parse_quantization_config(hf_config)
    if ct is None and hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method")
        raise ValueError(
            f"config.json quantization_config: quant_method {method!r} is not supported "
            f"(only {CHECKPOINT_INT4_FORMAT!r} pack-quantized int4, {CHECKPOINT_FP8_METHOD!r} "
            f"block-quantized e4m3, and {CHECKPOINT_MXFP4_FORMAT!r} for gpt-oss)"
        )
    scheme = _expert_scheme(ct, architecture(hf_config), hf_config) if ct is not None else None
    if scheme is None:
        if quant.method in ("int4", "mxfp4"):
            check_quant_divides(quant, architecture(hf_config), hf_config)
        return _auto_to_none(quant)
    stored = (
        f"int4 group {scheme.group_size} {'symmetric' if scheme.symmetric else 'asymmetric'} "
        f"({CHECKPOINT_INT4_FORMAT} pack-quantized, config group {scheme.name!r})"
    )
    if scheme.group_size not in (32, 64, 128):
        raise ValueError(
            f"the checkpoint's experts are {stored}; the int4 path needs group size 32, 64 or 128"
        )
    if quant.method == "mxfp4" or (
        quant.method == "int4" and quant.group_size != scheme.group_size
    ):
        asked = f"--quantization {quant.method}" + (
            f" --quant-group-size {quant.group_size}" if quant.method == "int4" else ""
        )
        raise ValueError(
            f"{asked} conflicts with the checkpoint, whose experts are {stored}; pass "
            f"--quantization auto (or int4 with --quant-group-size {scheme.group_size})"
        )
    return QuantConfig(
        "int4", scheme.group_size, scheme.symmetric, CHECKPOINT_INT4_FORMAT, quant.scale_dtype,
        quant.layers,
    )


def _auto_to_none(quant: QuantConfig) -> QuantConfig:
    """"auto" over a checkpoint without 4-bit experts: "none" (others stand).

    Raises:
        ValueError: --quantized-layers all with auto there (no method to quantize with).
    """
    if quant.method != "auto":
        return quant
    if quant.layers == "all":
        raise ValueError(
            "--quantized-layers all with --quantization auto: this checkpoint's experts are "
            "not 4-bit, so there is no method to quantize the dense layers with; pass "
            "--quantization int4 or mxfp4"
        )
    return replace(quant, method="none")


def _resolve_fp8_checkpoint(
    quant: QuantConfig, hf_config: dict, architecture: ArchitectureOf
) -> QuantConfig:
    """An FP8 block-quantized checkpoint: its quantization_config is checked here (before any
    weight is read); its experts load dequantized, so --quantization is resolved as for a
    float checkpoint (no value conflicts with it).

    Raises:
        ValueError: an FP8 config `quant.fp8.parse_fp8_config` refuses, or a 4-bit group that
            does not divide the experts (`check_quant_divides`).
    """
    from quant.fp8 import parse_fp8_config

    parse_fp8_config(hf_config)
    if quant.method in ("int4", "mxfp4"):
        check_quant_divides(quant, architecture(hf_config), hf_config)
    return _auto_to_none(quant)


def check_quant_divides(quant: QuantConfig, model_cls: Architecture, hf_config: dict) -> None:
    """Refuse load-time 4-bit experts whose group does not divide a dimension it groups, before
    any weight is read (`model_cls`: the checkpoint's architecture class). Groups run along
    each expert projection's input: hidden_size for the gate/up projection (w13 [2I, H]), the
    expert width I for the down projection (w2 [H, I]).

    Raises:
        ValueError: naming the dimension by its config.json name and value, the group size, and
            the flag value that fits (--quant-group-size; MXFP4's block is always 32).
    """
    shape = model_cls.model_shape(hf_config)
    dims = {
        "hidden_size": shape.hidden_size,
        model_cls.experts_width_field(hf_config): shape.moe_intermediate_size,
    }
    group = quant.group_size if quant.method == "int4" else 32
    bad = next((name for name, size in dims.items() if size % group), None)
    if bad is None:
        return
    what = f"--quant-group-size {group}" if quant.method == "int4" else "MXFP4's block of 32"
    fits = [g for g in (32, 64, 128) if all(size % g == 0 for size in dims.values())]
    both = " and ".join(f"{name}={size}" for name, size in dims.items())
    fix = (
        f"pass --quantization int4 --quant-group-size {fits[-1]} (it divides {both})"
        if fits
        else f"no int4 group size (32, 64, 128) divides {both}: pass --quantization none"
    )
    raise ValueError(
        f"{what} does not divide the experts' {bad}={dims[bad]} (config.json); {fix}"
    )


def _resolve_mxfp4_checkpoint(quant: QuantConfig, hf_config: dict) -> QuantConfig:
    """A gpt-oss checkpoint whose experts are MXFP4 (quant_method "mxfp4"): served as stored
    with --quantization none, auto or mxfp4.

    Raises:
        ValueError: another model type, or --quantization int4 (names the flag to use).
    """
    model_type = hf_config.get("model_type")
    if model_type not in _MXFP4_MODEL_TYPES:
        raise ValueError(
            f"config.json quantization_config: quant_method 'mxfp4' is supported for "
            f"{', '.join(_MXFP4_MODEL_TYPES)} checkpoints only, not model_type {model_type!r}"
        )
    if quant.method == "int4":
        raise ValueError(
            "--quantization int4 conflicts with the checkpoint, whose experts are mxfp4 "
            "(quantization_config quant_method 'mxfp4'); pass --quantization auto (or mxfp4)"
        )
    return QuantConfig("mxfp4", 32, True, CHECKPOINT_MXFP4_FORMAT, layers=quant.layers)


def _expert_scheme(ct, model_cls: Architecture, hf_config: dict):
    """The compressed-tensors scheme of the first MoE layer's expert 0 (its gate projection,
    named as the architecture's checkpoint names it), or None when the routed experts stay
    float."""
    layers = model_cls.model_shape(hf_config).moe_layers
    if not layers:
        return None
    return ct.scheme_for(model_cls.checkpoint_expert_name(layers[0], 0, "gate"))
