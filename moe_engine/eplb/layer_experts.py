"""One MoE layer's experts as runtime EPLB reads and writes them: slot by slot, as stored.

A slot's expert is a fixed list of tensors (`ExpertField`), each the slot's row of a stacked
[E_local, ...] tensor:
- float experts: w13 [2I, H], w2 [H, I] (the layer's dtype), and b13 [2I], b2 [H] where the
  layer has biases. The float parameters are the canonical copy whatever kernel is bound
  (native-cpu packs its own copy from them: `FusedMoE.reset_packed`).
- 4-bit experts: the fields of the canonical stacked layout (`QuantizedExperts.canonical`:
  int4 `w13_packed`, `w13_scales`, `w13_zeros` where stored, `w2_*`; MXFP4 `w13_blocks`,
  `w13_scales`, `w2_*`) exactly as stored, plus the float biases. Codes and scales move as
  bytes, never re-quantized, so a moved expert is bit-identical to its source. Where the bound
  layout is the canonical one (torch on MXFP4 or off the CPU, triton) reading it copies
  nothing; native-cpu unpacks its tiles into a new canonical copy of the whole layer
  (`BoundExperts.restore`); torch's int4 CPU layout cannot give it back at all, which
  `LayerExperts` refuses at construction.

`commit` writes the staged slots into the serving tensors in place (`index_copy_`: the tensors
keep their addresses, no second copy of the layer on the device) and rebinds the layer's
kernels: float experts repack from w13/w2; 4-bit experts get a new `QuantizedExperts` over the
updated canonical tensors (the same tensors where they were held; native-cpu packs a new
layout from its unpacked copy, as `weight_update/staging.py` does after an update).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.plan import EXPERT_OPS, KernelPlan
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.quantized_experts import QuantizedExperts

#: The float experts' stacked tensors, in the order a slot's bytes travel (biases if present).
FLOAT_FIELDS = ("w13", "w2", "b13", "b2")
BIAS_FIELDS = ("b13", "b2")


@dataclass(frozen=True)
class ExpertField:
    """One tensor of one slot: `name` (the stacked tensor's), per-slot `shape` and `dtype`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's row."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class LayerExperts:
    """Reads and writes one `FusedMoE`'s experts per slot (module doc).

    Args:
        moe: the layer, sharded (`FusedMoE.shard_experts`) and with its kernels bound.

    Raises:
        ValueError: 4-bit experts whose bound kernel cannot give the canonical layout back
            (torch's int4 CPU layout), naming the backend and the op.
    """

    def __init__(self, moe: FusedMoE) -> None:
        self.moe = moe
        self.device = moe.gate.weight.device
        if moe.quantized is None:
            tensors = {name: getattr(moe, name) for name in FLOAT_FIELDS}
        else:
            tensors = {**self._canonical(), **{b: getattr(moe, b) for b in BIAS_FIELDS}}
        #: The slot's tensors in travel order (None-valued ones, absent biases or zero
        #: points, left out).
        self.fields = tuple(
            ExpertField(name, tuple(t.shape[1:]), t.dtype)
            for name, t in tensors.items() if t is not None
        )
        #: Bytes of one expert of this layer (all its fields).
        self.expert_bytes = sum(f.nbytes for f in self.fields)

    def _canonical(self) -> dict[str, torch.Tensor | None]:
        """The 4-bit experts' canonical stacked tensors by field name (see module doc for the
        copy native-cpu makes)."""
        quantized = self.moe.quantized
        assert quantized is not None
        try:
            weights = quantized.canonical()
        except RuntimeError as exc:
            op = EXPERT_OPS[quantized.method]
            raise ValueError(
                f"runtime EPLB moves {quantized.method} experts packed, as stored, and needs "
                f"their canonical layout back, which the {quantized.backend!r} kernel backend "
                f"of {op} cannot give ({exc}); serve {op} on another backend "
                f"(--kernel-backend {op}=native-cpu or triton) or without EPLB"
            ) from None
        return {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}

    def sources(self) -> dict[str, torch.Tensor]:
        """Field name -> the serving [E_local, ...] tensor (4-bit: the canonical layout, a new
        copy on native-cpu: hold it only while sending)."""
        if self.moe.quantized is None:
            stacked = {name: getattr(self.moe, name) for name in FLOAT_FIELDS}
        else:
            stacked = {**self._canonical(), **{b: getattr(self.moe, b) for b in BIAS_FIELDS}}
        return {f.name: stacked[f.name].data for f in self.fields}

    def write_slot(self, sources: dict[str, torch.Tensor], slot: int, out: torch.Tensor
                   ) -> None:
        """Local slot `slot`'s expert into `out` ([expert_bytes] uint8): its fields' bytes, in
        field order (what `stage_bytes` reads back)."""
        start = 0
        for f in self.fields:
            out[start : start + f.nbytes].copy_(sources[f.name][slot].reshape(-1).view(torch.uint8))
            start += f.nbytes

    def new_staging(self, rows: int) -> dict[str, torch.Tensor]:
        """Empty staging for `rows` slots: field name -> [rows, *shape] on the layer's device."""
        return {f.name: torch.empty((rows, *f.shape), dtype=f.dtype, device=self.device)
                for f in self.fields}

    def stage_bytes(self, staging: dict[str, torch.Tensor], row: int, data: torch.Tensor) -> None:
        """Write one expert received as [expert_bytes] uint8 into staging row `row`."""
        start = 0
        for f in self.fields:
            staging[f.name][row].reshape(-1).view(torch.uint8).copy_(
                data[start : start + f.nbytes]
            )
            start += f.nbytes

    def stage_local(self, staging: dict[str, torch.Tensor], row: int,
                    sources: dict[str, torch.Tensor], slot: int) -> None:
        """Copy local slot `slot`'s expert into staging row `row` (no transfer)."""
        for f in self.fields:
            staging[f.name][row].copy_(sources[f.name][slot])

    def commit(self, slots: list[int], staging: dict[str, torch.Tensor], plan: KernelPlan
               ) -> None:
        """Write staging row j into local slot `slots[j]` of the serving tensors (in place) and
        rebind the layer's kernels with `plan`."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        moe = self.moe
        for name in BIAS_FIELDS if moe.quantized is not None else FLOAT_FIELDS:
            if name in staging:
                getattr(moe, name).data.index_copy_(0, index, staging[name])
        if moe.quantized is None:
            moe.reset_packed()
            moe.bind_kernels(plan)
            return
        old = moe.quantized
        canonical = old.canonical()
        for f in dataclasses.fields(canonical):
            if f.name in staging:
                getattr(canonical, f.name).index_copy_(0, index.to(staging[f.name].device),
                                                       staging[f.name])
        moe.quantized = QuantizedExperts.from_layout(
            canonical, activation=old.activation, b13=old.b13, b2=old.b2
        )
        moe.bind_kernels(plan)  # takes the biases as the module holds them, binds the layout
