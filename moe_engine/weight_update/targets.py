"""Where each tensor of a weight update goes, decided from its name, dtype and shape alone.

An update is checked whole before any tensor is read (`resolve_targets`): every name must be
one the model's checkpoint has (the architecture's `WeightMapping`, as the startup loader
applies it), every shape the model's, every dtype one the target takes. What this rank does
not hold (another rank's experts, an MTP layer the model does not run, a tied LM head) is
resolved to `Skip`, so one update serves every rank of an expert-parallel engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_engine.models.base import MoeCausalLM
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.weight_mapping import WeightLoader, beyond_num_layers, mtp_model_name
from moe_engine.weight_update.messages import TensorMeta
from quant.mxfp4 import MXFP4_BLOCK_SIZE

#: dtypes an update may carry for a floating parameter (cast to the parameter's on arrival).
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightUpdateError(ValueError):
    """An update refused before any weight changed.

    Attributes:
        field: the part of the update at fault ("tensors", "path", a tensor's name, ...).
        message: names the tensor, the value and what the model expects.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass(frozen=True)
class ParamTarget:
    """A parameter (or persistent buffer) `param`, whole, or the rows of merged shard
    `shard` (q/k/v of `qkv_proj`)."""

    param: str
    shard: str | None = None


@dataclass(frozen=True)
class ExpertTarget:
    """One expert's projection ("gate" | "up" | "down") in MoE block `block`."""

    block: str
    expert: int
    proj: str


@dataclass(frozen=True)
class FusedExpertTarget:
    """All experts of one projection in one tensor: `shard` "gate_up" | "down", `kind` ""
    (weights), "_bias", "_blocks" or "_scales" (MXFP4, kept packed); `in_out`: stored
    [E, in, out]; `interleaved`: gate/up features alternate (gpt-oss)."""

    block: str
    shard: str
    kind: str
    in_out: bool
    interleaved: bool


@dataclass(frozen=True)
class Skip:
    """A tensor this rank does not hold (the reason, for the log)."""

    reason: str


Target = ParamTarget | ExpertTarget | FusedExpertTarget | Skip


def resolve_targets(
    model: MoeCausalLM, metas: list[TensorMeta], checkpoint_mtp_layers: int = 0
) -> list[Target]:
    """The target of every tensor, in order.

    Args:
        checkpoint_mtp_layers: MTP layers the served checkpoint declares (config.json
            `num_nextn_predict_layers` / `num_mtp_layers`): tensors of those layers are
            skipped when the model does not run them, as the startup loader skips them; any
            other layer beyond `num_hidden_layers` is refused.

    Raises:
        WeightUpdateError: an empty update, a name given twice, a name the model's checkpoint
            does not have, a shape or dtype the target does not take (each names the tensor
            and both values).
    """
    if not metas:
        raise WeightUpdateError("tensors", "tensors: the update names no tensor")
    seen: set[str] = set()
    for meta in metas:
        if meta.name in seen:
            raise WeightUpdateError(meta.name, f"tensor {meta.name!r} appears twice in the update")
        seen.add(meta.name)
    loader = WeightLoader(model)
    return [_resolve(loader, meta, checkpoint_mtp_layers) for meta in metas]


def _resolve(loader: WeightLoader, meta: TensorMeta, checkpoint_mtp_layers: int) -> Target:
    name = meta.name
    if beyond_num_layers(name, loader.num_layers):
        mtp = mtp_model_name(name, loader.num_layers, loader.num_mtp_layers)
        if mtp is not None:
            name = mtp
        elif beyond_num_layers(name, loader.num_layers + checkpoint_mtp_layers):
            raise WeightUpdateError(
                meta.name, f"tensor {meta.name!r}: the model has {loader.num_layers} layers"
                f"{f' and {checkpoint_mtp_layers} MTP layers' if checkpoint_mtp_layers else ''}",
            )
        else:
            return Skip("an MTP layer of the checkpoint the model does not run")
    name = loader.mapping.model_name(name)
    if m := loader.match_expert(name):
        return _expert(loader, meta, m[1], int(m[2]), loader.shard_of(m[3]))
    if (m := loader.match_fused(name)) and m[1] in loader.moes:
        return _fused(loader, meta, m[1], m[2], m[3] or "")
    for merged, part, shard in loader.mapping.stacked_params:
        target = name.replace(part, merged)
        module = loader.merged.get(target.rpartition(".")[0])
        if part in name and module is not None and target in loader.params:
            rows = module.shards[shard][1]
            want = (rows, *loader.params[target].shape[1:])
            _check(meta, want, _float_dtype(meta))
            return ParamTarget(target, shard)
    if name == "lm_head.weight" and getattr(loader.model.spec, "tie_word_embeddings", False):
        _check(meta, tuple(loader.params["model.embed_tokens.weight"].shape), _float_dtype(meta))
        return Skip("lm_head is tied to embed_tokens")
    param = loader.params.get(name)
    if param is None:
        raise WeightUpdateError(
            meta.name, f"tensor {meta.name!r} has no place in {type(loader.model).__name__} "
            f"(not a name of this architecture's checkpoint)",
        )
    exact = str(param.dtype).removeprefix("torch.")
    _check(meta, tuple(param.shape), _float_dtype(meta) if param.is_floating_point() else exact)
    return ParamTarget(name)


def _expert(loader: WeightLoader, meta: TensorMeta, block: str, expert: int, proj: str
            ) -> Target:
    moe = loader.moes.get(block)
    if moe is None:
        raise WeightUpdateError(meta.name, f"tensor {meta.name!r}: {block} has no routed experts")
    if not 0 <= expert < moe.num_experts:
        raise WeightUpdateError(
            meta.name, f"tensor {meta.name!r}: expert {expert} is outside [0, {moe.num_experts})"
        )
    h, i = moe.gate.in_features, moe.intermediate_size
    _check(meta, (h, i) if proj == "down" else (i, h), _float_dtype(meta))
    if not moe.local_slots(expert):
        return Skip("another rank holds this expert")
    return ExpertTarget(block, expert, proj)


def _fused(loader: WeightLoader, meta: TensorMeta, block: str, proj: str, kind: str) -> Target:
    e = loader.mapping.experts
    moe = loader.moes[block]
    gate_up = proj == e.fused_gate_up
    shard = "gate_up" if gate_up else "down"
    n, h, i = moe.num_experts, moe.gate.in_features, moe.intermediate_size
    rows, cols = (2 * i, h) if gate_up else (h, i)
    if kind in ("_blocks", "_scales"):
        if moe.quantized is None or moe.quantized.method != "mxfp4":
            raise WeightUpdateError(
                meta.name, f"tensor {meta.name!r}: MXFP4 {kind[1:]} for experts that this "
                f"engine holds as {_format(moe)}; send float weights instead",
            )
        want = (n, rows, cols // MXFP4_BLOCK_SIZE)
        _check(meta, (*want, MXFP4_BLOCK_SIZE // 2) if kind == "_blocks" else want, "uint8")
    elif kind == "_bias":
        if moe.b13 is None:
            raise WeightUpdateError(meta.name, f"tensor {meta.name!r}: {block} has no biases")
        _check(meta, (n, rows), _float_dtype(meta))
    else:
        _check(meta, (n, cols, rows) if e.fused_in_out else (n, rows, cols), _float_dtype(meta))
    interleaved = gate_up and e.interleaved_gate_up
    return FusedExpertTarget(block, shard, kind, e.fused_in_out and not kind, interleaved)


def _format(moe: FusedMoE) -> str:
    return "float" if moe.quantized is None else moe.quantized.method


def _float_dtype(meta: TensorMeta) -> str:
    """`meta.dtype` when a floating parameter takes it.

    Raises:
        WeightUpdateError: float8 (meaningless without its block scales) or a non-float dtype.
    """
    if meta.dtype in FLOAT_DTYPES:
        return meta.dtype
    hint = (" (FP8 weights need their block scales: send them dequantized)"
            if meta.dtype.startswith("float8") else "")
    raise WeightUpdateError(
        meta.name, f"tensor {meta.name!r} is {meta.dtype}; a floating parameter takes "
        f"{', '.join(FLOAT_DTYPES)}{hint}",
    )


def _check(meta: TensorMeta, want: tuple[int, ...], dtype: str | None) -> None:
    """Raise WeightUpdateError unless `meta` has shape `want` (and dtype `dtype`, if given)."""
    if tuple(meta.shape) != tuple(want):
        raise WeightUpdateError(
            meta.name, f"tensor {meta.name!r} has shape {tuple(meta.shape)}, the model expects "
            f"{tuple(want)}",
        )
    if dtype is not None and meta.dtype != dtype:
        raise WeightUpdateError(
            meta.name, f"tensor {meta.name!r} is {meta.dtype}, the model expects {dtype}"
        )


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The `TensorMeta` of a tensor under checkpoint name `name`."""
    return TensorMeta(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
