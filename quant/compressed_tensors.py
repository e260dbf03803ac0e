"""Read int4 checkpoints in the ``compressed-tensors`` "pack-quantized" format (what
llm-compressor writes and vLLM loads) into this project's int4 representation
(:class:`quant.int4.Int4Weight`).

The engine reads the format itself; the ``compressed-tensors`` library is not imported. The
spec is the library's own source (version 0.20.1, Apache-2.0, github.com/vllm-project/
compressed-tensors):

- ``compressors/pack_quantized/base.py`` (``PackedQuantizationCompressor``): a quantized
  ``Linear`` ``M`` is stored as ``M.weight_packed`` int32 ``[N, ceil(K / 8)]``,
  ``M.weight_scale`` float ``[N, K // group_size]``, ``M.weight_shape`` int ``[2]`` = ``(N, K)``
  and, for asymmetric group/channel schemes only, ``M.weight_zero_point`` int32
  ``[ceil(N / 8), K // group_size]`` (packed along the *output* dimension, ``packed_dim=0``).
- ``compressors/pack_quantized/helpers.py`` (``pack_to_int32``): a signed value ``q`` in
  ``[-8, 7]`` is stored as ``q + 8`` in 4 bits; element ``i`` of a packed row sits at bits
  ``4 * (i % 8)`` .. ``4 * (i % 8) + 3`` of int32 word ``i // 8`` (element 0 in the least
  significant nibble). Zero points are packed the same way, with the same ``+ 8`` offset.
- ``quantization/lifecycle/forward_helpers.py`` (``_dequantize``): ``w = (q - zp) * scale``,
  computed in the scale's dtype; symmetric schemes have no zero point (``zp = 0``).

So the stored nibble ``u = q + 8`` is exactly :mod:`quant.int4`'s offset-binary code, and the
stored zero point ``zp + 8`` is its unsigned zero point: ``(u - (zp + 8)) * scale`` equals the
library's dequantized weight bit for bit (:func:`quant.int4.dequantize_int4` with
``dtype=scale.dtype``).

config.json: ``quantization_config`` with ``quant_method: "compressed-tensors"``, ``format:
"pack-quantized"`` (or ``"mixed-precision"`` with a per-group ``format``), ``config_groups``
each with ``targets`` (module names, ``"re:"`` regexes or the class name ``"Linear"``) and
``weights`` (``num_bits 4, type int, strategy group, group_size, symmetric``), and ``ignore``
(modules left in float, e.g. ``lm_head`` and the MoE router gates). Matching follows the
library's ``utils/match.py`` (``match_name``: ``re.match`` for ``"re:"`` targets, equality
otherwise; ignore wins over targets).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from quant.int4 import Int4Weight, check_group_size
from quant.packing import pack_nibbles

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
#: Suffixes of the per-module tensors a pack-quantized Linear is stored as.
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
#: Preset scheme names (``quantization/quant_scheme.py``) a config group may be given as.
_PRESETS = {"W4A16": (128, True), "W4A16_ASYM": (128, False)}
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # element i at bits 4i..4i+3


@dataclass(frozen=True)
class PackQuantizedScheme:
    """The weight quantization of one config group (4-bit integers, group-wise).

    Attributes:
        name: the config group's key (e.g. "group_0"), for error messages.
        targets: module names, ``"re:"`` regexes or class names the group applies to.
        group_size: input values per scale.
        symmetric: True: no zero points; False: one packed zero point per group.
    """

    name: str
    targets: tuple[str, ...]
    group_size: int
    symmetric: bool


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A parsed ``quantization_config`` of a pack-quantized int4 checkpoint.

    Attributes:
        schemes: the config groups, in config.json order.
        ignore: modules left unquantized (names or ``"re:"`` regexes).
    """

    schemes: tuple[PackQuantizedScheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str) -> PackQuantizedScheme | None:
        """The scheme that quantizes the Linear named ``module``, or None when it stays float.

        Raises:
            ValueError: two config groups target it with different settings.
        """
        if any(_matches(module, ignored) for ignored in self.ignore):
            return None
        found = [s for s in self.schemes if any(_matches(module, t) for t in s.targets)]
        if len({(s.group_size, s.symmetric) for s in found}) > 1:
            raise ValueError(
                f"compressed-tensors: config groups {[s.name for s in found]} all target "
                f"{module!r} with different settings"
            )
        return found[0] if found else None


def _matches(module: str, target: str) -> bool:
    """``match_name`` of compressed-tensors, plus its class match for ``"Linear"`` (every
    pack-quantized tensor belongs to a Linear layer)."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target == module or target == "Linear"


def parse_quantization_config(hf_config: dict) -> CompressedTensorsConfig | None:
    """Read config.json's ``quantization_config`` when it is compressed-tensors.

    Args:
        hf_config: config.json as a dict.

    Returns:
        The parsed config, or None when config.json has no ``quantization_config`` or another
        ``quant_method``.

    Raises:
        ValueError: a compressed-tensors config this reader does not support: a format other
            than pack-quantized, not 4-bit integer group-wise weights, activation
            quantization, activation ordering with a ``g_idx`` ("group"), a KV-cache scheme,
            sparsity, or a status other than "compressed". The message names the field.
    """
    cfg = hf_config.get("quantization_config")
    if not isinstance(cfg, dict) or cfg.get("quant_method") != QUANT_METHOD:
        return None
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(
            f"compressed-tensors: quantization_status {status!r}: only compressed "
            f"checkpoints (quantization_status 'compressed') can be loaded"
        )
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config"):
        if cfg.get(key):
            raise ValueError(f"compressed-tensors: {key} is not supported")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors: quantization_config has no config_groups")
    top_format = cfg.get("format")
    schemes = tuple(_parse_group(name, g, top_format) for name, g in groups.items())
    return CompressedTensorsConfig(schemes=schemes, ignore=tuple(cfg.get("ignore") or ()))


def _parse_group(name: str, group, top_format: str | None) -> PackQuantizedScheme:
    where = f"compressed-tensors: config_groups[{name!r}]"
    if isinstance(group, list):  # a preset name mapped to its targets
        if name.upper() not in _PRESETS:
            raise ValueError(f"{where}: preset {name!r} is not one of {sorted(_PRESETS)}")
        group_size, symmetric = _PRESETS[name.upper()]
        return PackQuantizedScheme(name, tuple(group), group_size, symmetric)
    fmt = group.get("format") or top_format
    if fmt != PACK_QUANTIZED:
        raise ValueError(f"{where}: format {fmt!r} is not supported (only {PACK_QUANTIZED!r})")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise ValueError(f"{where}: {key} quantization is not supported (weight-only)")
    w = group.get("weights") or {}
    expected = {"num_bits": 4, "type": "int", "strategy": "group", "dynamic": False}
    for key, value in expected.items():
        if w.get(key, value) != value:
            raise ValueError(f"{where}: weights.{key} {w.get(key)!r} is not supported ({value!r})")
    if w.get("actorder") in ("group", "dynamic"):
        raise ValueError(
            f"{where}: weights.actorder {w['actorder']!r} (a weight_g_idx per Linear) is not "
            f"supported"
        )
    group_size = w.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{where}: weights.group_size {group_size!r} must be a positive int")
    targets = group.get("targets") or []
    return PackQuantizedScheme(name, tuple(targets), group_size, bool(w.get("symmetric", True)))


def _unpack_nibbles_int32(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``[R, W]`` int32, 8 nibbles per word, element 0 lowest -> ``[R, count]`` uint8 codes."""
    codes = (packed.unsqueeze(-1) >> _NIBBLE_SHIFTS) & 0xF  # arithmetic shift; masked
    return codes.reshape(packed.shape[0], -1)[:, :count].to(torch.uint8)


def _shape_error(module: str, piece: str, got, want) -> ValueError:
    return ValueError(
        f"compressed-tensors: {module}.{piece} has shape {tuple(got)}, expected {tuple(want)}"
    )


def unpack_pack_quantized_int4(
    module: str,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    scheme: PackQuantizedScheme,
) -> Int4Weight:
    """Convert one pack-quantized Linear to :class:`quant.int4.Int4Weight` (lossless).

    Args:
        module: the Linear's name (for error messages), e.g.
            "model.layers.0.mlp.experts.3.gate_proj".
        weight_packed: ``[N, ceil(K / 8)]`` int32, 8 codes ``q + 8`` per word.
        weight_scale: ``[N, K // group_size]`` floating; its dtype is kept.
        weight_shape: ``[2]`` integer tensor ``(N, K)``.
        weight_zero_point: ``[ceil(N / 8), K // group_size]`` int32 (asymmetric), else None.
        scheme: the module's config group.

    Returns:
        ``packed [N, K // 2]`` uint8, ``scales`` as given, ``zeros [N, K // group_size]`` uint8
        (``zp + 8``) or None.

    Raises:
        ValueError: a dtype, shape or zero-point presence that does not fit the scheme; the
            message names the tensor, the shape found and the shape expected.
    """
    if weight_shape.numel() != 2 or weight_shape.is_floating_point():
        raise ValueError(
            f"compressed-tensors: {module}.weight_shape must hold 2 integers (N, K), got "
            f"{weight_shape.tolist()}"
        )
    n, k = (int(v) for v in weight_shape.tolist())
    try:
        check_group_size(k, scheme.group_size)
    except ValueError as e:
        raise ValueError(f"compressed-tensors: {module}: {e}") from e
    num_groups = k // scheme.group_size
    if weight_packed.dtype != torch.int32:
        raise ValueError(
            f"compressed-tensors: {module}.weight_packed must be int32, got {weight_packed.dtype}"
        )
    if tuple(weight_packed.shape) != (n, -(-k // 8)):
        raise _shape_error(module, "weight_packed", weight_packed.shape, (n, -(-k // 8)))
    if not weight_scale.is_floating_point():
        raise ValueError(
            f"compressed-tensors: {module}.weight_scale must be floating, got {weight_scale.dtype}"
        )
    if tuple(weight_scale.shape) != (n, num_groups):
        raise _shape_error(module, "weight_scale", weight_scale.shape, (n, num_groups))
    zeros = None
    if scheme.symmetric != (weight_zero_point is None):
        raise ValueError(
            f"compressed-tensors: {module}: config group {scheme.name!r} is "
            f"{'symmetric' if scheme.symmetric else 'asymmetric'} but the checkpoint "
            f"{'has' if weight_zero_point is not None else 'lacks'} weight_zero_point"
        )
    if weight_zero_point is not None:
        want = (-(-n // 8), num_groups)
        if weight_zero_point.dtype != torch.int32 or tuple(weight_zero_point.shape) != want:
            raise _shape_error(module, "weight_zero_point", weight_zero_point.shape, want)
        zeros = _unpack_nibbles_int32(weight_zero_point.t(), n).t().contiguous()
    codes = _unpack_nibbles_int32(weight_packed, k)
    return Int4Weight(pack_nibbles(codes, f"{module}.weight_packed"), weight_scale, zeros)


def assemble_pack_quantized(
    weights: Iterable[tuple[str, torch.Tensor]], config: CompressedTensorsConfig
) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """Group each pack-quantized Linear's tensors and convert them, passing the rest through.

    The pieces of one Linear may arrive in any order and from different shards; each Linear
    is yielded once all of its pieces arrived, as ``("<module>.weight", Int4Weight)``.

    Args:
        weights: ``(name, tensor)`` pairs of a checkpoint.
        config: the checkpoint's parsed quantization config.

    Yields:
        ``(name, tensor)`` for plain tensors, ``(module + ".weight", Int4Weight)`` for
        pack-quantized Linears.

    Raises:
        ValueError: a pack-quantized tensor of a module no config group quantizes (or that
            ``ignore`` lists), a ``weight_g_idx``, a module whose pieces are incomplete when
            the checkpoint ends (names the missing ones), or a conversion error of
            :func:`unpack_pack_quantized_int4`.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, piece = name.rpartition(".")
        if piece == "weight_g_idx":
            raise ValueError(
                f"compressed-tensors: {name}: activation ordering with g_idx is not supported"
            )
        if piece not in PACKED_SUFFIXES:
            yield name, tensor
            continue
        scheme = config.scheme_for(module)
        if scheme is None:
            raise ValueError(
                f"compressed-tensors: {name} is pack-quantized, but no config group of "
                f"quantization_config targets {module!r} (or it is in ignore)"
            )
        parts = pending.setdefault(module, {})
        parts[piece] = tensor
        if _missing(parts, scheme):
            continue
        del pending[module]
        yield f"{module}.weight", unpack_pack_quantized_int4(
            module,
            parts["weight_packed"],
            parts["weight_scale"],
            parts["weight_shape"],
            parts.get("weight_zero_point"),
            scheme,
        )
    if pending:
        module, parts = next(iter(pending.items()))
        raise ValueError(
            f"compressed-tensors: {len(pending)} pack-quantized module(s) incomplete, e.g. "
            f"{module!r} lacks {_missing(parts, config.scheme_for(module))}"
        )


def _missing(parts: dict[str, torch.Tensor], scheme: PackQuantizedScheme | None) -> list[str]:
    need = ["weight_packed", "weight_scale", "weight_shape"]
    if scheme is not None and not scheme.symmetric:
        need.append("weight_zero_point")
    return [p for p in need if p not in parts]
