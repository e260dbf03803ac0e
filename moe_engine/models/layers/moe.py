"""The sparse MoE block: router -> top-k -> dispatch -> local experts -> combine.

The pipeline vLLM names in one comment (router, quantise-dispatch, permute-experts-unpermute,
combine) with the communicator as the seam for expert parallelism (DESIGN.md sections 2 and 6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from comm import Communicator, NoopCommunicator
from comm.base import DispatchResult
from kernels.moe.activation import SILU_AND_MUL, SquaredReLU, SwiGLU
from kernels.moe.backends import BoundExperts, ExpertExtras
from kernels.plan import TORCH, KernelPlan
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from moe_engine.models.layers.routing import (
    routing_counts_experts,
    softmax_topk,
    split_zero_experts,
    topk_softmax,
)
from moe_engine.models.layers.shared_experts import SharedExperts
from moe_engine.phase_timer import PhaseTimer
from moe_engine.routing_capture import RoutedExpertsCapture
from quant.int4 import Int4Weight


class _NoTimer:
    """A `PhaseTimer` stand-in that times nothing (one shared null context)."""

    _null = contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.nullcontext:
        return self._null


_NO_TIMER = _NoTimer()

__all__ = ["ROUTINGS", "FusedMoE", "softmax_topk", "topk_softmax"]  # routing: old callers

#: Routing rules `FusedMoE` accepts: softmax over all experts then top-k (Qwen3-MoE, Mixtral),
#: or top-k of the logits then softmax over them (gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")


def weight_on_input(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' inputs when the routing weight scales the input (Llama 4).

    Args:
        hidden: [T, H]; topk_weights: [T, k] float32; topk_ids: [T, k] int32.

    Returns:
        (rows, weights, ids): for k = 1, hidden * w ([T, H], the weight rounded to hidden's
        dtype first, as transformers multiplies), weights of ones and the ids; for k > 1 one
        row per (token, expert) pair in token-major order ([T * k, H], [T * k, 1], [T * k, 1]).
    """
    w = topk_weights.to(hidden.dtype)
    ones = torch.ones_like(topk_weights)
    if topk_ids.shape[1] == 1:
        return hidden * w, ones, topk_ids
    k = topk_ids.shape[1]
    rows = hidden.repeat_interleave(k, dim=0) * w.reshape(-1, 1)
    return rows, ones.reshape(-1, 1), topk_ids.reshape(-1, 1)


class FusedMoE(nn.Module):
    """Routed SwiGLU experts stored stacked: w13 [E_local, 2*I, H] (gate; up), w2 [E_local, H, I].

    With one rank every expert is local (E_local = E, slot e holds expert e). Under expert
    parallelism `shard_experts` keeps only the slots this rank's placement gives it; the router
    still scores all E experts and the communicator moves tokens to the ranks holding them.
    Checkpoint formats (per-expert, fused, int4, MXFP4) are copied in by
    `layers/expert_weights.py`.

    The expert kernel is chosen once, by `bind_kernels(plan)` after loading (and quantizing):
    float experts run the plan's "fused_moe" kernel, 4-bit ones their `QuantizedExperts`' bound
    kernel. The float parameters w13/w2 stay the canonical copy (the loader writes them in
    place; `reset_packed` then makes the bound layout be rebuilt from them).

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
        activation: plain SwiGLU (default) or gpt-oss's clamped one (`kernels.moe.activation`),
            or the non-gated `SquaredReLU` (Nemotron-H): w13 is then [E_local, I, H], the up
            projection alone, and the experts run the torch expert path (the plan's
            "fused_moe" kernel hands them over: `kernels.moe.backends.bind_float_experts`).
        router: a router module (`layers.routing`: hidden [T, H] -> topk_weights [T, k] fp32,
            topk_ids [T, k] int32, with `num_experts`, `top_k` and its checkpoint names
            `weight`, `bias`, `e_score_correction_bias`); it becomes `self.gate`, so
            `mlp.gate.*` load by name. None (default): a Linear gate and `routing`.
        shared_experts: run on this rank's own tokens beside the routed path (never
            dispatched) and added after combine (`layers.shared_experts`); None: none.
        output_scale: multiplies the block's output, routed plus shared (Cohere2-MoE's
            "average" shared-expert combination, (routed + shared) / 2, is 0.5: a power of
            two, so the product rounds exactly as transformers' division); default 1.
        output_bias: hold `bias` [H], added to the block's output (JetMoE's `mlp.bias`).
        apply_router_weight_on_input: each routed expert takes the token already multiplied
            by its routing weight and its output is not weighted (Llama 4's
            `Llama4TextMoe`: silu(gate(w x)) * up(w x), not w * silu(gate(x)) * up(x); vLLM's
            flag of that name). With top_k > 1 each (token, expert) pair is its own row
            through dispatch and the experts, and a token's k outputs are summed after.
        zero_experts: zero-computation ("identity") experts the router scores after the E
            real ones (LongCat-Flash's `zero_expert_num`): their slots never reach dispatch
            or the expert kernels (`routing.split_zero_experts`: id -1, weight 0), and each
            token adds its input times the weight it gave them. Needs a `router` of
            num_experts + zero_experts experts.

    Raises:
        ValueError: an unknown routing, or a router whose num_experts / top_k differ.
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
        activation: SwiGLU | SquaredReLU = SILU_AND_MUL,
        router: nn.Module | None = None,
        shared_experts: SharedExperts | None = None,
        output_scale: float = 1.0,
        output_bias: bool = False,
        apply_router_weight_on_input: bool = False,
        zero_experts: int = 0,
    ) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        scored = num_experts + zero_experts
        if zero_experts and router is None:
            raise ValueError("zero_experts need a router module scoring them")
        if router is not None and (router.num_experts, router.top_k) != (scored, top_k):
            raise ValueError(
                f"router has {router.num_experts} experts, top_k {router.top_k}; the MoE layer "
                f"has {num_experts} (+ {zero_experts} zero-computation), top_k {top_k}"
            )
        self.zero_experts = zero_experts
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.routing, self.activation = routing, activation
        self.intermediate_size = intermediate_size
        self.router_module = router is not None
        self.gate = router or Linear(hidden_size, num_experts, bias=router_bias, dtype=dtype)
        self.shared_experts = shared_experts
        self.output_scale = output_scale
        self.bias = (
            nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
            if output_bias else None
        )
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        rows = (2 if activation.gated else 1) * intermediate_size  # gate and up, or up alone
        if expert_bias:
            self.b13 = nn.Parameter(
                torch.empty(num_experts, rows, dtype=dtype), requires_grad=False
            )
            self.b2 = nn.Parameter(
                torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
            )
        self.w13 = nn.Parameter(
            torch.empty(num_experts, rows, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False,
        )
        self.communicator: Communicator = communicator or NoopCommunicator()
        self.local_experts: list[int] = list(range(num_experts))
        self._slots_of: dict[int, list[int]] = {e: [e] for e in range(num_experts)}
        self.quantized: QuantizedExperts | None = None
        self.kernel_backend: str | None = None  # the float experts' backend (bind_kernels)
        #: Bound by `bind_kernels`: the one-call routing of `routing` (`KernelPlan.
        #: router_topk`, the torch function's arguments), None: the torch function.
        self.router_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._packed: BoundExperts | None = None  # its layout; rebuilt after reset_packed
        self._plan: KernelPlan | None = None  # the plan it was bound with
        # checkpoint pieces the loader holds until the 4-bit experts are complete
        # (`expert_weights.load_int4_expert`, `load_mxfp4_experts`)
        self.pending_int4: dict[tuple[int, str], Int4Weight] = {}  # (slot, shard)
        self.pending_mxfp4: dict[tuple[str, str], torch.Tensor] = {}  # (shard, part)
        self.load_recorder: ExpertLoadRecorder | None = None
        #: Routing replay (`attach_routed_capture`): where the router's top-k ids go, and
        #: this layer's row there; None: not recorded.
        self.routed_capture: RoutedExpertsCapture | None = None
        self.routed_row = -1
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
        self.set_local_experts(local_experts)
        n, (two_i, h), (h2, i) = len(local_experts), self.w13.shape[1:], self.w2.shape[1:]
        dtype = self.w13.dtype
        self.w13 = nn.Parameter(torch.empty(n, two_i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, h2, i, dtype=dtype), requires_grad=False)
        if self.b13 is not None:
            self.b13 = nn.Parameter(torch.empty(n, two_i, dtype=dtype), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(n, h2, dtype=dtype), requires_grad=False)
        self.communicator = communicator
        self.ep_rank = rank

    def set_local_experts(self, local_experts: list[int]) -> None:
        """Record which global expert each local slot holds, weights untouched: what
        `shard_experts` does before allocating, and what runtime EPLB (`moe_engine.eplb`)
        does after it wrote the moved experts into their slots.

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

    def local_slots(self, expert: int) -> list[int]:
        """The local slots holding global expert `expert` (empty when another rank holds it)."""
        return self._slots_of.get(expert, [])

    def attach_recorder(self, recorder: ExpertLoadRecorder, layer_index: int) -> None:
        """Count this layer's routing into `recorder` under decoder layer `layer_index`."""
        self.load_recorder, self.layer_index = recorder, layer_index

    def attach_routed_capture(self, capture: RoutedExpertsCapture | None, row: int = -1) -> None:
        """Write this layer's router top-k ids into row `row` of `capture` every forward
        (routing replay; None: stop)."""
        self.routed_capture, self.routed_row = capture, row

    def quantize(
        self, method: str, group_size: int, scale_dtype: torch.dtype = torch.float32
    ) -> None:
        """Replace the float expert weights by a 4-bit copy (see `QuantizedExperts`; int4
        scales stored in `scale_dtype`).

        Raises:
            ValueError: a group size that does not divide the dimension it groups, or
                non-gated experts (the 4-bit kernels compute SwiGLU).
        """
        if not self.activation.gated:
            raise ValueError("4-bit experts: non-gated (relu^2) experts are not supported by "
                             "the 4-bit expert kernels, which compute SwiGLU; serve them in float")
        self.quantized = QuantizedExperts(
            self.w13.data, self.w2.data, method, group_size, scale_dtype=scale_dtype,
            **self.expert_extras(),
        )
        del self.w13, self.w2

    def expert_extras(self) -> dict:
        """The activation and biases every expert path takes as keyword arguments (the biases
        as plain tensors sharing the parameters' storage, so that a `QuantizedExperts` holding
        them neither registers them again nor misses a later in-place load)."""
        b13, b2 = (None if b is None else b.data for b in (self.b13, self.b2))
        return {"activation": self.activation, "b13": b13, "b2": b2}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H] -> [T, H], same dtype: combine(experts(dispatch(hidden))) plus the
        shared experts of this rank's own tokens (times `output_scale` where it is not 1, plus
        `bias` where the block has one)."""
        out = self._forward(hidden)
        if self.output_scale != 1.0:
            out = out * self.output_scale
        return out if self.bias is None else out + self.bias

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        timer = self.timer or _NO_TIMER
        with timer.phase("router"):
            counts = self._count_in_router(hidden.shape[0])
            topk_weights, topk_ids = self._route(hidden, counts)
            if self.routed_capture is not None:  # logical ids, before any zero-expert split
                self.routed_capture.record(self.routed_row, topk_ids)
            zero_weight = None
            if self.zero_experts:
                topk_weights, topk_ids, zero_weight = split_zero_experts(
                    topk_weights, topk_ids, self.num_experts
                )
            if self.load_recorder is not None and not counts:  # routed pairs only
                self.load_recorder.record(
                    self.layer_index, topk_ids, skip_negative=zero_weight is not None
                )
        routed = hidden
        if self.apply_router_weight_on_input:
            routed, topk_weights, topk_ids = weight_on_input(hidden, topk_weights, topk_ids)
        with timer.phase("dispatch"):
            sent = self.communicator.dispatch(routed, topk_ids, topk_weights)
            if self.load_recorder is not None and self.ep_rank is not None:
                # expert work of this rank: the token-expert pairs its slots process
                mine = torch.zeros(
                    self.load_recorder.ep_size, dtype=torch.int64, device=hidden.device
                )
                mine[self.ep_rank] = (sent.topk_ids >= 0).sum()
                self.load_recorder.record_rank_tokens(self.layer_index, mine)
        experts = self.quantized if self.quantized is not None else self._float_experts()
        out = self._experts_and_shared(hidden, routed, sent, experts, timer)
        if zero_weight is None:
            return out
        return out + (zero_weight * hidden.float()).to(out.dtype)  # the identity experts

    def _experts_and_shared(
        self,
        hidden: torch.Tensor,
        routed: torch.Tensor,
        sent: DispatchResult,
        experts: BoundExperts | QuantizedExperts,
        timer: PhaseTimer | _NoTimer,
    ) -> torch.Tensor:
        """The routed experts on the dispatched rows (`routed`: hidden, or one row per pair
        when the weight goes on the input), combined, plus the shared experts of this rank's
        own tokens: [T, H] in hidden's dtype."""
        if (self.shared_experts is not None and self._adds_in_experts(experts)
                and routed.shape[0] == hidden.shape[0]):
            # one rank: the experts' last kernel adds the shared experts' output (same rounding)
            with timer.phase("shared_experts"):
                shared = self.shared_experts(hidden)
            with timer.phase("experts"):
                out = experts(sent.hidden, sent.topk_weights, sent.topk_ids, addend=shared)
            return out
        with timer.phase("experts"):
            expert_out = experts(sent.hidden, sent.topk_weights, sent.topk_ids)
        with timer.phase("combine"):
            out = self.communicator.combine(expert_out, sent.handle)
        if out.shape[0] != hidden.shape[0]:  # weight on input, top_k > 1: one row per pair
            out = out.view(hidden.shape[0], -1, out.shape[-1]).sum(dim=1)
        if self.shared_experts is None:
            return out
        with timer.phase("shared_experts"):
            return out + self.shared_experts(hidden)

    def _adds_in_experts(self, experts: object) -> bool:
        """Whether the shared experts' output can go into the experts' call (`addend`): the
        bound kernel takes one and combine is the identity (one rank)."""
        return bool(getattr(experts, "takes_addend", False)) and bool(
            getattr(self.communicator, "combine_is_identity", False)
        )

    def _route(
        self, hidden: torch.Tensor, counts: dict[str, torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_weights [T, k] float32, topk_ids [T, k] int32; `counts`: the
        recorder's keywords for a router that counts (`_count_in_router`), else None/empty."""
        counts = counts or {}
        if self.router_module:
            return self.gate(hidden, **counts)
        router_logits = self.gate(hidden)  # [T, E]
        if self.routing == "topk_softmax":
            return (self.router_kernel or topk_softmax)(router_logits, self.top_k, **counts)
        route = self.router_kernel or softmax_topk
        return route(router_logits, self.top_k, self.renormalize, **counts)

    def _count_in_router(self, num_tokens: int) -> dict[str, torch.Tensor | None]:
        """The load recorder's keywords (`ExpertLoadRecorder.count_target`) where the router
        counts the expert load in its own launch (the Triton routers), else {} (the recorder's
        `record` runs after it)."""
        if self.load_recorder is None or self.zero_experts:  # ids past E: counted after split
            return {}
        kernel = self.gate.kernel if self.router_module else self.router_kernel
        if not routing_counts_experts(kernel):
            return {}
        return self.load_recorder.count_target(self.layer_index, num_tokens)

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the kernels once: the routing (`KernelPlan.router_topk` for `routing`: the
        fused Triton router, native-cpu's `kernels.dense.ops.router_softmax_topk`, else the
        torch function; a router module binds its own), and the experts':
        `KernelPlan.float_experts` for float experts (the layout is built now: native-cpu
        packs `kernels.moe.native.PackedExperts`; torch and triton read w13/w2 in place), or
        the 4-bit experts' own `bind_kernels` with the same plan. Call after loading and
        quantizing, on the device the weights will stay on; calling again (a new plan, or
        after reloading weights) rebuilds the layout.

        Raises:
            ValueError: an unknown backend. RuntimeError: native-cpu with weights off the CPU,
                or 4-bit experts whose layout cannot be converted (`QuantizedExperts`).
        """
        self.router_kernel = plan.router_topk(self.gate.weight.device.type, self.routing)
        if self.quantized is not None:
            # the biases as this module holds them now (`Module.to` replaced their tensors)
            self.quantized.b13, self.quantized.b2 = (
                None if b is None else b.data for b in (self.b13, self.b2)
            )
            self.quantized.bind_kernels(plan)
            return
        self._plan = plan
        self._packed = None
        self._float_experts()

    @property
    def bound_experts(self) -> BoundExperts | None:
        """The experts' bound kernel (the 4-bit experts' or the float one), None before
        `bind_kernels` or after `reset_packed`."""
        return self.quantized.bound if self.quantized is not None else self._packed

    def reset_packed(self) -> None:
        """The float weights were (or are about to be) changed in place: drop the bound
        kernel's layout, so that the next forward rebuilds it from w13/w2 for the same
        backend (no stale weights; no re-pack per loaded tensor). 4-bit experts are never
        changed in place, so theirs stays."""
        self._packed = None

    def _float_experts(self) -> BoundExperts:
        """The bound float-expert kernel, rebuilt for the bound backend after `reset_packed`.

        Unbound (a module built outside the engine, which always binds), the backend is torch,
        as for every kernel-using layer.
        """
        if self._packed is None:
            plan = self._plan or KernelPlan.uniform(TORCH, self.w13.device.type)
            self._packed = plan.float_experts(
                self.w13.data, self.w2.data, ExpertExtras(**self.expert_extras())
            )
            self.kernel_backend = self._packed.backend
        return self._packed
