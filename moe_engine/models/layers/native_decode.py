"""Whether a decoder layer's decode step can run as one native call, and that call's kernel.

`kernels.decode_layer.native.DecodeLayerKernel` runs a whole pre-norm MoE layer (norm, QKV,
prologue, decode attention, output projection, norm, router, experts, both residual adds) from
C++ with the kernels the layer's modules were bound to; this module checks that those modules
are the ones it implements, and builds the kernel from their packed weights. The "decode_layer"
op of the kernel registry turns it on (native-cpu) or off (torch: the module path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from comm.noop import NoopCommunicator
from kernels.decode_layer.native import (
    MAX_ROWS,
    TOPK_SOFTMAX_MAX_K,
    DecodeLayerKernel,
    DecodeStepArgs,
    decode_step_args,
)
from kernels.dense.amx import AmxLinear
from kernels.dense.native_linear_q4 import PackedQuantLinear
from kernels.moe.amx import AmxExperts
from kernels.moe.native import PackedQuantExperts
from kernels.plan import KernelPlan
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.mtp import MTPLayer
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding
from moe_engine.models.layers.self_attention import Attention

if TYPE_CHECKING:
    from moe_engine.instrumentation import ExpertLoadRecorder
    from moe_engine.models.layers.attention import AttentionMetadata
    from moe_engine.models.layers.linear import Linear
    from moe_engine.routing_capture import RoutedExpertsCapture


class DecodeStep:
    """A step's inputs for the layers' native decode kernels (`MoeCausalLM.forward` makes one
    per bfloat16 step of at most `MAX_ROWS` tokens and gives it to every layer): each KV-cache
    group's arguments checked once for all its layers, on first use, and the routing outputs
    of the native layers (one [T, k] slice per layer, made with the first group that holds
    only decodes), which `record_routing` adds to the expert-load counters in one operation
    once the layers have run.

    Args:
        positions: [T] int64; meta: the step's attention metadata.
        top_k: the experts per token of the model's MoE layers.
        num_layers: the model's decoder layers (one routing slice each).
    """

    def __init__(self, positions: torch.Tensor, meta: AttentionMetadata, top_k: int,
                 num_layers: int) -> None:
        self.positions, self.meta, self.top_k = positions, meta, top_k
        self.num_layers = num_layers
        self.topk_weights: torch.Tensor | None = None  # [T, k] float32, with the first args
        self._ids: torch.Tensor | None = None  # [num_layers, T, k] int32
        self._routed: list[int] = []  # layers whose slice of _ids holds their routing
        self._recorder: ExpertLoadRecorder | None = None  # theirs
        self._captured: list[tuple[int, int]] = []  # (layer, capture row): routing replay
        self._capture: RoutedExpertsCapture | None = None
        self._args: dict[int, DecodeStepArgs | None] = {}

    @classmethod
    def of(cls, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
           top_k: int, num_layers: int) -> DecodeStep | None:
        """The step's `DecodeStep` when its rows fit the kernel (1 to `MAX_ROWS` bfloat16
        rows), else None."""
        if h.dtype != torch.bfloat16 or not 1 <= h.shape[0] <= MAX_ROWS:
            return None
        return cls(positions, meta, top_k, num_layers)

    def args(self, group: int) -> DecodeStepArgs | None:
        """KV-cache group `group`'s checked arguments; None when its tokens are not all
        decodes (a step with a prefill chunk runs the module path)."""
        if group not in self._args:
            meta = self.meta.for_group(group)
            batch = meta.batches[0] if len(meta.batches) == 1 else None
            t = self.positions.shape[0]
            decodes = batch is not None and batch.max_q == 1 and batch.token_end == t
            self._args[group] = decode_step_args(
                self.positions, meta.slot_mapping, batch.block_tables, batch.seq_lens
            ) if decodes else None
            if decodes and self._ids is None:
                self.topk_weights = torch.empty(t, self.top_k, dtype=torch.float32)
                self._ids = torch.empty(self.num_layers, t, self.top_k, dtype=torch.int32)
        return self._args[group]

    def topk_ids(self, layer: int, recorder: ExpertLoadRecorder | None,
                 capture: RoutedExpertsCapture | None = None, row: int = -1) -> torch.Tensor:
        """Decoder layer `layer`'s [T, k] int32 routing buffer (after a group's `args` said
        yes); the layer's kernel writes it, and `record_routing` adds it to `recorder` (the
        layer's, or None: not recorded) and writes it to row `row` of `capture` (routing
        replay; None: not captured)."""
        assert self._ids is not None, "args() made no routing buffers"
        if recorder is not None:
            self._routed.append(layer)
            self._recorder = recorder
        if capture is not None:
            self._captured.append((layer, row))
            self._capture = capture
        return self._ids[layer]

    def record_routing(self) -> None:
        """Add the native layers' routing to their recorder in one `index_add_` (as
        `FusedMoE.forward` records the module path's, layer by layer), and write it to the
        routing-replay capture where one is attached."""
        if self._routed:
            layers = self._routed
            self._recorder.record_layers(layers, self._ids[layers])
        if self._captured:
            layers = [layer for layer, _ in self._captured]
            self._capture.record_layers([row for _, row in self._captured], self._ids[layers])


def attach_decode_kernel(layer: DecoderLayer, plan: KernelPlan) -> None:
    """Give `layer` the native decode step where the registry chose native-cpu for
    "decode_layer" and its children (bound first) fit it, else None and the reason
    (`layer.decode_kernel`, `layer.decode_misfit`). The kernel holds the children's packed
    weights, so attach again after changing weights (as the experts' layout asks too)."""
    why = decode_misfit(layer, plan)
    layer.decode_kernel = decode_kernel(layer) if why is None else None
    layer.decode_misfit = why


def decode_misfit(layer: DecoderLayer, plan: KernelPlan) -> str | None:
    """Why `layer` (its children already bound to `plan`) cannot take the native decode step;
    None when it can."""
    if isinstance(layer, MTPLayer):
        return "an MTP layer runs the module path"
    if plan.decode_layer() is None:
        return "the registry chose torch for decode_layer"
    if type(layer) is not DecoderLayer or layer.residual_multiplier != 1.0:
        return "a layer other than the pre-norm DecoderLayer without residual multiplier"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not FusedMoE:
        return "not an Attention + FusedMoE layer"
    if layer.post_attention_layernorm is None:
        return "a parallel attention + MLP block"
    if (layer.post_self_attn_layernorm is not None or layer.post_mlp_layernorm is not None
            or layer.residual_scales is not None):
        return "output norms on the attention or MLP branch, or scaled residual adds"
    if not _norms_fit(layer.input_layernorm, layer.post_attention_layernorm):
        return "norms other than two bound bfloat16 RMSNorms of one epsilon and rounding"
    if (attn.prologue is None or type(attn.rotary) is not RotaryEmbedding
            or not attn.attn.kernels.native_decode):
        return "attention without the native prologue and decode kernel"
    if attn.gate_proj is not None:
        return "attention with an output gate"
    if attn.qk_norm and not attn.qk_norm_per_head:
        return "q/k norms over the whole projection (the kernel norms each head)"
    if attn.attn.attention_chunk_size is not None:
        return "chunked local attention (the kernel reads the whole context)"
    if attn.sinks is not None and attn.sinks.shape != (attn.num_heads,):
        return "attention sinks other than one per query head"
    projections_fit = all(_packed_kernel(p) for p in (attn.qkv_proj, attn.o_proj))
    if mlp.router_module or not (projections_fit and mlp.gate.bound_kernel().amx):
        return "projections not on the AMX or 4-bit kernel, or router not on the AMX kernel"
    if not _routing_fits(mlp):
        return ("routing other than the native softmax-top-k or a top-k-then-softmax of top_k "
                f"<= {TOPK_SOFTMAX_MAX_K} and top_k * 64 > experts")
    if mlp.bias is not None:
        return "an MoE block with an output bias"
    if (mlp.shared_experts is not None or mlp.output_scale != 1.0 or mlp.ep_rank is not None
            or type(mlp.communicator) is not NoopCommunicator):
        return "shared or expert-parallel experts, or a scaled block output"
    experts = _experts_kernel(mlp)
    if not isinstance(experts, AmxExperts | PackedQuantExperts):
        return "experts on neither the AMX nor the native 4-bit kernel"
    if (mlp.b13 is None) != (mlp.b2 is None) or (
            isinstance(experts, AmxExperts) and experts.activation != mlp.activation):
        return "experts with one of the two biases, or AMX experts of another activation"
    return None


def _norms_fit(*norms: object) -> bool:
    """Whether the layer's two norms are bound bfloat16 `RMSNorm`s of one epsilon and one
    rounding (the weight multiplied in bfloat16, or in float32 as gpt-oss's)."""
    return (all(type(n) is RMSNorm and n.kernel is not None and n.weight.dtype == torch.bfloat16
                for n in norms)
            and len({(n.eps, n.weight_in_float32) for n in norms}) == 1)


def _routing_fits(mlp: FusedMoE) -> bool:
    """Whether the layer routes as the kernel does: softmax-then-top-k on the native kernel
    (`router_kernel` bound), or top-k-then-softmax (gpt-oss) in the range the kernel repeats
    torch's bit for bit."""
    if mlp.routing == "softmax_topk":
        return mlp.router_kernel is not None
    return (mlp.routing == "topk_softmax" and mlp.top_k <= TOPK_SOFTMAX_MAX_K
            and mlp.top_k * 64 > mlp.num_experts)


def _packed_kernel(lin: Linear) -> bool:
    """Whether a projection runs the bf16 (AMX) or the 4-bit kernel, which the decode layer
    reads too."""
    kernel = lin.bound_kernel()
    return kernel.amx or kernel.q4


def _experts_kernel(mlp: FusedMoE) -> object:
    """The object a FusedMoE's experts run through (`BoundExperts.run`), or None unbound."""
    return getattr(mlp.bound_experts, "run", None)


def _projection(lin: Linear) -> AmxLinear | PackedQuantLinear:
    """A projection's weights as the decode kernel takes them: 4-bit when quantized (and
    bound to the 4-bit kernel), else AMX-packed."""
    return lin.q4_packed() if lin.bound_kernel().q4 else lin.amx_packed()


def decode_kernel(layer: DecoderLayer) -> DecodeLayerKernel:
    """The layer's kernel over its modules' packed weights (the linears' AMX copies are made
    now if the layer has not run yet).

    Raises:
        ValueError: packed weights that do not fit the kernel (`DecodeLayerKernel`).
    """
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    experts = _experts_kernel(mlp)
    if isinstance(experts, AmxExperts):  # they hold float32 biases already
        b13, b2 = (experts.b13, experts.b2) if experts.b13.numel() else (None, None)
    else:
        b13, b2 = _float32(mlp.b13), _float32(mlp.b2)
    return DecodeLayerKernel(
        norm1=layer.input_layernorm.weight, norm2=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.eps, qkv=_projection(attn.qkv_proj), o=_projection(attn.o_proj),
        router=mlp.gate.amx_packed(), num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, cos=attn.rotary.cos_cache, sin=attn.rotary.sin_cache,
        q_norm=q_norm, k_norm=k_norm, qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0,
        scale=attn.attn.scale, window=attn.attn.sliding_window or 0, experts=experts,
        top_k=mlp.top_k, renormalize=mlp.renormalize,
        norm_in_float32=layer.input_layernorm.weight_in_float32, sinks=_float32(attn.sinks),
        topk_softmax=mlp.routing == "topk_softmax", b13=b13, b2=b2,
        activation=mlp.activation,
    )


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous float32 copy of a parameter the kernel reads as float32 (sinks, expert
    biases; the kernel holds it), or None."""
    return None if t is None else t.detach().float().contiguous()
