"""Float64 references for `bench/gpu_kernels.py`: every timed kernel call is also checked.

- `paged_attention_ref`: causal attention of a varlen batch through the block table, with
  transformers' sliding-window convention (key k visible from position p iff p - window < k <= p)
  and gpt-oss sinks (one value-less softmax column exp(sink[h]) per head), as the contract of
  `kernels.attention.triton_attention.paged_attention`.
- `mla_decode_ref`: DeepSeek's absorbed MLA decode over the latent cache, as
  `kernels.attention.triton_attention.mla_decode` documents it.
- `moe_ref`: `kernels.moe.reference.fused_moe_reference` on the float64 weights (4-bit ones
  dequantized first, `quant.int4` / `quant.mxfp4`: exact values).
- `rel_error`: ||got - want||_F / ||want||_F in float64, the figure each row is gated on.

All inputs stay on their device; the references compute in float64 there.
"""

from __future__ import annotations

import torch

from kernels.moe.reference import fused_moe_reference


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of `got` against the float64 `want` (inf when not finite)."""
    diff = got.double() - want
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.norm() / want.norm().clamp_min(1e-300))


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` token rows of one request's paged cache, [length, ...] float64."""
    block = cache.shape[1]
    blocks = table[: -(-length // block)].long()
    return cache[blocks].flatten(0, 1)[:length].double()


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                        scale: float, sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq, D] float64: each request's queries at its last positions (see the module)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo or length == 0:
            continue
        k = _gather(k_cache, block_tables[b], length).repeat_interleave(heads // kv_heads, 1)
        v = _gather(v_cache, block_tables[b], length).repeat_interleave(heads // kv_heads, 1)
        pos = torch.arange(length - (hi - lo), length, device=q.device)[:, None]
        key = torch.arange(length, device=q.device)[None, :]
        visible = key <= pos
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, hi - lo, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def mla_decode_ref(q, latent_cache, block_tables, seq_lens, *, scale: float,
                   kv_lora_rank: int) -> torch.Tensor:
    """[B, n_heads, kv_lora_rank] float64: softmax(q . latent * scale) @ c_kv per request."""
    out = torch.zeros(*q.shape[:2], kv_lora_rank, dtype=torch.float64, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        latent = _gather(latent_cache, block_tables[b], length)  # [L, rank + rope]
        probs = torch.softmax(q[b].double() @ latent.T * scale, dim=-1)
        out[b] = probs @ latent[:, :kv_lora_rank]
    return out


def moe_ref(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """[T, H] float64 mixture of SwiGLU experts on float64 weights (w13 [E, 2I, H], w2
    [E, H, I], already dequantized)."""
    return fused_moe_reference(hidden.double(), w13.double(), w2.double(),
                               topk_weights.double(), topk_ids)
