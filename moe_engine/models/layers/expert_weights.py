"""Checkpoint formats of routed experts, copied into a `FusedMoE`'s stacked weights.

The shared weight loader (`models/weight_mapping.py`) calls these with tensors it has already
named and (where a layout needs it) transposed; each keeps only the experts of the block's
local slots (`FusedMoE.local_slots`, `local_experts`), so a rank under expert parallelism
holds its own slice. Formats:
- one expert's projection (`experts.{e}.gate_proj` ...): `load_expert`;
- all experts in one tensor (transformers 5 `experts.gate_up_proj` [E, 2I, H] and
  `experts.down_proj` [E, H, I]): `load_all_experts`, and their biases `load_expert_biases`;
- int4 Linears (`quant.int4.Int4Weight`, from compressed-tensors pack-quantized checkpoints),
  assembled into a `QuantizedExperts` once the layer is complete: `load_int4_expert`;
- MXFP4 blocks/scales of all experts (gpt-oss, OCP MX v1.0), kept packed:
  `load_mxfp4_experts`.
The engine's layout: w13 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I],
b13 [E_local, 2I], b2 [E_local, H].
"""

from __future__ import annotations

import math

import torch

from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from quant.int4 import SYMMETRIC_ZERO, Int4Weight
from quant.mxfp4 import MXFP4_BLOCK_SIZE

#: Per-expert projections, in the order w13 holds gate and up.
PROJECTIONS = ("gate", "up", "down")


def projections_of(moe: FusedMoE) -> tuple[str, ...]:
    """The per-expert projections a block's checkpoint holds: `PROJECTIONS`, or ("up", "down")
    for non-gated experts (w13 is the up projection alone)."""
    return PROJECTIONS if moe.activation.gated else ("up", "down")


def load_expert(moe: FusedMoE, expert: int, shard: str, tensor: torch.Tensor) -> None:
    """Copy one expert's projection into every local slot holding it (none when another rank
    holds the expert).

    Args:
        expert: global expert id.
        shard: "gate" | "up" ([I, H]) or "down" ([H, I]).

    Raises:
        ValueError: a shape mismatch, naming both shapes.
    """
    moe.reset_packed()
    size = moe.intermediate_size
    if shard not in projections_of(moe):
        raise ValueError(f"expert weight {shard} of expert {expert}: the block's experts are "
                         f"non-gated (up and down projections only)")
    up_rows = size if moe.activation.gated else 0
    for slot in moe.local_slots(expert):
        target = {
            "gate": moe.w13.data[slot, :size],
            "up": moe.w13.data[slot, up_rows:],
            "down": moe.w2.data[slot],
        }[shard]
        if target.shape != tensor.shape:
            raise ValueError(
                f"expert weight {shard} of expert {expert}: checkpoint shape "
                f"{tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.copy_(tensor)


def load_all_experts(moe: FusedMoE, shard: str, tensor: torch.Tensor) -> None:
    """Copy the local slots' rows of an all-expert tensor.

    Args:
        shard: "gate_up" (tensor [E, 2I, H], gate rows then up rows), "gate" or "up" ([E, I,
            H], one half of w13: DBRX) or "down" ([E, H, I]).

    Raises:
        ValueError: a shape mismatch, naming both shapes.
    """
    size = moe.intermediate_size
    halves = {"gate": slice(0, size), "up": slice(size, 2 * size)}
    if shard in halves:
        moe.reset_packed()
        _copy_rows(moe, moe.w13.data[:, halves[shard]], shard, tensor)
        return
    _copy_stacked(moe, {"gate_up": "w13", "down": "w2"}[shard], shard, tensor)


def load_expert_biases(moe: FusedMoE, shard: str, tensor: torch.Tensor) -> None:
    """Copy the local slots' rows of all experts' biases.

    Args:
        shard: "gate_up" (tensor [E, 2I], gate then up) or "down" ([E, H]).

    Raises:
        ValueError: a block without expert biases, or a shape mismatch (names both shapes).
    """
    if moe.b13 is None:
        raise ValueError(f"expert weight {shard}_bias: this MoE layer has no expert biases")
    _copy_stacked(moe, {"gate_up": "b13", "down": "b2"}[shard], f"{shard}_bias", tensor)


def _copy_stacked(moe: FusedMoE, param: str, what: str, tensor: torch.Tensor) -> None:
    moe.reset_packed()
    _copy_rows(moe, getattr(moe, param).data, what, tensor)


def _copy_rows(moe: FusedMoE, target: torch.Tensor, what: str, tensor: torch.Tensor) -> None:
    """Copy the local slots' rows of an all-expert `tensor` [E, ...] into `target`
    [E_local, ...] (a parameter or a view of one).

    Raises:
        ValueError: a shape mismatch, naming both shapes.
    """
    expected = (moe.num_experts, *target.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"expert weight {what}: checkpoint shape {tuple(tensor.shape)} does not "
            f"match the model's {expected}"
        )
    target.copy_(tensor[moe.local_experts])


def load_int4_expert(moe: FusedMoE, expert: int, shard: str, weight: Int4Weight) -> None:
    """Take one expert projection that the checkpoint stores in int4 already.

    Once every projection of every local slot has arrived, the block's experts become a
    `QuantizedExperts` built from them (`QuantizedExperts.from_int4`) and the float w13/w2
    are dropped.

    Args:
        expert: global expert id; projections of experts this rank does not hold are skipped.
        shard: "gate" | "up" ([I, H]) or "down" ([H, I]).
        weight: the projection in `quant.int4`'s representation.

    Raises:
        ValueError: a shape that does not match the model's (names both), a projection
            arriving after the block's int4 experts were assembled, or group sizes that
            differ.
    """
    hidden, size = moe.gate.in_features, moe.intermediate_size
    want = (hidden, size) if shard == "down" else (size, hidden)
    if tuple(weight.shape) != want:
        raise ValueError(
            f"int4 expert weight {shard} of expert {expert}: checkpoint shape "
            f"{tuple(weight.shape)} does not match the model's {want}"
        )
    own = moe.local_slots(expert)
    if own and moe.quantized is not None:
        raise ValueError(f"int4 expert weight {shard} of expert {expert}: loaded twice")
    pieces = moe.pending_int4
    for slot in own:
        pieces[(slot, shard)] = weight
    slots = range(len(moe.local_experts))
    if len(pieces) < 3 * len(slots):
        return
    w13 = [_cat_rows(pieces[(s, "gate")], pieces[(s, "up")]) for s in slots]
    moe.quantized = QuantizedExperts.from_int4(w13, [pieces[(s, "down")] for s in slots])
    for name, value in moe.expert_extras().items():
        setattr(moe.quantized, name, value)
    moe.pending_int4 = {}
    del moe.w13, moe.w2


def load_mxfp4_experts(
    moe: FusedMoE, shard: str, part: str, tensor: torch.Tensor, *, owned: bool = False
) -> bool:
    """Take one MXFP4 tensor of all experts as a checkpoint stores it (gpt-oss `*_blocks` /
    `*_scales`, already in the engine's row order: gate rows then up rows).

    Once the blocks and scales of both projections have arrived, the block's experts become a
    `QuantizedExperts` over them (`QuantizedExperts.from_mxfp4`: no float round trip) and the
    float w13/w2 are dropped.

    Args:
        shard: "gate_up" (w13: blocks [E, 2I, H // 32, 16], scales [E, 2I, H // 32]) or
            "down" (w2: blocks [E, H, I // 32, 16], scales [E, H, I // 32]); uint8.
        part: "blocks" or "scales".
        tensor: the checkpoint tensor for all E experts; the block keeps its local slots.
        owned: `tensor` is a new contiguous tensor the caller made (the deinterleaved gate/up),
            kept as it is when the block holds all E experts; else they are copied
            (`local_experts_of`).

    Returns:
        True when this projection now has both its blocks and its scales.

    Raises:
        ValueError: an unknown shard or part, a shape that does not match the model's (names
            both), or a tensor arriving twice.
    """
    if shard not in ("gate_up", "down") or part not in ("blocks", "scales"):
        raise ValueError(f"mxfp4 expert tensor {shard}_{part}: unknown shard or part")
    hidden, size = moe.gate.in_features, moe.intermediate_size
    rows, cols = (2 * size, hidden) if shard == "gate_up" else (hidden, size)
    want = (moe.num_experts, rows, cols // MXFP4_BLOCK_SIZE)
    if part == "blocks":
        want = (*want, MXFP4_BLOCK_SIZE // 2)
    if tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4 expert tensor {shard}_{part}: checkpoint {tensor.dtype} "
            f"{tuple(tensor.shape)} does not match the model's uint8 {want}"
        )
    pieces = moe.pending_mxfp4
    if (shard, part) in pieces or (moe.quantized is not None and moe.quantized.method == "mxfp4"):
        raise ValueError(f"mxfp4 expert tensor {shard}_{part}: loaded twice")
    all_local = moe.local_experts == list(range(tensor.shape[0]))
    keep = owned and all_local and tensor.is_contiguous()
    pieces[(shard, part)] = tensor if keep else local_experts_of(moe, tensor)
    if len(pieces) == 4:
        moe.quantized = QuantizedExperts.from_mxfp4(
            (pieces[("gate_up", "blocks")], pieces[("gate_up", "scales")]),
            (pieces[("down", "blocks")], pieces[("down", "scales")]),
            **moe.expert_extras(),
        )
        moe.pending_mxfp4 = {}
        del moe.w13, moe.w2
        return True
    other = "scales" if part == "blocks" else "blocks"
    return (shard, other) in pieces


def local_experts_of(moe: FusedMoE, tensor: torch.Tensor) -> torch.Tensor:
    """tensor [E, ...] (all experts) -> a contiguous copy of this block's slots, in order: a
    plain copy when they are all E in order, else a gather (torch's index copy of uint8 rows is
    several times slower than a copy: 4.4 s of a 3-layer gpt-oss-20b cut's load).

    Never a view of `tensor`: a checkpoint tensor is a view of a safetensors memory map, and a
    view held until the kernels bind would keep every page touched through that map resident
    (`moe_engine.models.loader.REMAP_BYTES`)."""
    local = moe.local_experts
    if local == list(range(tensor.shape[0])):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor[local].contiguous()


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up features (gate0, up0, gate1, up1, ...: gpt-oss) along `dim` -> all
    gate features, then all up features (the engine's w13 order). Any dtype, including packed
    MXFP4 rows; returns a new tensor of the same shape.

    A contiguous `t` is copied as [outer, 2, rows / 2, inner] -> [outer, rows / 2 ... ]
    transposed, its rows of `inner` elements moved whole (viewed as int64 where their bytes
    allow: torch copies a strided uint8 tensor byte by byte).
    """
    if not t.is_contiguous() or t.shape[dim] % 2:
        return torch.cat([_every_other(t, dim, 0), _every_other(t, dim, 1)], dim=dim)
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1:])
    rows = t.reshape(outer, t.shape[dim] // 2, 2, inner)
    if inner * t.element_size() % 8 == 0 and t.data_ptr() % 8 == 0:
        rows = rows.view(torch.uint8).view(torch.int64)
    moved = rows.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # always new
    return moved.view(t.dtype).view(t.shape)


def _every_other(t: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    index = [slice(None)] * t.dim()
    index[dim] = slice(start, None, 2)
    return t[tuple(index)]


def _cat_rows(a: Int4Weight, b: Int4Weight) -> Int4Weight:
    """Stack two int4 weights along the output dimension (gate rows, then up rows); a
    symmetric half beside an asymmetric one gets its implicit zero point 8 made explicit."""
    if a.group_size != b.group_size:
        raise ValueError(
            f"int4 experts: gate has group size {a.group_size}, up has {b.group_size}"
        )
    zeros = None
    if a.zeros is not None or b.zeros is not None:
        zeros = torch.cat([_zeros_of(w) for w in (a, b)])
    scales = torch.cat([a.scales, b.scales.to(a.scales.dtype)])
    return Int4Weight(torch.cat([a.packed, b.packed]), scales, zeros)


def _zeros_of(w: Int4Weight) -> torch.Tensor:
    if w.zeros is not None:
        return w.zeros
    return torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8)
