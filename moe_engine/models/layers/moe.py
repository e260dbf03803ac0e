"""The sparse MoE block: router -> top-k -> dispatch -> local experts -> combine.

The pipeline vLLM names in one comment (router, quantise-dispatch, permute-experts-unpermute,
combine) with the communicator as the seam for expert parallelism (DESIGN.md sections 2 and 6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from comm import Communicator, NoopCommunicator
from kernels.activation import SILU_AND_MUL, SwiGLU
from kernels.cpu import fused_moe_cpu
from kernels.cpu_native import PackedExperts, native_moe_available
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from moe_engine.phase_timer import PhaseTimer
from quant.int4 import SYMMETRIC_ZERO, Int4Weight
from quant.mxfp4 import MXFP4_BLOCK_SIZE


class _NoTimer:
    """A `PhaseTimer` stand-in that times nothing."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


_NO_TIMER = _NoTimer()


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top-k, optionally renormalised to sum to 1.

    The routing of Qwen3-MoE (`norm_topk_prob`) and Mixtral (always renormalised) in Hugging
    Face `transformers`. Ties go to the lower expert id (stable sort), so identical logits still
    give k distinct experts deterministically.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.
        renormalize: divide the k probabilities by their sum.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the logits, then softmax over those k (gpt-oss; `GptOssTopKRouter` in Hugging
    Face `transformers`, whose `torch.topk` and softmax in the logits' dtype this repeats).

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.

    Returns:
        topk_weights [T, k] float32 (sum to 1), topk_ids [T, k] int32.
    """
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    weights = F.softmax(logits, dim=-1, dtype=logits.dtype).float()
    return weights, ids.to(torch.int32)


#: Routing rules `FusedMoE` accepts: softmax over all experts then top-k (Qwen3-MoE, Mixtral),
#: or top-k of the logits then softmax over them (gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")


class FusedMoE(nn.Module):
    """Routed SwiGLU experts stored stacked: w13 [E_local, 2*I, H] (gate; up), w2 [E_local, H, I].

    With one rank every expert is local (E_local = E, slot e holds expert e). Under expert
    parallelism `shard_experts` keeps only the slots this rank's placement gives it; the router
    still scores all E experts and the communicator moves tokens to the ranks holding them.

    Args:
        num_experts: E, routed experts in the model.
        top_k: experts per token.
        hidden_size: H; intermediate_size: I (per expert).
        renormalize: renormalise the top-k weights (see `softmax_topk`).
        dtype: parameter dtype.
        communicator: EP seam; `NoopCommunicator` for one rank.
        routing: "softmax_topk" (default) or "topk_softmax" (gpt-oss, `topk_softmax`).
        router_bias: the router Linear has a bias (gpt-oss).
        expert_bias: experts have biases b13 [E_local, 2I] (gate; up) and b2 [E_local, H],
            stored and sliced per local slot like w13/w2 (gpt-oss).
        activation: plain SwiGLU (default) or gpt-oss's clamped one (`kernels.activation`).

    Raises:
        ValueError: an unknown routing.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        communicator: Communicator | None = None,
        *,
        routing: str = "softmax_topk",
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: SwiGLU = SILU_AND_MUL,
    ) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.routing, self.activation = routing, activation
        self.intermediate_size = intermediate_size
        self.gate = Linear(hidden_size, num_experts, bias=router_bias, dtype=dtype)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if expert_bias:
            self.b13 = nn.Parameter(
                torch.empty(num_experts, 2 * intermediate_size, dtype=dtype), requires_grad=False
            )
            self.b2 = nn.Parameter(
                torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
            )
        self._mxfp4_pieces: dict[tuple[str, str], torch.Tensor] = {}  # (shard, part)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False,
        )
        self.communicator: Communicator = communicator or NoopCommunicator()
        self.local_experts: list[int] = list(range(num_experts))
        self._slots_of: dict[int, list[int]] = {e: [e] for e in range(num_experts)}
        self.quantized: QuantizedExperts | None = None
        self._packed: PackedExperts | None = None  # native layout, made by the first forward
        self._int4_pieces: dict[tuple[int, str], Int4Weight] = {}  # (slot, shard)
        self.load_recorder: ExpertLoadRecorder | None = None
        self.timer: PhaseTimer | None = None
        self.ep_rank: int | None = None  # set by shard_experts
        self.layer_index = -1

    def shard_experts(
        self, local_experts: list[int], communicator: Communicator, rank: int = 0
    ) -> None:
        """Keep only this rank's expert slots (call before loading weights).

        Args:
            rank: this rank's index (the recorder's per-rank column).
            local_experts: the global expert id held by each local slot, in slot order (an
                expert may appear on several ranks when it is replicated).
            communicator: moves tokens to and from the ranks holding their experts.

        Raises:
            ValueError: an expert id outside [0, num_experts) or an empty slot list.
        """
        if not local_experts or not all(0 <= e < self.num_experts for e in local_experts):
            raise ValueError(
                f"local experts {local_experts} must be a non-empty list of expert ids in "
                f"[0, {self.num_experts})"
            )
        self.local_experts = list(local_experts)
        self._slots_of = {}
        for slot, expert in enumerate(self.local_experts):
            self._slots_of.setdefault(expert, []).append(slot)
        n, (two_i, h), (h2, i) = len(local_experts), self.w13.shape[1:], self.w2.shape[1:]
        dtype = self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(n, two_i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, h2, i, dtype=dtype), requires_grad=False)
        if self.b13 is not None:
            self.b13 = nn.Parameter(torch.empty(n, two_i, dtype=dtype), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(n, h2, dtype=dtype), requires_grad=False)
        self.communicator = communicator
        self.ep_rank = rank

    def local_slots(self, expert: int) -> list[int]:
        """The local slots holding global expert `expert` (empty when another rank holds it)."""
        return self._slots_of.get(expert, [])

    def attach_recorder(self, recorder: ExpertLoadRecorder, layer_index: int) -> None:
        """Count this layer's routing into `recorder` under decoder layer `layer_index`."""
        self.load_recorder, self.layer_index = recorder, layer_index

    def quantize(
        self, method: str, group_size: int, scale_dtype: torch.dtype = torch.float32
    ) -> None:
        """Replace the float expert weights by a 4-bit copy (see `QuantizedExperts`; int4
        scales stored in `scale_dtype`).

        Raises:
            ValueError: a group size that does not divide the dimension it groups.
        """
        self.quantized = QuantizedExperts(
            self.w13.data, self.w2.data, method, group_size, scale_dtype=scale_dtype,
            **self._expert_extras(),
        )
        del self.w13, self.w2

    def _expert_extras(self) -> dict:
        """The activation and biases every expert path takes as keyword arguments (the biases
        as plain tensors sharing the parameters' storage, so that a `QuantizedExperts` holding
        them neither registers them again nor misses a later in-place load)."""
        b13, b2 = (None if b is None else b.data for b in (self.b13, self.b2))
        return {"activation": self.activation, "b13": b13, "b2": b2}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H] -> [T, H], same dtype."""
        timer = self.timer or _NO_TIMER
        with timer.phase("router"):
            router_logits = self.gate(hidden)  # [T, E]
            if self.routing == "topk_softmax":
                topk_weights, topk_ids = topk_softmax(router_logits, self.top_k)
            else:
                topk_weights, topk_ids = softmax_topk(router_logits, self.top_k, self.renormalize)
            if self.load_recorder is not None:
                self.load_recorder.record(self.layer_index, topk_ids)
        with timer.phase("dispatch"):
            sent = self.communicator.dispatch(hidden, topk_ids, topk_weights)
            if self.load_recorder is not None and self.ep_rank is not None:
                # expert work of this rank: the token-expert pairs its slots process
                mine = torch.zeros(self.load_recorder.ep_size, dtype=torch.int64)
                mine[self.ep_rank] = (sent.topk_ids >= 0).sum()
                self.load_recorder.record_rank_tokens(self.layer_index, mine)
        with timer.phase("experts"):
            packed = None if self.quantized is not None else self._packed_experts()
            if self.quantized is not None:
                expert_out = self.quantized(sent.hidden, sent.topk_weights, sent.topk_ids)
            elif packed is not None:
                expert_out = packed(sent.hidden, sent.topk_weights, sent.topk_ids)
            else:
                expert_out = fused_moe_cpu(
                    sent.hidden,
                    self.w13,
                    self.w2,
                    sent.topk_weights,
                    sent.topk_ids,
                    **self._expert_extras(),
                )
        with timer.phase("combine"):
            return self.communicator.combine(expert_out, sent.handle)

    def reset_packed(self) -> None:
        """Forget the native kernel's packed copy (call after changing weights in place)."""
        self._packed = None

    def _packed_experts(self) -> PackedExperts | None:
        """The native kernel's copy of the float expert weights (kernels/cpu_native.py),
        packed on first use after loading (`load_expert_weight` drops it); None when the native
        kernel is unavailable or the weights are not on a CPU.
        """
        if self._packed is not None:
            return self._packed
        if self.w13.device.type != "cpu" or not native_moe_available():
            return None
        if self._packed is None:
            self._packed = PackedExperts.pack(self.w13.data, self.w2.data, **self._expert_extras())
        return self._packed

    def load_quantized_expert_weight(self, expert: int, shard: str, weight: Int4Weight) -> None:
        """Take one expert projection that the checkpoint stores in int4 already.

        Once every projection of every local slot has arrived, the layer's experts become a
        `QuantizedExperts` built from them (`QuantizedExperts.from_int4`) and the float w13/w2
        are dropped.

        Args:
            expert: global expert id; projections of experts this rank does not hold are
                skipped.
            shard: "gate" | "up" ([I, H]) or "down" ([H, I]).
            weight: the projection in `quant.int4`'s representation.

        Raises:
            ValueError: a shape that does not match the model's (names both), a projection
                arriving after the layer's int4 experts were assembled, or group sizes that
                differ.
        """
        hidden, size = self.gate.in_features, self.intermediate_size
        want = (hidden, size) if shard == "down" else (size, hidden)
        if tuple(weight.shape) != want:
            raise ValueError(
                f"int4 expert weight {shard} of expert {expert}: checkpoint shape "
                f"{tuple(weight.shape)} does not match the model's {want}"
            )
        own = self.local_slots(expert)
        if own and self.quantized is not None:
            raise ValueError(f"int4 expert weight {shard} of expert {expert}: loaded twice")
        for slot in own:
            self._int4_pieces[(slot, shard)] = weight
        slots = range(len(self.local_experts))
        if len(self._int4_pieces) < 3 * len(slots):
            return
        pieces = self._int4_pieces
        w13 = [_cat_rows(pieces[(s, "gate")], pieces[(s, "up")]) for s in slots]
        self.quantized = QuantizedExperts.from_int4(w13, [pieces[(s, "down")] for s in slots])
        for name, value in self._expert_extras().items():
            setattr(self.quantized, name, value)
        self._int4_pieces = {}
        del self.w13, self.w2

    def load_mxfp4_expert_weight(self, shard: str, part: str, tensor: torch.Tensor) -> bool:
        """Take one MXFP4 tensor of all experts as a checkpoint stores it (gpt-oss
        `*_blocks` / `*_scales`, already in the engine's row order: gate rows then up rows).

        Once the blocks and scales of both projections have arrived, the layer's experts
        become a `QuantizedExperts` over them (`QuantizedExperts.from_mxfp4`: no float round
        trip) and the float w13/w2 are dropped.

        Args:
            shard: "gate_up" (w13: blocks [E, 2I, H // 32, 16], scales [E, 2I, H // 32]) or
                "down" (w2: blocks [E, H, I // 32, 16], scales [E, H, I // 32]); uint8.
            part: "blocks" or "scales".
            tensor: the checkpoint tensor for all E experts; this rank keeps its local slots.

        Returns:
            True when this projection now has both its blocks and its scales.

        Raises:
            ValueError: an unknown shard or part, a shape that does not match the model's
                (names both), or a tensor arriving twice.
        """
        if shard not in ("gate_up", "down") or part not in ("blocks", "scales"):
            raise ValueError(f"mxfp4 expert tensor {shard}_{part}: unknown shard or part")
        hidden, size = self.gate.in_features, self.intermediate_size
        rows, cols = (2 * size, hidden) if shard == "gate_up" else (hidden, size)
        want = (self.num_experts, rows, cols // MXFP4_BLOCK_SIZE)
        if part == "blocks":
            want = (*want, MXFP4_BLOCK_SIZE // 2)
        if tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
            raise ValueError(
                f"mxfp4 expert tensor {shard}_{part}: checkpoint {tensor.dtype} "
                f"{tuple(tensor.shape)} does not match the model's uint8 {want}"
            )
        if (shard, part) in self._mxfp4_pieces or (
            self.quantized is not None and self.quantized.method == "mxfp4"
        ):
            raise ValueError(f"mxfp4 expert tensor {shard}_{part}: loaded twice")
        self._mxfp4_pieces[(shard, part)] = tensor[self.local_experts].contiguous()
        pieces = self._mxfp4_pieces
        if len(pieces) == 4:
            self.quantized = QuantizedExperts.from_mxfp4(
                (pieces[("gate_up", "blocks")], pieces[("gate_up", "scales")]),
                (pieces[("down", "blocks")], pieces[("down", "scales")]),
                **self._expert_extras(),
            )
            self._mxfp4_pieces = {}
            del self.w13, self.w2
            return True
        other = "scales" if part == "blocks" else "blocks"
        return (shard, other) in pieces

    def load_expert_weight(self, expert: int, shard: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into the stacked weights.

        Args:
            expert: global expert id (ignored for the all-expert shards); tensors of experts
                this rank does not hold are skipped.
            shard: "gate" | "up" | "down" (one expert) or "gate_up" | "down_all" (all
                experts, transformers 5 fused layout) or "gate_up_bias" | "down_bias" (all
                experts' biases, when the layer has them).
            tensor: gate/up [I, H], down [H, I], gate_up [E, 2I, H], down_all [E, H, I],
                gate_up_bias [E, 2I] (gate; up), down_bias [E, H].

        Raises:
            ValueError: on a shape mismatch, naming both shapes, or a bias the layer lacks.
        """
        self._packed = None
        if shard in ("gate_up_bias", "down_bias") and self.b13 is None:
            raise ValueError(f"expert weight {shard}: this MoE layer has no expert biases")
        if shard in ("gate_up", "down_all", "gate_up_bias", "down_bias"):
            names = {"gate_up": "w13", "down_all": "w2", "gate_up_bias": "b13", "down_bias": "b2"}
            target = getattr(self, names[shard]).data
            expected = (self.num_experts, *target.shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"expert weight {shard}: checkpoint shape {tuple(tensor.shape)} does not "
                    f"match the model's {expected}"
                )
            target.copy_(tensor[self.local_experts])
            return
        size = self.intermediate_size
        for slot in self.local_slots(expert):
            target = {
                "gate": self.w13.data[slot, :size],
                "up": self.w13.data[slot, size:],
                "down": self.w2.data[slot],
            }[shard]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"expert weight {shard} of expert {expert}: checkpoint shape "
                    f"{tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                )
            target.copy_(tensor)


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
