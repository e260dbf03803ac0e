"""Lightning attention, the linear-attention layer of MiniMax-Text-01, on per-request state
slots (`kv_cache.state`).

Per token: qkv = silu(qkv_proj(h)) gives per head q, k, v of D dims; each head keeps a
[D, D] state KV decayed by exp(-s) per token, KV += k^T v, read as o = q KV (no softmax, no
scaling; `kernels.attention.lightning`); the heads' outputs are RMS-normalised together
(over all H x D, eps 1e-6), gated by sigmoid(output_gate(h)) and projected by out_proj
(MiniMax, "MiniMax-01: Scaling Foundation Models with Lightning Attention",
arXiv:2501.08313; transformers 5.24 `MiniMaxLightningAttention`). The per-head rates are
fixed: s_h = 2^(-8 (h + 1) / H) x (1 - layer / (L - 1 + 1e-5) + 1e-5), derived here as
transformers derives them (its checkpoints may carry them, with the block decay tables, as
buffers the loader skips). The state holds no conv part (`MambaSpec` with a recurrent part
[H, D, D] only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.lightning import lightning_attention_decode, lightning_attention_prefill
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.gated_delta_net import LinearAttentionMetadata
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.norm import RMSNorm

#: The norm's epsilon (transformers builds it with MiniMaxRMSNorm's default, not rms_norm_eps).
NORM_EPS = 1e-6
#: The buffers a transformers checkpoint carries per lightning layer, derived here instead
#: (a `WeightMapping.skipped` pattern).
DERIVED_BUFFERS = r"\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$"


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """[H] float32 decay rates of layer `layer` of `num_layers` (transformers
    `MiniMaxLightningAttention.get_slope_rate`, same float32 ops)."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads) + 1
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base**exponent) * factor


class LightningAttention(nn.Module):
    """One lightning-attention layer (module docstring).

    Args:
        hidden_size: H_model; num_heads: H; head_dim: D; layer, num_layers: this layer's
            index and the decoder's depth (the decay rates); block_size: the prefill's block
            (config.json `block_size`); dtype: parameter dtype.

    Checkpoint names: `qkv_proj` [3 H D, H_model] (per head q, k, v), `output_gate`
    [H D, H_model], `out_proj` [H_model, H D], `norm.weight` [H D].
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, layer: int,
                 num_layers: int, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.block_size = num_heads, head_dim, block_size
        width = num_heads * head_dim
        self.qkv_proj = Linear(hidden_size, 3 * width, bias=False, dtype=dtype)
        self.output_gate = Linear(hidden_size, width, bias=False, dtype=dtype)
        self.out_proj = Linear(width, hidden_size, bias=False, dtype=dtype)
        self.norm = RMSNorm(width, NORM_EPS, dtype=dtype)
        self.layer, self.num_layers = layer, num_layers
        self.register_buffer("slope", lightning_slopes(num_heads, layer, num_layers),
                             persistent=False)

    def materialize_buffers(self, device: torch.device) -> None:
        """Compute the decay rates on `device` (a model built on the meta device,
        `models.materialize`)."""
        slope = lightning_slopes(self.num_heads, self.layer, self.num_layers)
        self.slope = slope.to(device)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                state: tuple[None, torch.Tensor]) -> torch.Tensor:
        """h: [T, H_model] -> [T, H_model]; state: (None, this layer's KV states
        [S + 1, H, D, D] float32), updated in place; `meta.linear` says which slot each
        request's tokens continue."""
        lin: LinearAttentionMetadata = meta.linear
        kv = state[1]
        if lin.fresh.numel():
            kv.index_fill_(0, lin.fresh, 0)
        t, d = h.shape[0], self.head_dim
        qkv = F.silu(self.qkv_proj(h)).view(t, self.num_heads, 3 * d)
        q, k, v = qkv.split(d, dim=-1)
        out = torch.empty_like(q)
        nd = lin.num_decodes
        if nd:
            slots = lin.slots[:nd]
            states = kv.index_select(0, slots)
            out[:nd] = lightning_attention_decode(q[:nd], k[:nd], v[:nd], self.slope, states)
            kv.index_copy_(0, slots, states)
        start = nd
        for row in range(nd, len(lin.q_lens)):
            end = start + lin.q_lens[row]
            part = slice(start, end)
            out[part] = lightning_attention_prefill(q[part], k[part], v[part], self.slope,
                                                    kv[lin.slot_list[row]], self.block_size)
            start = end
        out = self.norm(out.reshape(t, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(h)) * out)
