"""Selective state-space scans (Mamba-1 and Mamba-2) over one sequence's chunk from a carried
state, and their one-token steps batched over requests; plain torch, float32.

Mamba-1 (Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
arXiv:2312.00752): per channel i and state dim n, h_t = exp(dt_t,i A_i,n) h_{t-1} +
dt_t,i B_t,n x_t,i and y_t,i = sum_n h_t,i,n C_t,n + D_i x_t,i (transformers 5.24
`mamba_selective_scan`'s recurrent loop and `mamba_selective_state_update`, which these follow).

Mamba-2 (Dao and Gu 2024, "Transformers are SSMs", arXiv:2405.21060): A is one scalar per
head, the state per head is [P, N] (head dim x state dim) and B, C are shared by the heads of
a group; the prefill uses the chunked state-space-dual form (intra-chunk quadratic term plus
the state carried between chunks), as transformers' `mamba2_chunk_scan` (whose `dt_limit`
clamp it keeps; the one-token step `mamba2_selective_state_update` does not clamp, as there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., Hh, N]: each group's B or C repeated for its Hh / G heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def mamba2_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan over one sequence's T tokens, continuing `state`.

    Args:
        x: [T, Hh, P] the conv'ed inputs; dt: [T, Hh] the time steps after softplus(dt +
            dt_bias), clamped here to `dt_limit`; a: [Hh] float32, A = -exp(A_log);
        b, c: [T, G, N] (G groups, Hh a multiple of G); d: [Hh] the skip weights;
        state: [Hh, P, N] float32, the state before the first token (zeros when fresh);
        chunk_size: tokens per block of the quadratic intra-chunk form.

    Returns:
        (y [T, Hh, P] float32, the state after the last token [Hh, P, N] float32).
    """
    num_heads = x.shape[1]
    dt = dt.float().clamp(dt_limit[0], dt_limit[1])
    x, b, c = x.float(), _heads(b.float(), num_heads), _heads(c.float(), num_heads)
    state = state.float()
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        out[part], state = _ssd_chunk(x[part], dt[part], a.float(), b[part], c[part], state)
    return out + d.float()[:, None] * x, state


def _ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens (x [L, Hh, P], dt [L, Hh], b, c [L, Hh, N], state [Hh, P, N]):
    y without the skip term, and the state after the chunk. The decay between positions s <= l
    is exp(sum of dt A over s+1..l), summed as transformers' `segment_sum` does."""
    length = x.shape[0]
    da = dt * a  # [L, Hh], <= 0
    seg = da.t()[:, :, None].expand(-1, -1, length)  # [Hh, l, s] = da at l
    seg = seg.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(-1), 0).cumsum(-2)
    seg = seg.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(0), float("-inf"))
    decay = seg.exp()  # [Hh, l, s]
    scores = torch.einsum("lhn,shn->hls", c, b) * decay
    xdt = x * dt[..., None]
    y = torch.einsum("hls,shp->lhp", scores, xdt)
    cum = da.cumsum(0)  # [L, Hh]
    y = y + torch.einsum("lhn,hpn->lhp", c, state) * cum.exp()[..., None]
    to_end = (cum[-1:] - cum).exp()  # [L, Hh]
    state = state * cum[-1].exp()[:, None, None] + torch.einsum(
        "lhn,lhp->hpn", b * to_end[..., None], xdt
    )
    return y, state


def mamba2_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of Mamba-2 for each of B requests.

    x: [B, Hh, P]; dt: [B, Hh] after softplus(dt + dt_bias) (not clamped); a: [Hh] float32;
    b, c: [B, G, N]; d: [Hh]; state: [B, Hh, P, N] float32, updated in place (it may be a
    gathered copy). Returns y [B, Hh, P] float32.
    """
    num_heads = x.shape[1]
    dt, x = dt.float(), x.float()
    b, c = _heads(b.float(), num_heads), _heads(c.float(), num_heads)
    decay = (dt * a.float()).exp()[..., None, None]  # [B, Hh, 1, 1]
    new = state * decay + (dt[..., None, None] * b[:, :, None, :]) * x[..., None]
    state.copy_(new)
    return torch.einsum("bhpn,bhn->bhp", new, c) + d.float()[:, None] * x


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's scan over one sequence's T tokens, continuing `state`, token by token (the
    recurrence transformers' torch path runs).

    Args:
        x: [T, I] the conv'ed inputs; dt: [T, I] after softplus(dt + dt_bias); a: [I, N]
            float32, A = -exp(A_log); b, c: [T, N]; d: [I]; state: [I, N] float32.

    Returns:
        (y [T, I] float32 without the output gate, the final state [I, N] float32).
    """
    x, dt = x.float(), dt.float()
    decay = (a.float()[None] * dt[..., None]).exp()  # [T, I, N]
    inputs = dt[..., None] * b.float()[:, None, :] * x[..., None]  # [T, I, N]
    c = c.float()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state = decay[t] * state + inputs[t]
        out[t] = state @ c[t]
    return out + x * d.float(), state


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of Mamba-1 for each of B requests: x, dt [B, I] (dt after softplus); a [I, N];
    b, c [B, N]; d [I]; state [B, I, N] float32, updated in place. Returns y [B, I] float32
    (without the output gate)."""
    x, dt = x.float(), dt.float()
    new = state * (dt[..., None] * a.float()).exp() + dt[..., None] * b.float()[:, None] * x[
        ..., None
    ]
    state.copy_(new)
    return (new @ c.float()[..., None]).squeeze(-1) + x * d.float()


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """softplus(dt + dt_bias) in float32: the discretisation time steps of both scans."""
    return F.softplus(dt.float() + dt_bias.float())
