"""Mixture of attention heads: the query and output projections are experts chosen per token
by a router, the keys and values are shared (Zhang et al., "Mixture of Attention Heads:
Selecting Attention Heads Per Token", EMNLP 2022; JetMoE's `JetMoeMoA` / `JetMoeAttention`,
transformers 5.24 `modeling_jetmoe.py`).

Per token t with top-k experts e_1..e_k (top-k of the router logits, softmax over those k:
`routing.topk_softmax`) and weights g_1..g_k:
- q_j = Wq[e_j] x_t [Hkv * D] for each chosen expert j (query heads (j, h), h < Hkv), keys
  and values from one `kv_proj` [H -> 2 Hkv D] (k first, then v);
- rotary on q and k; query head (j, h) attends KV head h: the engine's GQA groups query heads
  by KV head, so the heads are laid out (h, j), Hq = Hkv * k query heads over Hkv KV heads,
  through the paged KV cache (`PagedAttention`, its native and Triton kernels);
- y_t = sum_j g_j Wo[e_j] o_(t, j) + bias, with o_(t, j) the Hkv * D outputs of expert slot j.
The expert projections run as one `F.linear` per expert on its tokens (the torch path: the
fused-MoE kernels compute SwiGLU experts, not a single projection). Under expert parallelism
these experts stay whole on every rank (attention is data-parallel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.models.layers.attention import AttentionMetadata, PagedAttention
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.routing import topk_softmax


def expert_projection(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each row's projection by each of its experts.

    Args:
        x: [T, in] or [T, k, in] (one input per token, or one per token and expert slot).
        weight: [E, out, in] the experts' weights.
        ids: [T, k] int expert ids.

    Returns:
        [T, k, out] in x's dtype: out[t, j] = weight[ids[t, j]] @ x[t] (or x[t, j]).
    """
    t, k = ids.shape
    out = x.new_empty(t, k, weight.shape[1])
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        inputs = x[rows] if x.dim() == 2 else x[rows, slots]
        out[rows, slots] = F.linear(inputs, weight[e])
    return out


class MixtureOfAttention(nn.Module):
    """Router-chosen query/output projection experts over shared keys and values (module
    docstring).

    Args:
        hidden_size: H; num_experts: E; top_k: k (experts per token); num_kv_heads: Hkv;
        head_dim: D; rotary: the shared rotary module (`rotary(positions, q, k) -> (q, k)`);
        dtype: parameter dtype.

    Attributes (checkpoint names, as the architecture renames them):
        router: Linear(H, E) without bias; q_experts: [E, Hkv D, H]; o_experts:
        [E, H, Hkv D]; o_bias: [H]; kv_proj: Linear(H, 2 Hkv D) without bias; attn: the
        layer's `PagedAttention` (Hkv * k query heads, scale D ** -0.5).

    Raises:
        ValueError: top_k outside [1, E].
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: nn.Module,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.top_k, self.num_kv_heads, self.head_dim = top_k, num_kv_heads, head_dim
        width = num_kv_heads * head_dim
        self.router = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.q_experts = nn.Parameter(
            torch.empty(num_experts, width, hidden_size, dtype=dtype), requires_grad=False
        )
        self.o_experts = nn.Parameter(
            torch.empty(num_experts, hidden_size, width, dtype=dtype), requires_grad=False
        )
        self.o_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.kv_proj = Linear(hidden_size, 2 * width, bias=False, dtype=dtype)
        self.rotary = rotary  # shared by all layers
        self.attn = PagedAttention(num_kv_heads * top_k, num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache
    ) -> torch.Tensor:
        """h: [T, H] -> [T, H]; positions [T] int64; kv_cache: this layer's (K, V) pair."""
        t, k, hkv, d = h.shape[0], self.top_k, self.num_kv_heads, self.head_dim
        weights, ids = topk_softmax(self.router(h), k)  # [T, k] float32, int32
        q = expert_projection(h, self.q_experts, ids)  # [T, k, Hkv D]
        q = q.view(t, k, hkv, d).transpose(1, 2).reshape(t, hkv * k, d)  # heads (h, j)
        key, value = self.kv_proj(h).chunk(2, dim=-1)
        key, value = key.view(t, hkv, d), value.reshape(t, hkv, d)
        q, key = self.rotary(positions, q, key)
        out = self.attn(q, key, value, kv_cache, meta)  # [T, Hkv k D]
        out = out.view(t, hkv, k, d).transpose(1, 2).reshape(t, k, hkv * d)  # slots (j)
        y = expert_projection(out, self.o_experts, ids)  # [T, k, H]
        y = (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
        return y + self.o_bias
