"""The pre-norm decoder layer of hybrid state-space / attention models, modules named as the
checkpoint names them.

h + m * mixer(input_layernorm(h)), then h + m * sum(ffn(post_norm(h)) for each feed-forward
module): the mixer is attention (called with the layer's KV cache) or a Mamba mixer (called
with its state slots), the feed-forward modules a `FusedMoE`, a dense MLP or both summed
(Granite's shared MLP beside the routed experts); m is the residual multiplier (1 but for
Granite). Jamba's `JambaAttentionDecoderLayer` / `JambaMambaDecoderLayer` and Granite's
`GraniteMoeHybridDecoderLayer` are this block. Never a native decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.layers.attention import AttentionMetadata


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block (module docstring).

    Args:
        mixer_name, mixer: the token mixer and its checkpoint name ("self_attn", "mamba");
            called `(h [T, H], positions, meta, cache) -> [T, H]`.
        ffns: checkpoint name -> feed-forward module `(h [T, H]) -> [T, H]`, summed.
        input_layernorm: the norm before the mixer.
        post_norm_name, post_norm: the norm before the feed-forward modules and its name
            ("post_attention_layernorm", Jamba's "pre_ff_layernorm").
        residual_multiplier: scales each block's output before its residual add.
    """

    def __init__(self, mixer_name: str, mixer: nn.Module, ffns: dict[str, nn.Module],
                 input_layernorm: nn.Module, post_norm_name: str, post_norm: nn.Module,
                 residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.mixer_name, self.ffn_names, self.post_norm_name = mixer_name, list(ffns), post_norm_name
        self.add_module(mixer_name, mixer)
        self.input_layernorm = input_layernorm
        self.add_module(post_norm_name, post_norm)
        for name, module in ffns.items():
            self.add_module(name, module)
        self.residual_multiplier = residual_multiplier
        self.timer = None
        self.decode_kernel = None
        self.decode_misfit = "a hybrid state-space/attention layer"

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache, step: object = None) -> torch.Tensor:
        """h: [T, H] -> [T, H]; cache: the layer's KV pair or state slots."""
        mixer = getattr(self, self.mixer_name)
        if self.timer is None:
            h = h + self._scaled(mixer(self.input_layernorm(h), positions, meta, cache))
        else:
            with self.timer.phase("attention"):
                h = h + self._scaled(mixer(self.input_layernorm(h), positions, meta, cache))
        x = getattr(self, self.post_norm_name)(h)
        out = None
        for name in self.ffn_names:
            y = getattr(self, name)(x)
            out = y if out is None else out + y
        return h + self._scaled(out)

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, meta: AttentionMetadata, cache,
                         step: object = None) -> tuple[torch.Tensor, None]:
        """`DecoderLayer.forward_residual`'s call on the stream h + residual (residual None:
        h alone): returns (the new stream, None)."""
        h = h if residual is None else h + residual
        return self.forward(h, positions, meta, cache, step), None
