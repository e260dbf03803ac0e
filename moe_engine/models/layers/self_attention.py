"""`Attention`: the GQA self-attention block of the Llama-style decoder (a fused QKV
projection, optional q/k norms, the rotary step, paged attention over the layer's KV-cache
group, the output projection) with the per-family options its docstring lists; the decoder
layers of `layers/decoder.py` hold it as `self_attn`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.plan import KernelPlan
from moe_engine.models.layers.attention import AttentionMetadata, PagedAttention
from moe_engine.models.layers.chunked_attention import ChunkedLocalPagedAttention
from moe_engine.models.layers.linear import Linear, MergedLinear
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding

if TYPE_CHECKING:
    from moe_engine.models.spec import ArchSpec


class Attention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm, rotary embedding, paged attention,
    output projection (GQA: `num_kv_heads` key/value heads shared by `num_heads` query heads).

    Args:
        spec: the sizes (num_heads, num_kv_heads, head_dim, hidden_size, rms_norm_eps).
        dtype: parameter dtype.
        rotary: the rotary module, called `rotary(positions [T], q [T, Hq, D], k [T, Hkv, D])
            -> (q, k)`; one module shared by every layer (a partial or interleaved rope is a
            different module with the same call); None: no position embedding in this layer
            (NoPE: the global layers of EXAONE-MoE and Cohere2-MoE).
        sliding_window: this layer's window (tokens, the query included), None for full
            attention.
        qkv_bias: biases on q/k/v (default `spec.attention_bias`).
        o_bias: a bias on the output projection.
        sinks: learned per-head sink logits in the softmax (gpt-oss).
        qk_norm: RMSNorm on queries and keys (default `spec.qk_norm`), per head before the rope
            unless the options below say otherwise.
        qk_norm_per_head: False: one RMSNorm over each token's whole q projection [Hq * D]
            and one over its k projection [Hkv * D] (OLMoE, FlexOlmo, MiniMax-M2), before the
            rope; True (default): over each head's D dims (Qwen3).
        qk_norm_after_rope: the per-head norms run on the rotated q and k (HunYuan-MoE's
            `query_layernorm` / `key_layernorm`); default before the rope.
        qk_norm_in_float32: the q/k norms multiply by their weight in float32
            (`RMSNorm.weight_in_float32`; Olmo2-style norms).
        output_gate: the attention output is multiplied by act(gate_proj(h)) before o_proj,
            gate_proj a Linear without bias: True or "sigmoid" (AFMoE's gated attention, in
            the model dtype), "softplus" (Laguna's, computed in float32 and rounded to the
            model dtype); False: no gate.
        gate_per_head: the gate has one value per query head (gate_proj: H -> Hq, broadcast
            over the head's D dims) instead of one per output element (H -> Hq * D).
        gate_bias: a learned per-head bias [Hq] added to the gate before its activation,
            broadcast over the head's dims (Beam's `gate_bias`).
        scale: the softmax scale (default head_dim ** -0.5; Granite's `attention_multiplier`).
        clip_qkv: clamp q, k and v to [-clip_qkv, clip_qkv] after the projection and the
            whole-projection q/k norms, if any (DBRX, OLMoE); None: no clamp.
        attention_chunk_size: chunked local attention of chunks of this many tokens
            (`chunked_attention.ChunkedLocalPagedAttention`, Llama 4); None: as
            `sliding_window` says.
        num_kv_heads: this layer's own key/value heads (its k/v projections), where layer
            kinds differ (MiMo-V2-Flash: sliding layers twice the full layers'); the cache
            holds `spec.num_kv_heads`, a multiple: each head is stored spec.num_kv_heads /
            num_kv_heads times over, which leaves GQA's query-to-key map as it was (query
            head h reads cache head h // (Hq / cache heads), a copy of its own). None: the
            spec's.
        v_head_dim: width of the value heads where it differs from head_dim (MiMo-V2-Flash):
            values are zero-padded to head_dim in the cache (the paged kernels take one head
            dim) and the output's padding columns (zero) are dropped before o_proj.
        v_scale: multiplies the values after v_proj (MiMo-V2-Flash's `attention_value_scale`).

    Checkpoint names: `q_proj`, `k_proj`, `v_proj` (stacked into `qkv_proj`, shards "q", "k",
    "v"), `o_proj`, `q_norm`, `k_norm`, `sinks`, `gate_proj`.

    Bound to a "rotary" kernel (`KernelPlan.rope_prologue`: native-cpu for the plain
    rotate-half `RotaryEmbedding`, triton also for interleaved and partial ropes), a layer runs
    its prologue (split, q/k norm, rope, KV-cache write) as one call
    (`kernels.dense.ops.qk_norm_rope_cache`, `kernels.dense.triton_rope.qk_norm_rope_cache`;
    the rope and the cache write bit-identical to the torch ops).
    """

    def __init__(
        self,
        spec: ArchSpec,
        dtype: torch.dtype,
        rotary: nn.Module | None,
        sliding_window: int | None = None,
        *,
        qkv_bias: bool | None = None,
        o_bias: bool = False,
        sinks: bool = False,
        qk_norm: bool | None = None,
        qk_norm_per_head: bool = True,
        qk_norm_after_rope: bool = False,
        qk_norm_in_float32: bool = False,
        output_gate: bool | str = False,
        gate_per_head: bool = False,
        gate_bias: bool = False,
        scale: float | None = None,
        clip_qkv: float | None = None,
        attention_chunk_size: int | None = None,
        num_kv_heads: int | None = None,
        v_head_dim: int | None = None,
        v_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if qk_norm_after_rope and not qk_norm_per_head:
            raise ValueError("qk_norm_after_rope needs per-head q/k norms (qk_norm_per_head)")
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        self.layer_kv_heads = spec.num_kv_heads if num_kv_heads is None else num_kv_heads
        if self.layer_kv_heads < 1 or spec.num_kv_heads % self.layer_kv_heads:
            raise ValueError(
                f"num_kv_heads {num_kv_heads} of a layer must divide the cache's "
                f"{spec.num_kv_heads} KV heads"
            )
        self.kv_repeat = spec.num_kv_heads // self.layer_kv_heads
        self.v_head_dim = spec.head_dim if v_head_dim is None else v_head_dim
        if not 1 <= self.v_head_dim <= spec.head_dim:
            raise ValueError(f"v_head_dim {v_head_dim} must be in [1, head_dim {spec.head_dim}]")
        self.v_scale = v_scale
        q_size = spec.num_heads * spec.head_dim
        k_size = self.layer_kv_heads * spec.head_dim
        v_size = self.layer_kv_heads * self.v_head_dim
        self.sizes = (q_size, k_size, v_size)
        bias = spec.attention_bias if qkv_bias is None else qkv_bias
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q": q_size, "k": k_size, "v": v_size}, bias=bias, dtype=dtype
        )
        self.o_proj = Linear(spec.num_heads * self.v_head_dim, spec.hidden_size, bias=o_bias,
                             dtype=dtype)
        # learned per-head sink logits (gpt-oss), filled from the checkpoint
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads, dtype=dtype)) if sinks else None
        output_gate = {False: None, True: "sigmoid"}.get(output_gate, output_gate)
        if output_gate not in (None, "sigmoid", "softplus"):
            raise ValueError(
                f"output_gate must be a bool, 'sigmoid' or 'softplus', got {output_gate!r}"
            )
        self.output_gate, self.gate_per_head = output_gate, gate_per_head
        gate_size = spec.num_heads if gate_per_head else q_size
        self.gate_proj = (
            Linear(spec.hidden_size, gate_size, bias=False, dtype=dtype) if output_gate else None
        )
        self.gate_bias = (
            nn.Parameter(torch.zeros(spec.num_heads, dtype=dtype)) if gate_bias else None
        )
        self.qk_norm = spec.qk_norm if qk_norm is None else qk_norm
        self.qk_norm_per_head, self.qk_norm_after_rope = qk_norm_per_head, qk_norm_after_rope
        if self.qk_norm:
            q_dim, k_dim = (spec.head_dim,) * 2 if qk_norm_per_head else (q_size, k_size)
            norm = dict(dtype=dtype, weight_in_float32=qk_norm_in_float32)
            self.q_norm = RMSNorm(q_dim, spec.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(k_dim, spec.rms_norm_eps, **norm)
        if clip_qkv is not None and (clip_qkv <= 0 or (self.qk_norm and qk_norm_per_head)):
            raise ValueError(
                f"clip_qkv={clip_qkv}: must be > 0 (or None: no clamp), and is implemented "
                "without q/k norms or with whole-projection ones (qk_norm_per_head=False)"
            )
        self.clip_qkv = clip_qkv
        self.rotary = rotary  # shared by all layers; None: NoPE
        softmax_scale = spec.head_dim**-0.5 if scale is None else scale
        self.attn = PagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, softmax_scale,
            sliding_window=sliding_window,
        ) if attention_chunk_size is None else ChunkedLocalPagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, softmax_scale, attention_chunk_size
        )
        #: Bound by `bind_kernels`: the prologue's one-call kernel (`KernelPlan.rope_prologue`)
        #: where this layer's pieces fit it, else None (the module path), and the
        #: `RotaryEmbedding` whose cos/sin tables it reads.
        self.prologue: Callable[..., torch.Tensor] | None = None
        self.rope_tables: RotaryEmbedding | None = None

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's prologue kernel (`KernelPlan.rope_prologue`) when this layer's
        pieces are the ones it implements (a `RotaryEmbedding`, or a `PartialRotaryEmbedding`
        around one, where the kernel takes that layout; q/k norms of Qwen3's rounding, one
        epsilon, before the rope; float32 or bfloat16 weights). Norms over the whole
        projection and the clamp run before the kernel, which then takes none
        (`_norm_projections`)."""
        norms_fit = not self.qk_norm or not self.qk_norm_per_head or (
            not self.q_norm.weight_in_float32 and not self.k_norm.weight_in_float32
            and self.q_norm.eps == self.k_norm.eps and not self.qk_norm_after_rope
        )
        rotary = self.rotary
        partial = type(rotary) is PartialRotaryEmbedding
        tables = rotary.rope if partial else rotary
        plain_kv = (self.kv_repeat, self.v_head_dim, self.v_scale) == (1, self.head_dim, 1.0)
        fits = (
            type(tables) is RotaryEmbedding
            and plain_kv
            and norms_fit
            and self.qkv_proj.weight.dtype in (torch.float32, torch.bfloat16)
        )
        self.rope_tables = tables if fits else None
        self.prologue = None
        if fits:
            self.prologue = plan.rope_prologue(
                interleaved=tables.interleaved, partial=partial and tables.head_dim < self.head_dim
            )

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache
    ) -> torch.Tensor:
        """h: [T, H] -> [T, H]; positions [T] int64; kv_cache: this layer's (K, V) pair."""
        t = h.shape[0]
        qkv = self.qkv_proj(h)
        if self.qk_norm and not self.qk_norm_per_head:
            qkv = self._norm_projections(qkv)
        if self.clip_qkv is not None:  # DBRX: the projection; OLMoE: after its norms
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if self.prologue is not None and qkv.dtype == kv_cache[0].dtype:
            per_head = self.qk_norm and self.qk_norm_per_head
            norms = (self.q_norm.weight, self.k_norm.weight) if per_head else (None, None)
            tables = self.rope_tables
            layout = {"interleaved": True} if tables.interleaved else {}
            q = self.prologue(
                qkv, self.num_heads, self.num_kv_heads, positions, tables.cos_cache,
                tables.sin_cache, *norms, self.q_norm.eps if per_head else 0.0,
                *kv_cache, meta.for_group(self.attn.kv_group).slot_mapping, **layout,
            )  # fmt: skip
            out = self.attn(q, None, None, kv_cache, meta, sinks=self.sinks)
            return self.o_proj(self._gated(out, h))
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.layer_kv_heads, self.head_dim)
        v = v.view(t, self.layer_kv_heads, self.v_head_dim)
        if self.v_scale != 1.0:
            v = v * self.v_scale
        per_head = self.qk_norm and self.qk_norm_per_head
        if per_head and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if per_head and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_repeat > 1:
            k, v = k.repeat_interleave(self.kv_repeat, 1), v.repeat_interleave(self.kv_repeat, 1)
        if self.v_head_dim < self.head_dim:
            v = F.pad(v, (0, self.head_dim - self.v_head_dim))
        out = self.attn(q, k, v, kv_cache, meta, sinks=self.sinks)
        if self.v_head_dim < self.head_dim:
            out = out.view(t, self.num_heads, self.head_dim)[..., : self.v_head_dim]
            out = out.reshape(t, self.num_heads * self.v_head_dim)
        return self.o_proj(self._gated(out, h))

    def _gated(self, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """out [T, Hq * D] times act(gate_proj(h)) (per element, or per head broadcast over
        its D dims) where the layer has an output gate; h: [T, H], the attention's input."""
        if self.gate_proj is None:
            return out
        gate = self.gate_proj(h)
        t = out.shape[0]
        if self.gate_bias is not None:  # [T, Hq * D] + [Hq] broadcast over each head's dims
            gate = (gate.view(t, self.num_heads, -1) + self.gate_bias[:, None]).view(t, -1)
        if self.output_gate == "sigmoid":
            gate = torch.sigmoid(gate)
        else:
            gate = F.softplus(gate.float()).to(out.dtype)
        if not self.gate_per_head:
            return out * gate
        return (out.view(t, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).view(t, -1)

    def _norm_projections(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] -> the same with q_norm over its q part and k_norm over its
        k part (each token's whole projection), v unchanged."""
        q, k, v = qkv.split(self.sizes, dim=-1)
        return torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
