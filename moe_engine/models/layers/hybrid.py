"""The pre-norm decoder layer of hybrid state-space / attention models, modules named as the
checkpoint names them.

h + m * mixer(input_layernorm(h)), then h + m * ffn(post_norm(h)): the mixer is attention
(called with the layer's KV cache) or a Mamba mixer (called with its state slots), the
feed-forward a `FusedMoE` (with its shared experts) or a dense MLP; m is the residual
multiplier (1 but for Granite). Jamba's `JambaAttentionDecoderLayer` /
`JambaMambaDecoderLayer` and Granite's `GraniteMoeHybridDecoderLayer` are this block. Never a
native decode step.
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
        ffn_name, ffn: the feed-forward module `(h [T, H]) -> [T, H]` and its checkpoint name
            ("block_sparse_moe", Jamba's "feed_forward").
        input_layernorm: the norm before the mixer.
        post_norm_name, post_norm: the norm before the feed-forward modules and its name
            ("post_attention_layernorm", Jamba's "pre_ff_layernorm").
        residual_multiplier: scales each block's output before its residual add.
    """

    def __init__(self, mixer_name: str, mixer: nn.Module, ffn_name: str, ffn: nn.Module,
                 input_layernorm: nn.Module, post_norm_name: str, post_norm: nn.Module,
                 residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.mixer_name, self.ffn_name = mixer_name, ffn_name
        self.post_norm_name = post_norm_name
        self.add_module(mixer_name, mixer)
        self.input_layernorm = input_layernorm
        self.add_module(post_norm_name, post_norm)
        self.add_module(ffn_name, ffn)
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
        return h + self._scaled(getattr(self, self.ffn_name)(x))

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, meta: AttentionMetadata, cache,
                         step: object = None) -> tuple[torch.Tensor, None]:
        """`DecoderLayer.forward_residual`'s call on the stream h + residual (residual None:
        h alone): returns (the new stream, None)."""
        h = h if residual is None else h + residual
        return self.forward(h, positions, meta, cache, step), None


class ResidualBlock(nn.Module):
    """One pre-norm residual block, h + mixer(norm(h)) (Nemotron-H's `NemotronHBlock`; names
    `norm`, `mixer`). The mixer is called `(h, positions, meta, cache)` when `takes_cache`
    (attention, Mamba), else `(h)` (an MLP or MoE)."""

    def __init__(self, norm: nn.Module, mixer: nn.Module, takes_cache: bool) -> None:
        super().__init__()
        self.norm, self.mixer, self.takes_cache = norm, mixer, takes_cache

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache) -> torch.Tensor:
        """h: [T, H] -> [T, H]."""
        x = self.norm(h)
        if self.takes_cache:
            return h + self.mixer(x, positions, meta, cache)
        return h + self.mixer(x)


class BlockSequenceLayer(nn.Module):
    """A decoder layer made of consecutive `ResidualBlock`s (`blocks`), exactly one of which
    holds the layer's KV cache or state slots: how the engine groups checkpoints whose layers
    are single blocks, some without any cache (Nemotron-H's MLP and MoE blocks), into layers
    that each own one cache. Never a native decode step.

    Raises:
        ValueError: not exactly one block takes a cache.
    """

    def __init__(self, blocks: list[ResidualBlock]) -> None:
        super().__init__()
        if sum(b.takes_cache for b in blocks) != 1:
            raise ValueError(f"a block sequence needs exactly one block with a cache, got "
                             f"{sum(b.takes_cache for b in blocks)} of {len(blocks)}")
        self.blocks = nn.ModuleList(blocks)
        self.timer = None
        self.decode_kernel = None
        self.decode_misfit = "a sequence of hybrid blocks"

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, meta: AttentionMetadata, cache,
                         step: object = None) -> tuple[torch.Tensor, None]:
        """The blocks in order on the stream h + residual (residual None: h alone): returns
        (the new stream, None)."""
        h = h if residual is None else h + residual
        for block in self.blocks:
            h = block(h, positions, meta, cache)
        return h, None
