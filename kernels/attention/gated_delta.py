"""Gated DeltaNet kernels for Qwen3-Next's linear-attention layers: plain torch, CPU, float32.

Each value head keeps a state matrix S of shape [Dk, Dv] (float32). For every token t, with a
log-decay g_t <= 0 and a write strength beta_t in (0, 1):

    S_t = S_{t-1} * exp(g_t)                         # gated (scalar) decay of the old state
    S_t += k_t (beta_t (v_t - S_t^T k_t))^T          # delta rule: write only the correction
    o_t = S_t^T q_t                                  # read with the query

q and k are L2-normalised per head (``l2norm``) and q is scaled by Dk**-0.5 before use. Key
heads are shared by groups of Hv // Hk consecutive value heads (repeat_interleave).

Two forms of the same recurrence:

* ``chunk_gated_delta_rule`` (prefill): the chunked / UT-transform form. Inside a chunk of C
  tokens the C delta-rule updates are folded into two unit lower-triangular solves, then one
  sequential scan over chunks carries the state. Only C x C matrices per chunk are formed.
* ``recurrent_gated_delta_rule`` (decode): one token per request, batched, state in place.

Plus the depthwise causal conv1d + SiLU that feeds q, k and v, for prefill (state carried
between chunks of one sequence) and decode (B requests, one token each).

Sources: Yang et al. 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv 2412.06464); Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length" (arXiv 2406.06484, the UT transform / chunked form); Hugging Face
transformers' qwen3_next torch path (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``, ``causal_conv1d_update``), whose
float32 op order is followed so results agree with it to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "chunk_gated_delta_rule",
    "l2norm",
    "recurrent_gated_delta_rule",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise over the last dim: ``x * rsqrt(sum(x * x) + eps)`` (as transformers / FLA).

    Any shape and dtype; returns the same shape and dtype."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _shared_heads_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Repeat q/k heads (dim -2) to the Hv value heads, cast all to contiguous float32 and
    L2-normalise q and k. q, k: [..., Hk, Dk]; v: [..., Hv, Dv]; g, beta: [..., Hv]."""
    num_k_heads, num_v_heads = k.shape[-2], v.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"Hv={num_v_heads} is not a multiple of Hk={num_k_heads}")
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    q, k, v, g, beta = (
        x.to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)
    )
    return l2norm(q), l2norm(k), v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence's prefill chunk, in the chunked (UT-transform) form.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (Hv a multiple of Hk); g: [T, Hv] float32 log-decay
    (<= 0); beta: [T, Hv] (already sigmoid'ed). q and k are L2-normalised here, q scaled by
    Dk**-0.5. initial_state: [Hv, Dk, Dv] float32, or None for zeros (not modified).
    Returns (out [T, Hv, Dv] in q.dtype, final_state [Hv, Dk, Dv] float32). T is padded up to
    a multiple of chunk_size with zero tokens (beta = 0, g = 0), which leave the state as is.
    Follows transformers' ``torch_chunk_gated_delta_rule`` (use_qk_l2norm_in_kernel=True).
    """
    out_dtype, seq_len = q.dtype, q.shape[0]
    q, k, v, g, beta = _shared_heads_fp32(q, k, v, g, beta)
    # Heads first: [Hv, T, D] and [Hv, T].
    q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    g, beta = g.t().contiguous(), beta.t().contiguous()
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    num_heads, dim_k, dim_v = v.shape[0], k.shape[-1], v.shape[-1]

    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    # Chunked: [Hv, N, C, D] and [Hv, N, C].
    q, k, k_beta, v_beta = (
        x.reshape(num_heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g_cum = g.reshape(num_heads, -1, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[..., i, j] = exp(g_cum_i - g_cum_j) for j <= i, 0 above the diagonal.
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra_attn = (q @ k.transpose(-1, -2)) * decay
    k_beta_decayed = k_beta * g_cum.exp().unsqueeze(-1)
    # UT transform: (I + strict_lower(ut_system))^-1 applied to beta*v and to decayed beta*k.
    u = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut_system, k_beta_decayed, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros(num_heads, dim_k, dim_v, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(u)
    q = q * g_cum.exp().unsqueeze(-1)
    k = k * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)
    chunk_decay = g_cum[..., -1].exp()[..., None, None]
    for i in range(u.shape[1]):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q[:, i] @ state + intra_attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new

    out = out.reshape(num_heads, -1, dim_v)[:, :seq_len]
    return out.transpose(0, 1).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One decode token of the gated delta rule for each of B requests.

    q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g (log-decay, <= 0), beta (sigmoid'ed): [B, Hv].
    state: [B, Hv, Dk, Dv] float32, updated in place to the state after the token (it may be
    a view). Same normalisation as ``chunk_gated_delta_rule``. Returns out [B, Hv, Dv] in
    q.dtype. Follows transformers' ``torch_recurrent_gated_delta_rule`` for one step.
    g may also be [B, Hv, Dk], a decay per key channel (Kimi Delta Attention, transformers
    ``recurrent_kimi_delta_attention``: the state's rows decay apart).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _shared_heads_fp32(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    decay = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    s = state.to(torch.float32) * decay
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    state.copy_(s)
    return out.to(out_dtype)


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over one sequence's chunk, carrying the conv state.

    x: [T, C]; conv_state: [C, W-1], the sequence's previous W-1 inputs, oldest first (zeros
    for a fresh request), updated in place to its last W-1 inputs (older state included when
    T < W-1); weight: [C, W] (the nn.Conv1d weight squeezed); bias: [C] or None. Computed in
    weight.dtype. Returns silu(conv) [T, C] in x.dtype: the last T outputs of transformers'
    ``causal_conv1d_fn`` run on the whole sequence so far; with ``silu=False`` the conv alone
    (LFM2's short convolution, ``activation=None``).
    """
    channels, width = weight.shape
    hist = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)
    if width > 1:
        conv_state.copy_(hist[:, hist.shape[-1] - (width - 1) :])
    out = F.conv1d(hist.unsqueeze(0), weight.unsqueeze(1), bias, padding=0, groups=channels)[0]
    return (F.silu(out) if silu else out).t().to(x.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU (none with ``silu=False``) for one token of each of B
    requests.

    x: [B, C]; conv_state: [B, C, W-1], updated in place (shifted left, x appended; it may be
    a view); weight: [C, W]; bias: [C] or None. Computed in weight.dtype. Returns silu(conv)
    [B, C] in x.dtype, as transformers' ``causal_conv1d_update`` with one token.
    """
    width = weight.shape[1]
    hist = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1).to(weight.dtype)
    if width > 1:
        conv_state.copy_(hist[..., 1:])
    # one output per channel: a W-term dot product in float32, rounded to weight.dtype as the
    # convolution's output is (F.conv1d on [B, C, W] goes through oneDNN, about 1.6 ms a call
    # in bfloat16 on this CPU, most of a decode step of the linear layers)
    out = (hist.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    out = out.to(weight.dtype)
    return (F.silu(out) if silu else out).to(x.dtype)
