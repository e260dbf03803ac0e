"""`ArchSpec`: a `ModelShape` plus what the forward pass needs beyond sizes."""

from __future__ import annotations

import dataclasses

from moe_engine.startup.model_shape import ModelShape


@dataclasses.dataclass(frozen=True)
class ArchSpec(ModelShape):
    """A `ModelShape` (the sizes `plan.py` does its arithmetic on) plus what the forward pass
    needs beyond sizes. Architectures with more fields subclass it (frozen, with defaults).

    Attributes:
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        num_mtp_layers: multi-token-prediction layers built beside the decoder (0 unless
            speculative decoding asks for them: `--speculative-method mtp`).
        nope_layers: decoder layers whose attention has no position embedding (NoPE: the
            global layers of EXAONE-MoE, Cohere2-MoE); the default `build_attention` gives
            them no rotary module.
        embed_scale: multiplies the token embeddings (AFMoE's muP `hidden_size ** 0.5`); 1:
            none.
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_mtp_layers: int = 0
    nope_layers: tuple[int, ...] = ()
    embed_scale: float = 1.0
