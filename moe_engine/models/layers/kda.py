"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear, on per-request state
slots (`kv_cache.state`).

Per token: q, k, v come from three projections, each through its own depthwise causal conv1d
+ SiLU (the three convs run as one over the concatenated channels; their last W - 1 inputs
are the conv state); the forget gate gives a log-decay per key channel,
g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(h)) + dt_bias); beta = sigmoid(b_proj(h));
the gated delta rule with that per-channel decay updates a [Dk, Dv] state per head
(`kernels.attention.kda.chunk_kda_rule` for prefill chunks,
`kernels.attention.gated_delta.recurrent_gated_delta_rule` for decodes); the output is
RMS-normalised per head and gated by sigmoid(g_b_proj(g_a_proj(h))) (`GatedRMSNorm` with
`sigmoid_gate`), then o_proj (Moonshot AI, "Kimi Linear", arXiv:2510.26692; transformers 5.24
`KimiLinearDeltaAttention`). Gated DeltaNet (`gated_delta_net.py`) is the same rule with one
decay per head.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention.gated_delta import recurrent_gated_delta_rule
from kernels.attention.kda import chunk_kda_rule
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.gated_delta_net import (
    LinearAttentionMetadata,
    causal_conv1d_requests,
)
from moe_engine.models.layers.linear import Linear, MergedLinear
from moe_engine.models.layers.norm import GatedRMSNorm


def _conv_weight(dim: int, width: int, dtype: torch.dtype) -> nn.Module:
    """A holder of one depthwise conv's `weight` [dim, 1, width] (its checkpoint name)."""
    conv = nn.Module()
    conv.weight = nn.Parameter(torch.zeros(dim, 1, width, dtype=dtype))
    return conv


class KimiDeltaAttention(nn.Module):
    """One KDA layer (module docstring).

    Args:
        hidden_size: H_model; num_heads: H; head_dim: D (keys and values); conv_kernel: W;
        eps: the output norm's epsilon; dtype: parameter dtype (dt_bias and the decay
        arithmetic stay float32, as transformers keeps them).
        low_rank_gates: the forget and output gates through rank-D pairs (`f_a_proj` /
            `f_b_proj`, `g_a_proj` / `g_b_proj`, A_log [1, 1, H, 1]: Kimi-Linear); False: one
            full projection each, `f_proj` and `g_proj` [H_model -> H D], A_log [H]
            (Bailing-hybrid's delta attention, whose forget gate takes float32 A_log too).
        gate_lower_bound: the bounded ("safe") forget gate g = lower_bound * sigmoid(
            exp(A_log) * (f + dt_bias)) (Bailing-hybrid's `kda_safe_gate` with
            `kda_lower_bound`); None: g = -exp(A_log) * softplus(f + dt_bias).

    Checkpoint names: `q_proj`, `k_proj`, `v_proj` (stacked into `qkv_proj`),
    `q_conv1d`, `k_conv1d`, `v_conv1d` (`.weight` [H D, 1, W]), `f_a_proj`, `f_b_proj` (or
    `f_proj`), `dt_bias` [H D], `A_log` [1, 1, H, 1] (or [H]), `b_proj`, `g_a_proj`, `g_b_proj`
    (or `g_proj`),
    `o_norm.weight` [D], `o_proj`.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 eps: float, dtype: torch.dtype, low_rank_gates: bool = True,
                 gate_lower_bound: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = self.width = num_heads * head_dim
        self.qkv_proj = MergedLinear(hidden_size, {"q": width, "k": width, "v": width},
                                     bias=False, dtype=dtype)
        self.q_conv1d = _conv_weight(width, conv_kernel, dtype)
        self.k_conv1d = _conv_weight(width, conv_kernel, dtype)
        self.v_conv1d = _conv_weight(width, conv_kernel, dtype)
        self.low_rank_gates, self.gate_lower_bound = low_rank_gates, gate_lower_bound
        if low_rank_gates:
            self.f_a_proj = Linear(hidden_size, head_dim, bias=False, dtype=dtype)
            self.f_b_proj = Linear(head_dim, width, bias=False, dtype=dtype)
            self.g_a_proj = Linear(hidden_size, head_dim, bias=False, dtype=dtype)
            self.g_b_proj = Linear(head_dim, width, bias=False, dtype=dtype)
            self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1, dtype=dtype))
        else:
            self.f_proj = Linear(hidden_size, width, bias=False, dtype=dtype)
            self.g_proj = Linear(hidden_size, width, bias=False, dtype=dtype)
            self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.b_proj = Linear(hidden_size, num_heads, bias=False, dtype=dtype)
        self.o_norm = GatedRMSNorm(head_dim, eps, dtype=dtype, sigmoid_gate=True)
        self.o_proj = Linear(width, hidden_size, bias=False, dtype=dtype)

    def _decay(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H_model] -> g [T, H, D] float32 log-decays (transformers
        `KimiLinearForgetGate`: softplus with its threshold of 20; `BailingHybridForgetGate`
        with `gate_lower_bound`)."""
        f = self.f_b_proj(self.f_a_proj(h)) if self.low_rank_gates else self.f_proj(h)
        g = f.float() + self.dt_bias.float()
        g = g.view(h.shape[0], self.num_heads, self.head_dim)
        if self.gate_lower_bound is not None:
            rate = self.A_log.float().view(self.num_heads, 1).exp()
            return self.gate_lower_bound * torch.sigmoid(rate * g)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -self.A_log.float().view(self.num_heads, 1).exp() * softplus

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h: [T, H_model] -> [T, H_model]; state: this layer's (conv [S + 1, 3 H D, W - 1],
        recurrent [S + 1, H, D, D] float32) slots, updated in place; `meta.linear` says which
        slot each request's tokens continue."""
        lin: LinearAttentionMetadata = meta.linear
        conv_state, kda_state = state
        if lin.fresh.numel():
            conv_state.index_fill_(0, lin.fresh, 0)
            kda_state.index_fill_(0, lin.fresh, 0)
        t, shape = h.shape[0], (h.shape[0], self.num_heads, self.head_dim)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        mixed = causal_conv1d_requests(self.qkv_proj(h), conv_state, weight.squeeze(1), None,
                                       lin)
        q, k, v = (x.reshape(shape) for x in mixed.split(self.width, dim=-1))
        g, beta = self._decay(h), torch.sigmoid(self.b_proj(h))
        out = torch.empty_like(v)
        nd = lin.num_decodes
        if nd:
            slots = lin.slots[:nd]
            states = kda_state.index_select(0, slots)
            out[:nd] = recurrent_gated_delta_rule(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd],
                                                  states)
            kda_state.index_copy_(0, slots, states)
        start = nd
        for row in range(nd, len(lin.q_lens)):
            end = start + lin.q_lens[row]
            part = slice(start, end)
            out[part] = chunk_kda_rule(q[part], k[part], v[part], g[part], beta[part],
                                       kda_state[lin.slot_list[row]])
            start = end
        gate = (self.g_b_proj(self.g_a_proj(h)) if self.low_rank_gates else self.g_proj(h))
        gate = gate.view(shape)
        return self.o_proj(self.o_norm(out, gate).reshape(t, self.width))
