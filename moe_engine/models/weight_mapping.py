"""Checkpoint names -> the model's parameters: one declarative mapping per architecture,
applied by one loading routine shared by all of them.

An architecture file states how its checkpoint names differ from its module tree
(`WeightMapping`), in the manner of vLLM's and nano-vllm's `packed_modules_mapping` /
`stacked_params_mapping` and `FusedMoE.make_expert_params_mapping`:
- `renames`: substrings replaced in every checkpoint name first (Mixtral
  `.block_sparse_moe.` -> `.mlp.`, gpt-oss `.mlp.router.` -> `.mlp.gate.`);
- `stacked_params`: checkpoint projections that fill slices of one `MergedLinear`
  (q/k/v -> `qkv_proj`, shards "q", "k", "v");
- `experts`: the names of a `FusedMoE` block's routed experts under `<block>.experts.`: per
  expert (`experts.{e}.gate_proj.weight`, or Mixtral's `w1`/`w3`/`w2`) or all experts in one
  tensor (transformers 5 `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I],
  gpt-oss's [E, in, out] with gate/up interleaved, its `_bias` and MXFP4 `_blocks`/`_scales`).
Every other name is a parameter (or persistent buffer) of the model by that name. Expert
formats are copied by `layers/expert_weights.py`. Tensors of decoder layers at or beyond the
model's `num_layers` are skipped, never read (`beyond_num_layers`): GLM-4.5 and DeepSeek-V3
ship their multi-token-prediction layers as `model.layers.{num_hidden_layers + j}.*`
(`num_nextn_predict_layers`), which transformers' causal LM ignores too; a model built with
MTP layers (`--speculative-method mtp`) reads them into `mtp_layers.{j}.*`
(`mtp_model_name`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_engine.models.layers import expert_weights
from moe_engine.models.layers.linear import Linear, MergedLinear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.models.materialize import materialize_float_experts
from quant.int4 import Int4Weight, dequantize_int4

#: q/k/v projections stacked into the attention's `qkv_proj` (`layers/self_attention.Attention`).
QKV_STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
)


@dataclass(frozen=True)
class ExpertMapping:
    """Checkpoint names of a `FusedMoE` block's routed experts, after `<block>.experts.`.

    Attributes:
        gate, up, down: one expert's projections, `experts.{e}.<name>.weight` ([I, H], [I, H],
            [H, I]).
        fused_gate_up, fused_down: all experts' projections in one tensor,
            `experts.<name>` ([E, 2I, H] and [E, H, I] unless `fused_in_out`), with optional
            suffixes `_bias` ([E, 2I], [E, H]), `_blocks` / `_scales` (MXFP4, rows = outputs).
        fused_in_out: the fused weights are stored [E, in, out] (gpt-oss) and are transposed.
        fused_gate, fused_up: all experts' gate and up projections as two tensors
            `experts.<name>` [E, I, H] (DBRX's `w1`, `v1`); "": none (gate and up fused).
        fused_down_in_out: the fused down tensor alone is stored [E, I, H] (in, out: DBRX's
            `w2`) and is transposed.
        flat: the fused tensors are 2-D, the experts stacked along the rows ([E * rows, cols]:
            DBRX), and are viewed as [E, rows, cols] first.
        interleaved_gate_up: gate and up features alternate (gpt-oss) in the fused gate/up
            tensors (weights, biases, blocks, scales) and are de-interleaved.
    """

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused_gate_up: str = "gate_up_proj"
    fused_down: str = "down_proj"
    fused_in_out: bool = False
    interleaved_gate_up: bool = False
    fused_gate: str = ""
    fused_up: str = ""
    fused_down_in_out: bool = False
    flat: bool = False

    def name_of(self, projection: str) -> str:
        """The per-expert checkpoint name of projection "gate" | "up" | "down"."""
        return {"gate": self.gate, "up": self.up, "down": self.down}[projection]


@dataclass(frozen=True)
class WeightMapping:
    """How an architecture's checkpoint names map onto its modules (see the module doc).

    Attributes:
        renames: (checkpoint substring, model substring) pairs, applied in order.
        stacked_params: (merged module substring, checkpoint substring, shard id) triples,
            vLLM's `stacked_params_mapping`; the merged module must be a `MergedLinear`
            (names whose target is not one load as they are).
        experts: the routed experts' names.
        skipped: regular expressions (`re.search`) of checkpoint names that may have no place
            in the model: a matching tensor whose (renamed) name is no parameter or buffer is
            skipped unread, as transformers' `_keys_to_ignore_on_load_unexpected` skips it
            (the `mtp` tensors of ERNIE, Mellum, MiMo-V2-Flash and LongCat-Flash; A.X-K1's
            dense layers' `post_mlp_layernorm`).
        optional: regular expressions of parameter or buffer names (the model's) a checkpoint
            may lack: filled with zeros then, as transformers' `_keys_to_ignore_on_load_missing`
            leaves them at their zero initialisation (A.X-K1's `e_score_correction_bias`).
    """

    renames: tuple[tuple[str, str], ...] = ()
    stacked_params: tuple[tuple[str, str, str], ...] = QKV_STACKED
    experts: ExpertMapping = field(default_factory=ExpertMapping)
    skipped: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def skips(self, name: str) -> bool:
        """Whether checkpoint tensor `name` matches one of `skipped`."""
        return any(re.search(pattern, name) for pattern in self.skipped)

    def model_name(self, name: str) -> str:
        """A checkpoint name with `renames` applied."""
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def checkpoint_name(self, name: str) -> str:
        """A model name with `renames` undone (the checkpoint's module name)."""
        for old, new in reversed(self.renames):
            name = name.replace(new, old)
        return name


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def beyond_num_layers(name: str, num_layers: int) -> bool:
    """True for a checkpoint tensor of decoder layer `num_layers` or later
    ("model.layers.46.eh_proj.weight" with 46 layers: an MTP layer), which no module holds."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m[1]) >= num_layers


#: An MTP layer's copies of the main model's tensors (the same values), never read.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_model_name(name: str, num_layers: int, num_mtp_layers: int) -> str | None:
    """The model name of an MTP layer's checkpoint tensor ("model.layers.{num_layers + j}.X"
    -> "mtp_layers.{j}.X", `layers/mtp.py`); None for any other name beyond num_layers, and
    for the layer's copies of the embedding and LM head (`MTP_SHARED_COPIES`)."""
    m = _LAYER_INDEX.match(name)
    if m is None or not 0 <= int(m[1]) - num_layers < num_mtp_layers:
        return None
    rest = name[m.end() :]
    if rest in MTP_SHARED_COPIES:
        return None
    return f"mtp_layers.{int(m[1]) - num_layers}.{rest}"


_EXPERT_PIECE = re.compile(r"(.+)\.experts\.\d+\.(?:gate|up|down)")


def expert_piece(block: str, expert: int, projection: str) -> str:
    """The name `load_weights` reports for one expert projection:
    "model.layers.3.mlp.experts.7.up"."""
    return f"{block}.experts.{expert}.{projection}"


class WeightLoader:
    """Applies a model's `weight_mapping` to checkpoint tensors (`MoeCausalLM.load_weights`,
    `wants_weight`, `expected_weight_names` delegate here).

    Args:
        model: the model (`MoeCausalLM`); its class's `weight_mapping` names the tensors.
        on_experts_loaded: called with a `FusedMoE` block once every piece of its local float
            experts is in (gate, up and down of each local expert; never for experts that
            arrive 4-bit), so that they can be quantized before the next block's arrive.

    A block's float expert stacks still on the meta device (a model built there,
    `models.materialize`) are allocated on the device of their first checkpoint tensor.
    """

    def __init__(
        self, model: nn.Module, on_experts_loaded: Callable[[FusedMoE], None] | None = None
    ) -> None:
        self.model = model
        self.on_experts_loaded = on_experts_loaded
        self.mapping: WeightMapping = model.weight_mapping
        self.num_layers = len(model.model.layers)
        self.num_mtp_layers = len(getattr(model, "mtp_layers", ()))
        e = self.mapping.experts
        names = "|".join(re.escape(n) for n in {e.gate, e.up, e.down})
        self._expert = re.compile(rf"(.+)\.experts\.(\d+)\.({names})\.weight$")
        self._expert_id = re.compile(r"(.+)\.experts\.(\d+)\.")
        fused_names = {e.fused_gate_up, e.fused_down, e.fused_gate, e.fused_up} - {""}
        fused = "|".join(re.escape(n) for n in fused_names)
        self._fused = re.compile(rf"(.+)\.experts\.({fused})(_bias|_blocks|_scales)?$")
        self._shard = {e.gate: "gate", e.up: "up", e.down: "down"}
        self.moes = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.merged = {n: m for n, m in model.named_modules() if isinstance(m, MergedLinear)}
        self.params = dict(model.named_parameters(remove_duplicate=False))
        for prefix, module in model.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    self.params[f"{prefix}.{name}" if prefix else name] = buf
        #: per block, the float expert pieces still to come (`on_experts_loaded`)
        self._experts_left: dict[str, set[str]] = {}
        if on_experts_loaded is not None:
            self._experts_left = {
                block: {expert_piece(block, e, p) for e in set(moe.local_experts)
                        for p in expert_weights.projections_of(moe)}
                for block, moe in self.moes.items()
            }

    def expected_names(self) -> set[str]:
        """Every piece loading must fill: parameters and persistent buffers, each merged
        projection per shard ("...qkv_proj.weight.q"), stacked expert weights per expert and
        projection ("model.layers.3.mlp.experts.7.up")."""
        names = set()
        for n in self.params:
            module, _, _ = n.rpartition(".")
            if module in self.merged:
                names |= {f"{n}.{shard}" for shard in self.merged[module].shards}
            elif not (module in self.moes and n.endswith((".w13", ".w2"))):
                names.add(n)
        if getattr(self.model.spec, "tie_word_embeddings", False):
            names.discard("lm_head.weight")
        for block, moe in self.moes.items():
            for e in set(moe.local_experts):
                names |= {expert_piece(block, e, p) for p in expert_weights.projections_of(moe)}
        return names

    def checkpoint_names(self, pieces: Iterable[str]) -> list[str]:
        """The checkpoint tensor names of `expected_names` pieces (what a user finds in the
        safetensors files): "...qkv_proj.weight.k" -> "...k_proj.weight", an expert piece
        "...experts.7.up" -> "...experts.7.up_proj.weight", renames undone."""
        parts = {shard: (merged, part) for merged, part, shard in self.mapping.stacked_params}
        names = []
        for piece in pieces:
            module, _, shard = piece.rpartition(".")
            if module.rpartition(".")[0] in self.merged and shard in parts:
                merged, part = parts[shard]
                piece = module.replace(merged, part)
            elif m := re.fullmatch(r"(.+\.experts\.\d+)\.(gate|up|down)", piece):
                piece = f"{m[1]}.{self.mapping.experts.name_of(m[2])}.weight"
            if m := re.match(r"mtp_layers\.(\d+)\.", piece):
                piece = f"model.layers.{self.num_layers + int(m[1])}.{piece[m.end():]}"
            names.append(self.mapping.checkpoint_name(piece))
        return names

    def match_expert(self, name: str) -> re.Match | None:
        """A per-expert weight's (renamed) name matched: (block, expert id, checkpoint
        projection name), else None."""
        return self._expert.match(name)

    def match_fused(self, name: str) -> re.Match | None:
        """An all-experts tensor's (renamed) name matched: (block, projection, suffix or
        None), else None (the block may still not be a `FusedMoE`)."""
        return self._fused.match(name)

    def shard_of(self, projection: str) -> str:
        """"gate" | "up" | "down" for a checkpoint projection name (`ExpertMapping`)."""
        return self._shard[projection]

    def skipped(self, name: str) -> bool:
        """Whether checkpoint tensor `name` matches the mapping's `skipped` and has no place in
        the model."""
        return self.mapping.skips(name) and self.mapping.model_name(name) not in self.params

    def zero_absent(self, missing: Iterable[str]) -> list[str]:
        """Fill with zeros the `missing` pieces (`expected_names` a load did not fill) that the
        mapping's `optional` names; returns the others, still missing."""
        left = []
        for piece in missing:
            if piece in self.params and any(re.search(p, piece) for p in self.mapping.optional):
                self.params[piece].data.zero_()
            else:
                left.append(piece)
        return left

    def wants(self, name: str) -> bool:
        """False for a per-expert checkpoint tensor of an expert this rank does not hold (or
        of a block that is not a `FusedMoE`), and for a tensor of a layer beyond the model's
        `num_layers` (`beyond_num_layers`), or one the mapping ignores: the loader then never
        reads it."""
        if self.skipped(name):
            return False
        if beyond_num_layers(name, self.num_layers):
            name = mtp_model_name(name, self.num_layers, self.num_mtp_layers)
            if name is None:
                return False
        if m := self._expert_id.match(self.mapping.model_name(name)):
            moe = self.moes.get(m[1])
            return moe is not None and bool(moe.local_slots(int(m[2])))
        return True

    def load(self, weights: Iterable[tuple[str, torch.Tensor | Int4Weight]]) -> set[str]:
        """Copy every tensor into its place; returns the pieces filled (`expected_names`).

        Raises:
            ValueError: an unexpected tensor name or a shape mismatch (names both shapes).
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.skipped(name):
                continue
            if beyond_num_layers(name, self.num_layers):
                name = mtp_model_name(name, self.num_layers, self.num_mtp_layers)
                if name is None:
                    continue
            filled = self.load_one(self.mapping.model_name(name), tensor)
            loaded |= filled
            if self._experts_left:
                self._note_experts(filled)
        for module in self.model.modules():  # native kernels' packed copies are stale now
            if isinstance(module, Linear | FusedMoE | SharedExperts):
                module.reset_packed()
        return loaded

    def _note_experts(self, filled: set[str]) -> None:
        """Count expert pieces off their blocks' lists; call `on_experts_loaded` for a block
        whose float experts are now complete (a 4-bit block is left alone)."""
        for piece in filled:
            m = _EXPERT_PIECE.fullmatch(piece)
            left = self._experts_left.get(m[1]) if m else None
            if left is None:
                continue
            left.discard(piece)
            if not left:
                del self._experts_left[m[1]]
                moe = self.moes[m[1]]
                if moe.quantized is None and self.on_experts_loaded is not None:
                    self.on_experts_loaded(moe)

    def load_one(self, name: str, tensor: torch.Tensor | Int4Weight) -> set[str]:
        """One tensor under its (renamed) model name; returns the pieces it filled."""
        if m := self._expert.match(name):
            block, expert, shard = m[1], int(m[2]), self._shard[m[3]]
            if isinstance(tensor, Int4Weight):
                expert_weights.load_int4_expert(self.moes[block], expert, shard, tensor)
            else:
                materialize_float_experts(self.moes[block], tensor.device)
                expert_weights.load_expert(self.moes[block], expert, shard, tensor)
            return {expert_piece(block, expert, shard)}
        if isinstance(tensor, Int4Weight):
            # Only routed experts run in int4; any other Linear is dequantized exactly, in the
            # scale's dtype as compressed-tensors' own decompression does.
            tensor = dequantize_int4(*tensor, dtype=tensor.scales.dtype)
        if (m := self._fused.match(name)) and m[1] in self.moes:
            return self._load_fused(name, self.moes[m[1]], m[1], m[2], m[3] or "", tensor)
        for merged, part, shard in self.mapping.stacked_params:
            target = name.replace(part, merged)
            module = self.merged.get(target.rpartition(".")[0])
            if part in name and module is not None:
                _copy(name, module.shard_view(self.params[target], shard), tensor)
                return {f"{target}.{shard}"}
        if name == "lm_head.weight" and getattr(self.model.spec, "tie_word_embeddings", False):
            return set()
        if name not in self.params:
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in {type(self.model).__name__}"
            )
        _copy(name, self.params[name].data, tensor)
        merged = self.merged.get(name.rpartition(".")[0])
        if merged is not None:  # stored whole (DBRX's Wqkv, Granite's shared input_linear)
            return {f"{name}.{shard}" for shard in merged.shards}
        return {name}

    def _load_fused(
        self, name: str, moe: FusedMoE, block: str, proj: str, kind: str, tensor: torch.Tensor
    ) -> set[str]:
        """All experts of one projection (weights, biases or MXFP4 blocks/scales)."""
        e = self.mapping.experts
        if e.flat:
            tensor = tensor.reshape(moe.num_experts, -1, tensor.shape[-1])
        if proj in (e.fused_gate, e.fused_up) and not kind:  # gate or up alone, [E, I, H]
            shard = "gate" if proj == e.fused_gate else "up"
            materialize_float_experts(moe, tensor.device)
            expert_weights.load_all_experts(moe, shard, tensor)
            return {expert_piece(block, x, shard) for x in moe.local_experts}
        gate_up = proj == e.fused_gate_up
        shard = "gate_up" if gate_up else "down"
        pieces = {expert_piece(block, x, p) for x in moe.local_experts
                  for p in (("gate", "up") if gate_up else ("down",))}
        interleaved = gate_up and e.interleaved_gate_up
        if kind in ("_blocks", "_scales"):
            if interleaved:
                tensor = expert_weights.deinterleave_gate_up(tensor, dim=1)  # rows = outputs
            done = expert_weights.load_mxfp4_experts(moe, shard, kind[1:], tensor,
                                                     owned=interleaved)
            return pieces if done else set()
        hidden, size = moe.gate.in_features, moe.intermediate_size
        if kind == "_bias":
            _check_shape(name, tensor, (moe.num_experts, 2 * size if gate_up else hidden))
            if interleaved:
                tensor = expert_weights.deinterleave_gate_up(tensor, dim=1)
            expert_weights.load_expert_biases(moe, shard, tensor)
            return {f"{block}.{'b13' if gate_up else 'b2'}"}
        if e.fused_in_out or (e.fused_down_in_out and not gate_up):
            want = (moe.num_experts, hidden, 2 * size) if gate_up else (
                moe.num_experts, size, hidden
            )
            _check_shape(name, tensor, want)
            tensor = tensor.transpose(1, 2)  # [E, out, in]
        if interleaved:
            tensor = expert_weights.deinterleave_gate_up(tensor, dim=1)
        materialize_float_experts(moe, tensor.device)
        expert_weights.load_all_experts(moe, shard, tensor)
        return pieces


def _check_shape(name: str, tensor: torch.Tensor, want: tuple) -> None:
    """Raise ValueError naming the tensor and both shapes."""
    if tuple(tensor.shape) != want:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{want} (this architecture's layout)"
        )


def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
