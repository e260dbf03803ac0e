"""Gated DeltaNet, the linear-attention layer of Qwen3-Next / Qwen3.5-MoE, on per-request state
slots (`kv_cache.state`).

Per token: in_proj_qkvz and in_proj_ba project h; q, k, v go through a depthwise causal conv1d
with SiLU (its last W - 1 inputs are the conv state), q and k are L2-normalised, beta =
sigmoid(b) and the decay g = -exp(A_log) * softplus(a + dt_bias); the delta rule updates a
[Dk, Dv] matrix per value head (the recurrent state) and reads it with q; the output is
normalised, gated by silu(z) and projected back (Yang, Kautz, Hatamizadeh 2024, "Gated Delta
Networks", arXiv:2412.06464; transformers 5.24 `Qwen3NextGatedDeltaNet`, whose torch path this
follows). A prefill chunk runs the chunked form of the rule from the state the previous chunk
left (`kernels.attention.gated_delta.chunk_gated_delta_rule`), decodes run one recurrent step
batched
over the requests.

`LinearAttentionMetadata` is what a step tells these layers: each request's slot, query
length and whether it starts fresh; `LinearAttentionDecoderLayer` is the pre-norm block around
the layer (checkpoint name `linear_attn`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.norm import GatedRMSNorm


@dataclass
class LinearAttentionMetadata:
    """A step's requests as the linear layers see them, in the step's row order (decodes,
    one token each, first).

    Attributes:
        slots: [B] int64, each request's state slot (`KVCacheManager.state_slot`);
            slot_list: the same as host ints (the prefill rows index with them).
        q_lens: tokens each request feeds this step.
        num_decodes: the leading requests that feed one token (batched recurrent step).
        fresh: [F] int64, the slots of requests starting at token 0 (a new request or one
            preempted and recomputed): their state is zeroed before the step reads it.
    """

    slots: torch.Tensor
    slot_list: list[int]
    q_lens: list[int]
    num_decodes: int
    fresh: torch.Tensor

    @classmethod
    def of(cls, slots: list[int], q_lens: list[int], starts: list[int]) -> LinearAttentionMetadata:
        """From the host's ints (rows with a one-token query first, as the runner orders)."""
        num_decodes = 0
        while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
            num_decodes += 1
        fresh = [s for s, start in zip(slots, starts, strict=True) if start == 0]
        return cls(torch.tensor(slots, dtype=torch.int64), list(slots), list(q_lens),
                   num_decodes, torch.tensor(fresh, dtype=torch.int64))


def causal_conv1d_requests(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, lin: LinearAttentionMetadata,
                           silu: bool = True) -> torch.Tensor:
    """The depthwise causal conv1d (+ SiLU unless `silu` is False) of every request's tokens
    from its conv state.

    Args:
        x: [T, C], the step's rows (decodes first, then each prefill chunk in request order).
        conv_state: [S + 1, C, W - 1], per slot its last W - 1 inputs, updated in place.
        weight: [C, W]; bias: [C] or None.
        lin: which slot and how many tokens each request has.

    Returns:
        [T, C] in x.dtype.
    """
    out = torch.empty_like(x)
    nd = lin.num_decodes
    if nd:
        slots = lin.slots[:nd]
        states = conv_state.index_select(0, slots)
        out[:nd] = causal_conv1d_decode(x[:nd], states, weight, bias, silu)
        conv_state.index_copy_(0, slots, states)
    start = nd
    for row in range(nd, len(lin.q_lens)):
        end = start + lin.q_lens[row]
        out[start:end] = causal_conv1d_prefill(x[start:end], conv_state[lin.slot_list[row]],
                                               weight, bias, silu)
        start = end
    return out


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (module docstring).

    Args:
        hidden_size: H; num_k_heads, num_v_heads: Hk, Hv (Hv a multiple of Hk);
        head_k_dim, head_v_dim: Dk, Dv; conv_kernel: W; eps: the gated norm's epsilon;
        dtype: parameter dtype.
        split_projections: four plain projections `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
            `in_proj_a` (Qwen3.5-MoE) instead of Qwen3-Next's two per-key-head interleaved
            `in_proj_qkvz` and `in_proj_ba`.
        fused_projection: the four split projections stored as one `in_proj` [C + Hv Dv +
            2 Hv, H], rows [q | k | v | z | b | a] (LaraMini's checkpoints); implies the split
            layout.

    Checkpoint names: `in_proj_qkvz`, `in_proj_ba` (or the four split ones, or the fused
    `in_proj`), `conv1d.weight`
    [C, 1, W], `dt_bias`, `A_log`, `norm.weight`, `out_proj`.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float, dtype: torch.dtype,
                 split_projections: bool = False, fused_projection: bool = False) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {num_k_heads}")
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        channels = 2 * self.key_dim + self.value_dim
        self.split_projections = split_projections or fused_projection
        self.fused_projection = fused_projection
        if fused_projection:
            self.in_proj = Linear(hidden_size, channels + self.value_dim + 2 * num_v_heads,
                                  bias=False, dtype=dtype)
        elif split_projections:
            self.in_proj_qkv = Linear(hidden_size, channels, bias=False, dtype=dtype)
            self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False, dtype=dtype)
            self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False, dtype=dtype)
            self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False, dtype=dtype)
        else:
            self.in_proj_qkvz = Linear(hidden_size, channels + self.value_dim, bias=False,
                                       dtype=dtype)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(channels, 1, conv_kernel, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(head_v_dim, eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False, dtype=dtype)

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """h [T, H] -> (mixed q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]), undoing the
        per-key-head layout of the checkpoint's projections (transformers
        `fix_query_key_value_ordering`: per q/k head, its q, k, then its Hv / Hk value heads'
        v and z; b and a likewise); the split projections are already in that order."""
        t, r = h.shape[0], self.hv // self.hk
        if self.fused_projection:
            sizes = [2 * self.key_dim + self.value_dim, self.value_dim, self.hv, self.hv]
            mixed, z, b, a = self.in_proj(h).split(sizes, dim=-1)
            return mixed, z.reshape(t, self.hv, self.dv), b, a
        if self.split_projections:
            z = self.in_proj_z(h).view(t, self.hv, self.dv)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        qkvz = self.in_proj_qkvz(h).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(h).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h: [T, H] -> [T, H]; state: this layer's (conv [S + 1, C, W - 1], recurrent
        [S + 1, Hv, Dk, Dv] float32) slots, updated in place for every request of the step;
        `meta.linear` says which slot each request's tokens continue."""
        lin: LinearAttentionMetadata = meta.linear
        conv_state, ssm_state = state
        if lin.fresh.numel():
            conv_state.index_fill_(0, lin.fresh, 0)
            ssm_state.index_fill_(0, lin.fresh, 0)
        mixed, z, b, a = self._project(h)
        mixed = causal_conv1d_requests(mixed, conv_state, self.conv1d.weight.squeeze(1), None,
                                       lin)
        t = h.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk)
        v = v.view(t, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self._delta_rule(q, k, v, g, beta, ssm_state, lin)
        out = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(t, self.value_dim))

    def _delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, ssm_state: torch.Tensor,
                    lin: LinearAttentionMetadata) -> torch.Tensor:
        """[T, Hv, Dv]: the decodes' one recurrent step, batched, then each prefill chunk's
        chunked rule from its request's state; the states are written back."""
        out = torch.empty(q.shape[0], self.hv, self.dv, dtype=q.dtype, device=q.device)
        nd = lin.num_decodes
        if nd:
            slots = lin.slots[:nd]
            states = ssm_state.index_select(0, slots)
            out[:nd] = recurrent_gated_delta_rule(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd],
                                                  states)
            ssm_state.index_copy_(0, slots, states)
        start = nd
        for row in range(nd, len(lin.q_lens)):
            end = start + lin.q_lens[row]
            slot = lin.slot_list[row]
            part = slice(start, end)
            out[part], final = chunk_gated_delta_rule(q[part], k[part], v[part], g[part],
                                                      beta[part], ssm_state[slot])
            ssm_state[slot] = final
            start = end
        return out


class LinearAttentionDecoderLayer(nn.Module):
    """Pre-norm residual block around a state-slot mixer (a `GatedDeltaNet`, a
    `short_conv.ShortConv`, ...: called `(h [T, H], meta, state) -> [T, H]`): h +
    linear_attn(norm1(h)), then + mlp(norm2(h)) (transformers `Qwen3NextDecoderLayer` of
    layer type "linear_attention"). Never a native decode step (`decode_misfit` says why;
    `mixer` names the mixer there). The mixer is held as `mixer_name` (its checkpoint
    name)."""

    def __init__(self, linear_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, mixer: str = "Gated DeltaNet",
                 mixer_name: str = "linear_attn") -> None:
        super().__init__()
        #: The mixer's attribute (checkpoint) name: "linear_attn", or the family's ("conv":
        #: LFM2; "self_attn": Kimi-Linear).
        self.mixer_name = mixer_name
        setattr(self, mixer_name, linear_attn)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.timer = None
        self.decode_kernel = None
        self.decode_misfit = f"a linear-attention ({mixer}) layer"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, torch.Tensor], step: object = None) -> torch.Tensor:
        """h: [T, H] -> [T, H]; state: the layer's state slots (`GatedDeltaNet.forward`)."""
        mixer = getattr(self, self.mixer_name)
        if self.timer is None:
            h = h + mixer(self.input_layernorm(h), meta, state)
        else:
            with self.timer.phase("attention"):
                h = h + mixer(self.input_layernorm(h), meta, state)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, meta: AttentionMetadata,
                         state: tuple[torch.Tensor, torch.Tensor], step: object = None
                         ) -> tuple[torch.Tensor, None]:
        """`DecoderLayer.forward_residual`'s call on the stream h + residual (residual None:
        h alone): returns (the new stream, None)."""
        h = h if residual is None else h + residual
        return self.forward(h, positions, meta, state, step), None
