"""The Mamba-2 mixer on per-request state slots (`kv_cache.state`), as the Gated DeltaNet
layer (`gated_delta_net.py`) keeps its state.

Per token (Dao and Gu 2024, "Transformers are SSMs", arXiv:2405.21060; transformers 5.24
`GraniteMoeHybridMambaLayer` / `NemotronHMamba2Mixer`, whose torch path this follows):
in_proj splits h into the gate z [I], the conv input xBC [I + 2 G N] and the time step dt
[Hh]; xBC goes through a depthwise causal conv1d with SiLU (its last W - 1 inputs are the conv
state) and splits into x [Hh, P] and the grouped B, C [G, N]; the selective scan
(`kernels.attention.ssm_scan`) carries one [Hh, P, N] float32 state per request; the output
y + D x is multiplied by silu(z), normalised per group (`norm.GroupGatedRMSNorm`) and
projected back by out_proj. A prefill chunk continues the state the previous chunk left, so
a prompt split over steps gives the same state as one pass; decodes run one step batched.

Checkpoint names: `in_proj`, `conv1d.weight` [C, 1, W] (+ `conv1d.bias`), `dt_bias`,
`A_log`, `D` [Hh], `norm.weight` [I], `out_proj`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kernels.attention.gated_delta import causal_conv1d_decode, causal_conv1d_prefill
from kernels.attention.ssm_scan import mamba2_chunk_scan, mamba2_state_update, softplus_dt
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.gated_delta_net import LinearAttentionMetadata
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.norm import GroupGatedRMSNorm

#: Tokens per block of the prefill scan's quadratic intra-chunk term (any size gives the same
#: result up to rounding; transformers' `chunk_size` only tiles its own scan).
PREFILL_SCAN_CHUNK = 64


def prefill_rows(lin: LinearAttentionMetadata) -> Iterator[tuple[slice, int]]:
    """(token rows, state slot) of each request after the decodes, in step order."""
    start = sum(lin.q_lens[: lin.num_decodes])
    for row in range(lin.num_decodes, len(lin.q_lens)):
        end = start + lin.q_lens[row]
        yield slice(start, end), lin.slot_list[row]
        start = end


def zero_fresh(lin: LinearAttentionMetadata, *states: torch.Tensor) -> None:
    """Zero the slots of requests starting at token 0 in every state tensor [S + 1, ...]."""
    if lin.fresh.numel():
        for state in states:
            state.index_fill_(0, lin.fresh, 0)


def conv_rows(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, lin: LinearAttentionMetadata) -> torch.Tensor:
    """silu(causal conv1d) of every request's rows x [T, C] from its conv state
    [S + 1, C, W - 1] (updated in place): the decodes batched, each prefill from its slot."""
    out = torch.empty_like(x)
    nd = lin.num_decodes
    if nd:
        slots = lin.slots[:nd]
        states = conv_state.index_select(0, slots)
        out[:nd] = causal_conv1d_decode(x[:nd], states, weight, bias)
        conv_state.index_copy_(0, slots, states)
    for rows, slot in prefill_rows(lin):
        out[rows] = causal_conv1d_prefill(x[rows], conv_state[slot], weight, bias)
    return out


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (module docstring).

    Args:
        hidden_size: H; num_heads: Hh; head_dim: P (I = Hh P); n_groups: G (Hh a multiple);
        state_size: N; conv_kernel: W; eps: the gated norm's epsilon; dtype: parameter
        dtype; chunk_size: tokens per block of the prefill scan.
        proj_bias: in_proj and out_proj have biases; conv_bias: the conv1d has one.
        dt_limit: the prefill scan's clamp of the time steps (transformers' `time_step_limit`;
            the decode step does not clamp, as there).

    Raises:
        ValueError: num_heads not a multiple of n_groups.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                 state_size: int, conv_kernel: int, eps: float, dtype: torch.dtype, *,
                 chunk_size: int = PREFILL_SCAN_CHUNK, proj_bias: bool = False,
                 conv_bias: bool = True,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba heads {num_heads} are not a multiple of n_groups {n_groups}")
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.chunk_size, self.dt_limit = n_groups, chunk_size, dt_limit
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        proj = self.intermediate + self.conv_dim + num_heads
        self.in_proj = Linear(hidden_size, proj, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, conv_kernel, dtype=dtype))
        self.conv1d.bias = (
            nn.Parameter(torch.zeros(self.conv_dim, dtype=dtype)) if conv_bias else None
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(num_heads, dtype=dtype))
        self.norm = GroupGatedRMSNorm(self.intermediate, self.intermediate // n_groups, eps, dtype)
        self.out_proj = Linear(self.intermediate, hidden_size, bias=proj_bias, dtype=dtype)

    @staticmethod
    def state_shapes(num_heads: int, head_dim: int, n_groups: int, state_size: int,
                     conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One request's state in one layer: conv [I + 2 G N, W - 1], recurrent [Hh, P, N]."""
        conv_dim = num_heads * head_dim + 2 * n_groups * state_size
        return (conv_dim, conv_kernel - 1), (num_heads, head_dim, state_size)

    @staticmethod
    def num_params(hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                   state_size: int, conv_kernel: int, proj_bias: bool, conv_bias: bool) -> int:
        """Parameters of one layer (for the startup plan's weight bytes)."""
        inter = num_heads * head_dim
        conv_dim = inter + 2 * n_groups * state_size
        proj = inter + conv_dim + num_heads
        biases = (proj + hidden_size) * proj_bias + conv_dim * conv_bias
        return hidden_size * proj + conv_dim * conv_kernel + 3 * num_heads + inter * (
            1 + hidden_size) + biases

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h: [T, H] -> [T, H]; state: this layer's (conv [S + 1, C, W - 1], recurrent
        [S + 1, Hh, P, N] float32) slots, updated in place; `meta.linear` says which slot each
        request's tokens continue. positions are unused (the state orders the tokens)."""
        lin: LinearAttentionMetadata = meta.linear
        conv_state, ssm_state = state
        zero_fresh(lin, conv_state, ssm_state)
        t = h.shape[0]
        z, xbc, dt = self.in_proj(h).split([self.intermediate, self.conv_dim, self.num_heads], -1)
        xbc = conv_rows(xbc, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, lin)
        gn = self.n_groups * self.state_size
        x, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        x = x.view(t, self.num_heads, self.head_dim)
        b, c = b.view(t, self.n_groups, self.state_size), c.view(t, self.n_groups, self.state_size)
        dt = softplus_dt(dt, self.dt_bias)
        a = -self.A_log.float().exp()
        y = torch.empty(t, self.num_heads, self.head_dim, dtype=torch.float32, device=h.device)
        nd = lin.num_decodes
        if nd:
            slots = lin.slots[:nd]
            states = ssm_state.index_select(0, slots)
            y[:nd] = mamba2_state_update(x[:nd], dt[:nd], a, b[:nd], c[:nd], self.D, states)
            ssm_state.index_copy_(0, slots, states)
        for rows, slot in prefill_rows(lin):
            y[rows], ssm_state[slot] = mamba2_chunk_scan(
                x[rows], dt[rows], a, b[rows], c[rows], self.D, ssm_state[slot],
                self.chunk_size, self.dt_limit,
            )  # fmt: skip
        y = self.norm(y.view(t, self.intermediate), z)
        return self.out_proj(y.to(h.dtype))
