"""The Mamba-1 mixer (selective scan) on per-request state slots (`kv_cache.state`).

Per token (Gu and Dao 2023, "Mamba", arXiv:2312.00752; transformers 5.24 `JambaMambaMixer`,
whose torch path this follows): in_proj splits h into x [I] and the gate z [I]; x goes through
a depthwise causal conv1d with SiLU (its last W - 1 inputs are the conv state); x_proj gives
the time-step rank R input, B and C [N] (Jamba normalises each with an RMSNorm:
`dt_layernorm`, `b_layernorm`, `c_layernorm`), dt_proj lifts the time step to [I]
(its bias added inside the softplus); the selective scan (`kernels.attention.ssm_scan`)
carries one [I, N] float32 state per request; y + D x is multiplied by silu(z) and projected
back by out_proj. Prefill chunks continue the state; decodes run one step batched.

Checkpoint names: `in_proj`, `conv1d.weight` [I, 1, W] (+ `conv1d.bias`), `x_proj`,
`dt_proj` (weight and bias), `A_log` [I, N], `D` [I], `out_proj`, and with the inner norms
`dt_layernorm`, `b_layernorm`, `c_layernorm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.ssm_scan import selective_scan, selective_state_update, softplus_dt
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.gated_delta_net import LinearAttentionMetadata
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.mamba2 import conv_rows, prefill_rows, zero_fresh
from moe_engine.models.layers.norm import RMSNorm


class MambaMixer(nn.Module):
    """One Mamba-1 layer (module docstring).

    Args:
        hidden_size: H; intermediate_size: I; state_size: N; conv_kernel: W; dt_rank: R;
        dtype: parameter dtype; proj_bias: in_proj/out_proj biases; conv_bias: a conv1d
        bias; inner_norm_eps: RMSNorm epsilon of the dt/B/C norms (Jamba), None: no such norms.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int,
                 conv_kernel: int, dt_rank: int, dtype: torch.dtype, *, proj_bias: bool = False,
                 conv_bias: bool = True, inner_norm_eps: float | None = None) -> None:
        super().__init__()
        self.intermediate, self.state_size, self.dt_rank = intermediate_size, state_size, dt_rank
        self.in_proj = Linear(hidden_size, 2 * intermediate_size, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.zeros(intermediate_size, 1, conv_kernel, dtype=dtype))
        self.conv1d.bias = (
            nn.Parameter(torch.zeros(intermediate_size, dtype=dtype)) if conv_bias else None
        )
        self.x_proj = Linear(intermediate_size, dt_rank + 2 * state_size, bias=False, dtype=dtype)
        self.dt_proj = Linear(dt_rank, intermediate_size, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(intermediate_size, state_size, dtype=dtype))
        self.D = nn.Parameter(torch.ones(intermediate_size, dtype=dtype))
        self.out_proj = Linear(intermediate_size, hidden_size, bias=proj_bias, dtype=dtype)
        self.inner_norms = inner_norm_eps is not None
        if self.inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, inner_norm_eps, dtype=dtype)
            self.b_layernorm = RMSNorm(state_size, inner_norm_eps, dtype=dtype)
            self.c_layernorm = RMSNorm(state_size, inner_norm_eps, dtype=dtype)

    @staticmethod
    def state_shapes(intermediate_size: int, state_size: int,
                     conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """One request's state in one layer: conv [I, W - 1], recurrent [I, N]."""
        return (intermediate_size, conv_kernel - 1), (intermediate_size, state_size)

    @staticmethod
    def num_params(hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                   dt_rank: int, proj_bias: bool, conv_bias: bool, inner_norms: bool) -> int:
        """Parameters of one layer (for the startup plan's weight bytes)."""
        h, i, n = hidden_size, intermediate_size, state_size
        params = 3 * h * i + i * (conv_kernel + dt_rank + 2 * n) + dt_rank * i + i + i * n + i
        params += (2 * i + h) * proj_bias + i * conv_bias
        return params + (dt_rank + 2 * n) * inner_norms

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h: [T, H] -> [T, H]; state: this layer's (conv [S + 1, I, W - 1], recurrent
        [S + 1, I, N] float32) slots, updated in place (`meta.linear`: each request's slot)."""
        lin: LinearAttentionMetadata = meta.linear
        conv_state, ssm_state = state
        zero_fresh(lin, conv_state, ssm_state)
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = conv_rows(x, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, lin)
        dt, b, c = self.x_proj(x).split([self.dt_rank, self.state_size, self.state_size], -1)
        if self.inner_norms:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = softplus_dt(F.linear(dt, self.dt_proj.weight), self.dt_proj.bias)
        a = -self.A_log.float().exp()
        y = torch.empty(x.shape, dtype=torch.float32, device=h.device)
        nd = lin.num_decodes
        if nd:
            slots = lin.slots[:nd]
            states = ssm_state.index_select(0, slots)
            y[:nd] = selective_state_update(x[:nd], dt[:nd], a, b[:nd], c[:nd], self.D, states)
            ssm_state.index_copy_(0, slots, states)
        for rows, slot in prefill_rows(lin):
            y[rows], ssm_state[slot] = selective_scan(
                x[rows], dt[rows], a, b[rows], c[rows], self.D, ssm_state[slot])
        y = y * F.silu(z.float())
        return self.out_proj(y.to(h.dtype))
