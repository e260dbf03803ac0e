"""Gated short convolution on per-request state slots (`kv_cache.state`).

`ShortConv` is the "conv" layer of LFM2 / LFM2-MoE (Liquid AI, "LFM2 Technical Report",
arXiv:2511.23404; transformers 5.24 `Lfm2MoeShortConv`, `modeling_lfm2_moe.py`): in_proj
splits h into B, C, x; the depthwise causal conv1d of kernel L (no activation) runs over
B * x; the output is out_proj(C * conv). Its only state is the conv's last L - 1 inputs per
request (`MambaSpec` with a conv part only), carried exactly across prefill chunks and
decodes.

The conv runs per request through `gated_delta_net.causal_conv1d_requests`.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.gated_delta_net import (
    LinearAttentionMetadata,
    causal_conv1d_requests,
)
from moe_engine.models.layers.linear import Linear


class ShortConv(nn.Module):
    """One gated short-convolution layer (module docstring).

    Args:
        hidden_size: H (the conv's channels); kernel_size: L (`conv_L_cache`);
        bias: biases on in_proj, the conv and out_proj (`conv_bias`); dtype: parameter dtype.

    Checkpoint names (under the layer's mixer): `in_proj` [3H, H], `conv.weight` [H, 1, L]
    (`conv.bias` [H] with bias), `out_proj` [H, H].
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=bias, dtype=dtype)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.zeros(hidden_size, 1, kernel_size, dtype=dtype))
        self.conv.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if bias else None
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                state: tuple[torch.Tensor, None]) -> torch.Tensor:
        """h: [T, H] -> [T, H]; state: (this layer's conv state [S + 1, H, L - 1], None),
        updated in place; `meta.linear` says which slot each request's tokens continue."""
        lin: LinearAttentionMetadata = meta.linear
        conv_state = state[0]
        if lin.fresh.numel():
            conv_state.index_fill_(0, lin.fresh, 0)
        b, c, x = self.in_proj(h).split(self.hidden_size, dim=-1)
        conv = causal_conv1d_requests(b * x, conv_state, self.conv.weight.squeeze(1),
                                      self.conv.bias, lin, silu=False)
        return self.out_proj(c * conv)
