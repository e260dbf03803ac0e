"""Kimi Delta Attention (KDA), chunked prefill: plain torch, any device, float32.

KDA is the gated delta rule of ``gated_delta.py`` with a decay per key channel instead of one
per head: for every token t, with log-decays g_t [Dk] <= 0 and a write strength beta_t,

    S_t = diag(exp(g_t)) S_{t-1}                     # each key row of the state decays apart
    S_t += k_t (beta_t (v_t - S_t^T k_t))^T          # delta rule
    o_t = S_t^T q_t

(Moonshot AI, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692). One decode token is ``gated_delta.recurrent_gated_delta_rule`` with g of
shape [B, H, Dk]; this module holds the chunked form for prefill: inside a chunk of C tokens
the C updates fold into one unit lower-triangular solve whose entries carry the per-channel
decays, sum_d kbeta_i[d] k_j[d] exp(G_i[d] - G_j[d]) (G the in-chunk cumulative log-decay),
then one scan over chunks carries the state. It follows transformers 5.24
``chunk_kimi_delta_attention`` (q and k L2-normalised, q scaled by Dk**-0.5), with the
triangular solve of ``gated_delta.chunk_gated_delta_rule`` in place of its row loop.
"""

from __future__ import annotations

import torch

from kernels.attention.gated_delta import l2norm

__all__ = ["chunk_kda_rule"]


def chunk_kda_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """KDA over one sequence's prefill chunk, from the state its earlier tokens left.

    Args:
        q, k: [T, H, Dk]; v: [T, H, Dv]; g: [T, H, Dk] float32 log-decays (<= 0);
        beta: [T, H] (already sigmoid'ed).
        state: [H, Dk, Dv] float32 (zeros for a fresh request), updated in place to the state
            after the chunk.
        chunk_size: tokens per chunk of the solve (transformers uses 64).

    Returns:
        out [T, H, Dv] in q.dtype.
    """
    out_dtype, seq_len = q.dtype, q.shape[0]
    # Heads first, float32: [H, T, D] and [H, T].
    q, k, v, g = (x.float().transpose(0, 1) for x in (q, k, v, g))
    beta = beta.float().t()
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    s = state.float()
    out = torch.empty_like(v)
    for start in range(0, seq_len, chunk_size):
        end = min(start + chunk_size, seq_len)
        part = slice(start, end)
        out[:, part], s = _chunk(q[:, part], k[:, part], v[:, part], g[:, part],
                                 beta[:, part], s)
    state.copy_(s)
    return out.transpose(0, 1).to(out_dtype)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens: q, k, g [H, C, Dk]; v [H, C, Dv]; beta [H, C]; s [H, Dk, Dv]
    -> (out [H, C, Dv], the state after it)."""
    c = q.shape[1]
    g = g.cumsum(dim=1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # decay[h, i, j, d] = exp(G_i[d] - G_j[d]) for j <= i, 0 above the diagonal
    decay = (g.unsqueeze(2) - g.unsqueeze(1)).masked_fill(upper[..., None], float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    ut_system = (k_beta.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1)
    intra = (q.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1)
    u = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut_system, k_beta * g.exp(), upper=False,
                                      unitriangular=True)
    v_new = u - w @ s
    out = (q * g.exp()) @ s + intra @ v_new
    last = g[:, -1:]  # [H, 1, Dk]
    s = s * last.exp().transpose(1, 2) + (k * (last - g).exp()).transpose(1, 2) @ v_new
    return out, s
