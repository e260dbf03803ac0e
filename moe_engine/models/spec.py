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
        embedding_multiplier: scales the token embeddings before the first layer (Granite's
            `embedding_multiplier`; 1: none).
        logits_scaling: divides the LM head's logits (Granite's `logits_scaling`; 1: none).
        lm_head_bias: the LM head has a bias [vocab] (PhiMoE's `lm_head_bias`).
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_mtp_layers: int = 0
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    lm_head_bias: bool = False
