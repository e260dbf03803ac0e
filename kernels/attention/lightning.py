"""Lightning attention kernels for MiniMax's linear layers: plain torch, any device, float32.

Each head keeps a state matrix KV of shape [D, D] (float32) and a fixed decay rate s > 0 (its
"slope"). For every token t:

    KV_t = exp(-s) * KV_{t-1} + k_t^T v_t       # decayed outer-product memory
    o_t  = q_t KV_t                              # read with the query (no softmax, no scale)

Two forms of the same recurrence:

* ``lightning_attention_prefill``: one sequence's chunk, block by block (Qin et al. 2024,
  "Lightning Attention-2", arXiv:2401.04658; "MiniMax-01", arXiv:2501.08313): within a block
  of b tokens the intra-block part is (Q K^T * decay) V with decay[i, j] = exp(-s (i - j)) for
  j <= i, the inter-block part reads the state carried in, Q * exp(-s (i + 1)) @ KV; then
  KV <- exp(-s b) KV + (K * exp(-s (b - 1 - j)))^T V.
* ``lightning_attention_decode``: one token per request, batched, state in place.

Both follow transformers 5.24 `MiniMaxLightningAttention.forward` (its block loop for the
prefill, its per-token loop once a cache holds a state), op for op in float32.
"""

from __future__ import annotations

import torch

__all__ = ["lightning_attention_decode", "lightning_attention_prefill"]


def lightning_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    state: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Lightning attention over one sequence's chunk, from the state the previous chunk left.

    Args:
        q, k, v: [T, H, D] (computed in float32).
        slope: [H] float32, each head's decay rate s.
        state: [H, D, D] float32, KV after the sequence's earlier tokens (zeros for a fresh
            request), updated in place to KV after this chunk.
        block_size: tokens per block (config.json `block_size`).

    Returns:
        out [T, H, D] in q.dtype.
    """
    out_dtype, seq_len = q.dtype, q.shape[0]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, D]
    s = slope.float()[:, None, None]  # [H, 1, 1]
    kv = state.float()
    outs = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        b = end - start
        qb, kb, vb = q[:, start:end], k[:, start:end], v[:, start:end]
        steps = torch.arange(b, device=q.device) + 1
        q_decay = torch.exp(-s * steps[:, None])  # [H, b, 1]
        k_decay = torch.exp(-s * (b - steps[:, None]))
        diagonal = steps[:, None] - steps[None, :]
        diagonal = s * diagonal[None]
        diagonal = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))  # [H, b, b]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        inter = torch.matmul(qb * q_decay, kv)
        outs.append(inter + intra)
        kv = kv * torch.exp(-s * b) + torch.matmul((kb * k_decay).transpose(-1, -2), vb)
    state.copy_(kv)
    return torch.cat(outs, dim=1).transpose(0, 1).to(out_dtype)


def lightning_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One decode token of lightning attention for each of B requests.

    Args:
        q, k, v: [B, H, D]; slope: [H] float32.
        state: [B, H, D, D] float32, updated in place to the state after the token (it may be
            a view).

    Returns:
        out [B, H, D] in q.dtype.
    """
    out_dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    ratio = torch.exp(-slope.float())[:, None, None]
    kv = ratio * state.float() + torch.matmul(k.unsqueeze(-1), v.unsqueeze(-2))
    out = torch.matmul(q.unsqueeze(-2), kv).squeeze(-2)
    state.copy_(kv)
    return out.to(out_dtype)
