"""An update's new weights, held beside the serving ones until all have arrived, then made to serve.

`StagedWeights.add` takes each tensor as it arrives (from disk or from the trainer) into a
new host-memory copy of its parameter: the serving weights do not change while an update is
received, so a transfer that fails half-way leaves them as they were. `commit` then, for a
model in host memory, swaps every staged tensor in (`param.data = new`; anything failing
there swaps the old tensors back), and for a model on a GPU copies the staged values into the
serving tensors (no second copy of the weights in device memory, which the KV cache fills;
the tensors keep their addresses); it re-quantizes the 4-bit experts the update touched and
rebinds the kernels (their packed copies are of the old weights). Memory: one host copy of
every parameter the update touches (the whole model for a full update; under expert
parallelism, this rank's experts only), freed at commit.

Casting follows the startup loader (`loader.cast_floating`): a tensor is rounded to the
checkpoint dtype (`--dtype`), or kept float32 where the model keeps a parameter float32
(routers, correction biases), then stored in the parameter's dtype; 4-bit experts are
quantized from that value row by row (`quant.int4.quantize_int4`, symmetric, the layer's group
size and scale dtype; `quant.mxfp4.quantize_mxfp4`), so an updated expert holds exactly the
codes a restart on the same weights would give.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.plan import KernelPlan
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.kernel_binding import bind_kernels
from moe_engine.models.layers.expert_weights import deinterleave_gate_up
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.weight_mapping import WeightLoader
from moe_engine.weight_update.targets import (
    ExpertTarget,
    FusedExpertTarget,
    ParamTarget,
    Target,
    WeightUpdateError,
)
from quant.int4 import SYMMETRIC_ZERO, quantize_int4
from quant.mxfp4 import quantize_mxfp4

#: Where updates are staged: host memory (a GPU's memory is the KV cache's).
STAGE_DEVICE = torch.device("cpu")


class StagedWeights:
    """New values for some of `model`'s weights, not yet serving.

    Args:
        model: the serving model (this rank's experts).
        weight_dtype: the checkpoint dtype weights are rounded to (`--dtype`).
        compute_dtype: the model's parameter dtype (float32 where the CPU lacks bf16 math).

    Staged tensors are always in host memory (`STAGE_DEVICE`), whatever the model's device.
    """

    def __init__(
        self, model: MoeCausalLM, weight_dtype: torch.dtype, compute_dtype: torch.dtype
    ) -> None:
        self.model = model
        self.weight_dtype, self.compute_dtype = weight_dtype, compute_dtype
        self.loader = WeightLoader(model)
        self.keep_float32 = model.float32_weight_names()
        #: parameter name -> its whole new value (float blocks' w13/w2/b13/b2 included)
        self.params: dict[str, torch.Tensor] = {}
        #: 4-bit block -> (local slot, "gate" | "up" | "down") -> float rows to quantize
        self.expert_rows: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        #: MXFP4 block -> (shard, "blocks" | "scales") -> packed local experts, as stored
        self.packed: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
        #: bytes of the tensors this rank took (as received)
        self.num_bytes = 0
        self._quantized: dict[str, QuantizedExperts] | None = None

    def add(self, target: Target, tensor: torch.Tensor, owned: bool = False) -> None:
        """Stage one tensor (already checked against the model by `resolve_targets`).

        Args:
            owned: `tensor` is this update's own memory (a view into a received bucket): a
                whole parameter of the same dtype then keeps it as it is, uncopied.
        """
        if isinstance(target, ParamTarget):
            self._add_param(target, tensor, owned)
        elif isinstance(target, ExpertTarget):
            moe = self.loader.moes[target.block]
            value = self._cast(None, tensor, self.compute_dtype)
            for slot in moe.local_slots(target.expert):
                self._expert_rows(target.block, moe, slot, target.proj, value)
        elif isinstance(target, FusedExpertTarget):
            self._add_fused(target, tensor)
        else:
            return
        self.num_bytes += tensor.numel() * tensor.element_size()

    def _add_param(self, target: ParamTarget, tensor: torch.Tensor, owned: bool) -> None:
        param = self.loader.params[target.param]
        if target.shard is None:
            self.params[target.param] = self._cast(target.param, tensor, param.dtype, not owned)
            return
        value = self._cast(target.param, tensor, param.dtype)
        module = self.loader.merged[target.param.rpartition(".")[0]]
        module.shard_view(self._staged(target.param), target.shard).copy_(value)

    def _add_fused(self, target: FusedExpertTarget, tensor: torch.Tensor) -> None:
        moe = self.loader.moes[target.block]
        if target.in_out:
            tensor = tensor.transpose(1, 2)  # [E, out, in]
        if target.interleaved:
            tensor = deinterleave_gate_up(tensor, dim=1)
        mine = tensor[moe.local_experts]
        if target.kind in ("_blocks", "_scales"):
            parts = self.packed.setdefault(target.block, {})
            parts[(target.shard, target.kind[1:])] = mine.to(STAGE_DEVICE).contiguous()
            return
        if target.kind == "_bias":
            name = f"{target.block}.{'b13' if target.shard == 'gate_up' else 'b2'}"
            self._staged(name).copy_(self._cast(name, mine, self.compute_dtype))
            return
        value = self._cast(None, mine, self.compute_dtype)
        size = moe.intermediate_size
        for slot in range(len(moe.local_experts)):
            if target.shard == "down":
                self._expert_rows(target.block, moe, slot, "down", value[slot])
            else:
                self._expert_rows(target.block, moe, slot, "gate", value[slot, :size])
                self._expert_rows(target.block, moe, slot, "up", value[slot, size:])

    def _expert_rows(self, block: str, moe: FusedMoE, slot: int, proj: str,
                     value: torch.Tensor) -> None:
        """One local slot's projection: into the staged w13/w2 of a float block, else kept
        to be quantized at commit."""
        if moe.quantized is not None:
            self.expert_rows.setdefault(block, {})[(slot, proj)] = value
            return
        size = moe.intermediate_size
        if proj == "down":
            self._staged(f"{block}.w2")[slot].copy_(value)
        else:
            rows = slice(0, size) if proj == "gate" else slice(size, 2 * size)
            self._staged(f"{block}.w13")[slot, rows].copy_(value)

    def _staged(self, name: str) -> torch.Tensor:
        """The staged copy of parameter `name`, made from the serving one on first use."""
        if name not in self.params:
            self.params[name] = self.loader.params[name].detach().to(STAGE_DEVICE, copy=True)
        return self.params[name]

    def _cast(self, name: str | None, tensor: torch.Tensor, dtype: torch.dtype,
              copy: bool = True) -> torch.Tensor:
        """`tensor` rounded as the startup loader rounds checkpoint tensors, in `dtype`, in
        host memory: a new tensor, or with `copy=False` `tensor` itself when nothing changes."""
        if not tensor.is_floating_point():
            return tensor.to(STAGE_DEVICE, copy=copy)
        stored = torch.float32 if name in self.keep_float32 else self.weight_dtype
        return tensor.to(STAGE_DEVICE, stored).to(dtype, copy=copy)

    # ------------------------------------------------------------------ commit

    def prepare(self) -> dict[str, QuantizedExperts]:
        """The touched 4-bit layers' new experts, built in host memory (once; `commit` calls
        it, an expert-parallel rank before agreeing, so that every refusal comes first).

        Raises:
            WeightUpdateError: a 4-bit layer that cannot be re-quantized in part.
        """
        if self._quantized is None:
            self._quantized = {block: self._requantized(block)
                               for block in {*self.expert_rows, *self.packed}}
        return self._quantized

    def commit(self, plan: KernelPlan, in_place: bool = False) -> None:
        """Make the staged weights serve and rebind every kernel.

        Args:
            in_place: copy the staged values into the serving tensors (a model on a GPU: no
                second copy of the weights on the device, and the tensors keep their
                addresses, which captured CUDA graphs read), instead of swapping the staged
                tensors in (host memory: nothing is copied twice, and all or nothing).

        Raises:
            WeightUpdateError: a 4-bit layer that cannot be re-quantized in part (nothing
                changed then). Swapping: whatever rebinding raises, after the old weights are
                back. In place, a copy of checked tensors fails only on a device error, which
                ends the engine.
        """
        quantized = self.prepare()
        if in_place:
            for name, value in self.params.items():
                self.loader.params[name].data.copy_(value)
            for block, experts in quantized.items():
                moe = self.loader.moes[block]
                moe.quantized = None  # the old layer's device memory goes first
                moe.quantized = experts.to(_device_of(moe))
            rebind(self.model, plan)
        else:
            self._swap(quantized, plan)
        self.params, self.expert_rows, self.packed, self._quantized = {}, {}, {}, {}

    def _swap(self, quantized: dict[str, QuantizedExperts], plan: KernelPlan) -> None:
        """Swap the staged tensors and layers in; on any failure swap the old ones back."""
        old_data: dict[str, torch.Tensor] = {}
        old_quant: dict[str, QuantizedExperts | None] = {}
        try:
            for name, value in self.params.items():
                param = self.loader.params[name]
                old_data[name] = param.data
                param.data = value
            for block, experts in quantized.items():
                old_quant[block] = self.loader.moes[block].quantized
                self.loader.moes[block].quantized = experts
            rebind(self.model, plan)
        except BaseException:
            for name, data in old_data.items():
                self.loader.params[name].data = data
            for block, experts in old_quant.items():
                self.loader.moes[block].quantized = experts
            rebind(self.model, plan)
            raise

    def _requantized(self, block: str) -> QuantizedExperts:
        """Block `block`'s 4-bit experts with the staged slots' rows quantized into a copy.

        Raises:
            WeightUpdateError: the bound layout cannot give the canonical one back (torch's
                int4 CPU layout) and the update does not cover the whole layer.
        """
        old = self.loader.moes[block].quantized
        assert old is not None
        try:
            canonical = old.canonical()
        except RuntimeError as exc:
            raise WeightUpdateError(block, f"{block}: {exc}") from None
        fields = {f.name: _host_copy(getattr(canonical, f.name))
                  for f in dataclasses.fields(canonical)}
        for part in self.packed.get(block, {}).items():
            (shard, kind), tensor = part
            fields[f"{'w13' if shard == 'gate_up' else 'w2'}_{kind}"] = tensor
        size = self.loader.moes[block].intermediate_size
        rows_of = {"gate": slice(0, size), "up": slice(size, 2 * size), "down": slice(None)}
        by_proj: dict[str, dict[int, torch.Tensor]] = {}
        for (slot, proj), value in self.expert_rows.get(block, {}).items():
            by_proj.setdefault(proj, {})[slot] = value
        for proj, values in by_proj.items():  # one quantization call per projection
            prefix, rows = ("w2" if proj == "down" else "w13"), rows_of[proj]
            slots = torch.tensor(sorted(values), dtype=torch.long, device=STAGE_DEVICE)
            stacked = torch.stack([values[s] for s in sorted(values)])  # [S, rows, cols]
            for kind, code in self._codes(old, fields, prefix, stacked).items():
                fields[f"{prefix}_{kind}"][:, rows].index_copy_(0, slots, code)
        return QuantizedExperts.from_layout(
            type(canonical)(**fields), activation=old.activation, b13=old.b13, b2=old.b2
        )

    @staticmethod
    def _codes(old: QuantizedExperts, fields: dict, prefix: str, stacked: torch.Tensor
               ) -> dict[str, torch.Tensor]:
        """The 4-bit codes of `stacked` [S, rows, cols] float in `old`'s format: MXFP4
        blocks and scales, or int4 packed codes and scales (symmetric, the layer's group
        size and scale dtype; zero points 8 where the layer stores them)."""
        if old.method == "mxfp4":
            return dict(zip(("blocks", "scales"), quantize_mxfp4(stacked), strict=True))
        scales = fields[f"{prefix}_scales"]
        packed, new_scales, _ = quantize_int4(
            stacked, old.group_size, symmetric=True, scale_dtype=scales.dtype
        )
        codes = {"packed": packed, "scales": new_scales}
        if fields[f"{prefix}_zeros"] is not None:  # an asymmetric checkpoint's layer
            codes["zeros"] = torch.full_like(new_scales, SYMMETRIC_ZERO, dtype=torch.uint8)
        return codes


def rebind(model: MoeCausalLM, plan: KernelPlan) -> None:
    """Drop every packed copy of the old weights and bind `plan` again (the startup binding:
    linears and float experts repack, decode layers rebuild their native calls, MLA splits
    its absorbed weights on next use)."""
    for module in model.modules():
        if isinstance(module, Linear | FusedMoE | SharedExperts):
            module.reset_packed()
    bind_kernels(model, plan)
    for module in model.modules():
        split = getattr(module, "process_weights_after_loading", None)
        if split is not None:  # MLA's absorbed decode weights, from kv_b_proj
            split()


def _host_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(STAGE_DEVICE, copy=True)


def _device_of(moe: FusedMoE) -> torch.device:
    """Where a MoE block's weights are (its router's)."""
    return moe.gate.weight.device
