"""A whole pre-norm MoE decoder layer of a decode step in one native call (csrc/decode_layer.cpp).

At decode batch sizes a layer's kernels (RMSNorm, the AMX QKV / output / router linears, the
attention prologue, paged decode attention, the router, the AMX fused MoE) take about 120 us
on the project's 2-core AMX machine; the Python and torch ops between them took about as long
again (bench/NOTES.md section 14). `DecodeLayerKernel` holds one layer's packed weights and
runs those same kernels from C++, in the same order, with the same roundings: the residual
stream comes out bit-identical to the module path's (tests/test_decode_layer.py).

It covers the layers of Qwen3-MoE, Mixtral and gpt-oss as the engine runs them on an AMX (or
AVX512-BF16) CPU in bfloat16: rotate-half RoPE (YaRN's tables included), optional q/k RMSNorm,
RMSNorms multiplying by their weight in bfloat16 or (gpt-oss) in float32, optional attention
sinks, sliding-window or full attention, optional QKV, output and router biases,
softmax-then-top-k routing or (gpt-oss) top-k-then-softmax (`moe_router_topk_softmax`, bit for
bit torch's), experts on one rank with or without biases, plain or clamped SwiGLU, bfloat16
(the AMX kernel) or 4-bit (`--quantization int4` / MXFP4: the native 4-bit kernel); the QKV
and output projections bfloat16 on the AMX kernel or 4-bit (`--quantized-layers all`:
`PackedQuantLinear`, csrc/linear_q4_cpu.cpp).
`moe_engine.models.layers.native_decode.decode_misfit` decides whether a layer fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from kernels.dense.amx import AmxLinear, tiles_flag
from kernels.dense.native_linear_q4 import PackedQuantLinear
from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.amx import AmxExperts
from kernels.moe.native import PackedQuantExperts, bias_pointers
from kernels.native.library import check_status, load_native

#: Decode rows per call: the AMX linears' range (`cpu_amx.LINEAR_MAX_ROWS`).
MAX_ROWS = 256
#: The most experts per token of the top-k-then-softmax routing (csrc/decode_layer.cpp
#: `moe_router_topk_softmax`: torch's bfloat16 softmax over fewer values than a float vector),
#: which also needs top_k * 64 > E (the selection torch makes then).
TOPK_SOFTMAX_MAX_K = 7


@dataclass(frozen=True)
class DecodeLayerKernel:
    """One decoder layer's weights as csrc/decode_layer.cpp takes them (bfloat16 throughout).

    Attributes:
        norm1, norm2: [H] bfloat16, the input and post-attention RMSNorm weights; eps theirs.
        qkv, o, router: the packed QKV [(Hq + 2 Hkv) D, H], output [H, Hq D] and router
            [E, H] projections, each with its float32 bias or none; qkv and o AMX-packed
            bfloat16 or 4-bit (`PackedQuantLinear`), the router AMX-packed.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        cos, sin: [P, D] float32 rotate-half tables; q_norm, k_norm: [D] bfloat16 or None;
            qk_eps: their epsilon.
        scale: the attention's softmax scale; window: sliding window in tokens, 0 for full.
        experts: the packed experts: bfloat16 for the AMX kernel (holding their own biases and
            activation, which must be `b13`/`b2`'s presence and `activation`), or 4-bit for the
            native one; top_k; renormalize (softmax-then-top-k only).
        norm_in_float32: the norms multiply by their weight in float32 (gpt-oss,
            `RMSNorm.weight_in_float32`).
        sinks: [Hq] float32 per-head sink logits (gpt-oss), or None.
        topk_softmax: route by top-k of the logits then softmax over those k (gpt-oss:
            `routing.topk_softmax`, 1 <= top_k <= `TOPK_SOFTMAX_MAX_K`, top_k * 64 > E), else
            softmax then top-k.
        b13, b2: [E, 2I] and [E, H] float32 expert biases (gate rows then up rows), or None.
        activation: the experts' SwiGLU, plain or gpt-oss's clamped one.
    """

    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    qkv: AmxLinear | PackedQuantLinear
    o: AmxLinear | PackedQuantLinear
    router: AmxLinear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    scale: float
    window: int
    experts: AmxExperts | PackedQuantExperts
    top_k: int
    renormalize: bool
    norm_in_float32: bool = False
    sinks: torch.Tensor | None = None
    topk_softmax: bool = False
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    activation: SwiGLU = SILU_AND_MUL

    def __post_init__(self) -> None:
        """Check what the C kernel trusts, once.

        Raises:
            ValueError: a weight of another shape, dtype or layout than the layer's sizes ask.
        """
        h, d = self.qkv.in_features, self.head_dim
        for name, w in (("norm1", self.norm1), ("norm2", self.norm2),
                        ("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            size = h if name.startswith("norm") else d
            if w is not None and (w.shape != (size,) or w.dtype != torch.bfloat16
                                  or not w.is_contiguous()):
                raise ValueError(f"{name} must be contiguous bfloat16 [{size}], got {w.dtype} "
                                 f"{tuple(w.shape)}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        q_n = self.num_heads * d
        num_experts, experts_hidden, _ = self._experts
        want = {"qkv": (q_n + 2 * self.num_kv_heads * d, h), "o": (h, q_n),
                "router": (num_experts, h)}
        for name, (n, k) in want.items():
            lin = getattr(self, name)
            if (lin.out_features, lin.in_features) != (n, k):
                raise ValueError(f"{name} must be [{n}, {k}], got "
                                 f"[{lin.out_features}, {lin.in_features}]")
        if self.sinks is not None and (self.sinks.shape != (self.num_heads,) or self.sinks.dtype
                                       != torch.float32 or not self.sinks.is_contiguous()):
            raise ValueError(f"sinks must be contiguous float32 [{self.num_heads}], got "
                             f"{self.sinks.dtype} {tuple(self.sinks.shape)}")
        if self.topk_softmax and not (self.top_k <= TOPK_SOFTMAX_MAX_K
                                      and self.top_k * 64 > num_experts):
            raise ValueError(f"top-k-then-softmax routing takes top_k <= {TOPK_SOFTMAX_MAX_K} "
                             f"and top_k * 64 > E, got top_k {self.top_k}, E {num_experts}")
        if experts_hidden != h:
            raise ValueError(f"experts of hidden size {experts_hidden}, not the layer's {h}")
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            if t.dim() != 2 or t.shape[1] != d or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32 [P, {d}], got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {num_experts}]")

    @cached_property
    def _linear_args(self) -> tuple[tuple, tuple, tuple]:
        """((QKV weight, bias or None, format, scales, group), the same of O, the router's
        weight and bias pointers), checked once (`AmxLinear.weight_args`, `PackedQuantLinear.
        weight_args`); format -1 (no scales, group 0) for an AMX-packed projection."""
        return _projection_args(self.qkv), _projection_args(self.o), self.router.weight_args

    @cached_property
    def _experts(self) -> tuple[int, int, tuple]:
        """(E, H, the kernel's experts arguments from w13 to limit), checked once.

        Raises:
            ValueError: AMX experts whose biases or activation are not the layer's, biases of
                another shape or dtype, or experts of another kind.
        """
        e, act = self.experts, self.activation
        activation = (act.clamped, float(act.alpha or 0.0), act.limit is not None,
                      float(act.limit or 0.0))
        if isinstance(e, AmxExperts):
            if bool(e.b13.numel()) != (self.b13 is not None) or e.activation != act:
                raise ValueError("AMX experts must hold the layer's biases and activation")
            b13, b2 = e.bias_pointers  # checks the packed tensors
            return e.experts, e.hidden, (e.w13.data_ptr(), e.w2.data_ptr(), e.intermediate, 0,
                                         None, None, None, None, None, None, 0, 0, 0, 0, b13,
                                         b2, *activation)
        if isinstance(e, PackedQuantExperts):
            w = e.weight_args
            try:
                b13, b2 = bias_pointers(self.b13, self.b2, w.experts, w.hidden, w.intermediate)
            except RuntimeError as err:
                raise ValueError(f"expert biases: {err}") from err
            return w.experts, w.hidden, (None, None, w.intermediate, 1, *w.pointers, w.format,
                                         w.group_size, w.padded_intermediate, w.padded_hidden,
                                         b13, b2, *activation)
        raise ValueError(f"experts must be AmxExperts or PackedQuantExperts, got {type(e)}")

    def run(self, h: torch.Tensor, step: DecodeStepArgs,
            kv_cache: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, tiles: bool | None = None) -> None:
        """Run the layer in place: h [T, H] bfloat16 contiguous (T = step.rows) becomes the
        layer's output; topk_weights [T, k] float32 and topk_ids [T, k] int32 (contiguous)
        receive the routing. `tiles`: this process's backend (None), AMX tiles (True) or
        AVX512-BF16 (False) for the linears and bfloat16 experts (and, on the tiles, the
        attention's scores).

        Raises:
            RuntimeError: inputs that do not fit, a backend that cannot run here, or a
                position, slot or sequence length the kernel rejects (nothing is written then
                unless the cache write ran).
        """
        k_cache, v_cache = kv_cache
        t, k = step.rows, self.top_k
        if (h.dtype != torch.bfloat16 or h.shape != (t, self.qkv.in_features)
                or not h.is_contiguous() or k_cache.dtype != torch.bfloat16
                or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or k_cache.shape != v_cache.shape
                or tuple(k_cache.shape[2:]) != (self.num_kv_heads, self.head_dim)):
            raise RuntimeError(f"decode layer: h {h.dtype} {tuple(h.shape)} or caches "
                               f"{tuple(k_cache.shape)} do not fit")
        if (topk_weights.shape != (t, k) or topk_ids.shape != (t, k)
                or topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32
                or not topk_weights.is_contiguous() or not topk_ids.is_contiguous()):
            raise RuntimeError(f"decode layer: topk outputs must be contiguous [{t}, {k}] "
                               "float32 and int32")
        lib = load_native("decode_layer")
        (qkv_w, qkv_b, qkv_fmt, qkv_s, qkv_g), (o_w, o_b, o_fmt, o_s, o_g), (router_w, router_b) = (
            self._linear_args)
        num_experts, _, experts = self._experts
        blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        check_status(lib.moe_decode_layer(
            h.data_ptr(), t, self.qkv.in_features, self.norm1.data_ptr(),
            self.norm2.data_ptr(), self.eps, self.norm_in_float32, qkv_w, qkv_b,
            self.num_heads, self.num_kv_heads,
            self.head_dim, step.positions, self.cos.data_ptr(), self.sin.data_ptr(),
            self.cos.shape[0], _ptr(self.q_norm), _ptr(self.k_norm), self.qk_eps,
            k_cache.data_ptr(), v_cache.data_ptr(), blocks * block_size, step.slot_mapping,
            step.block_tables, step.width, step.seq_lens, block_size, self.window, self.scale,
            _ptr(self.sinks), o_w, o_b, router_w, router_b, num_experts, k, self.renormalize,
            self.topk_softmax, *experts,
            topk_weights.data_ptr(), topk_ids.data_ptr(), qkv_fmt, qkv_s, qkv_g, o_fmt, o_s,
            o_g, tiles_flag(tiles), torch.get_num_threads(),
        ), "decode layer")


def _projection_args(lin: AmxLinear | PackedQuantLinear) -> tuple:
    """(weight pointer, bias pointer or None, format, scales pointer or None, group) of one
    projection as moe_decode_layer takes it: format -1 for AMX-packed bfloat16."""
    if isinstance(lin, PackedQuantLinear):
        codes, scales, fmt, bias = lin.weight_args
        return codes, bias, fmt, scales, lin.group_size
    weight, bias = lin.weight_args
    return weight, bias, -1, None, 0


class DecodeStepArgs(NamedTuple):
    """One decode step's inputs as the kernel takes them (pointers into tensors the caller
    keeps alive), checked once by `decode_step_args` for every layer of a KV-cache group."""

    rows: int
    positions: int
    slot_mapping: int
    block_tables: int
    width: int
    seq_lens: int


def decode_step_args(positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodeStepArgs:
    """Check a decode step's inputs once.

    Args:
        positions, slot_mapping, seq_lens: [T] int64, 1 <= T <= `MAX_ROWS` (each token's
            position, its cache slot, its request's keys after this step).
        block_tables: [T, W] int64.

    Raises:
        RuntimeError: a tensor of another shape, dtype or layout (named).
    """
    t = positions.shape[0] if positions.dim() == 1 else -1
    if not 1 <= t <= MAX_ROWS:
        raise RuntimeError(f"positions must be [T] with 1 <= T <= {MAX_ROWS}, got "
                           f"{tuple(positions.shape)}")
    for name, v in (("positions", positions), ("slot_mapping", slot_mapping),
                    ("seq_lens", seq_lens)):
        if v.shape != (t,) or v.dtype != torch.int64 or not v.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous int64 [{t}], got {v.dtype} "
                               f"{tuple(v.shape)}")
    if (block_tables.dim() != 2 or block_tables.shape[0] != t
            or block_tables.dtype != torch.int64 or not block_tables.is_contiguous()):
        raise RuntimeError(f"block_tables must be contiguous int64 [{t}, W], got "
                           f"{tuple(block_tables.shape)}")
    return DecodeStepArgs(t, positions.data_ptr(), slot_mapping.data_ptr(),
                          block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr())


def router_topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing as the decode layer computes it (csrc/decode_layer.cpp
    `moe_router_topk_softmax`): top-k of the logits, then softmax over those k in bfloat16,
    bit-identical to `moe_engine.models.layers.routing.topk_softmax` (torch's topk and
    softmax) on bfloat16 logits, ties included.

    Args:
        logits: [T, E] bfloat16 router logits; 1 <= k <= `TOPK_SOFTMAX_MAX_K`, k * 64 > E.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32.

    Raises:
        RuntimeError: logits of another shape or dtype, or a k the kernel does not take.
    """
    if logits.dim() != 2 or logits.dtype != torch.bfloat16:
        raise RuntimeError(f"logits must be bfloat16 [T, E], got {logits.dtype} "
                           f"{tuple(logits.shape)}")
    logits = logits.contiguous()
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int32)
    check_status(load_native("decode_layer").moe_router_topk_softmax(
        logits.data_ptr(), t, e, k, weights.data_ptr(), ids.data_ptr()), "router_topk_softmax")
    return weights, ids


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
