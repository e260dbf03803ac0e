"""`ArchSpec`: a `ModelShape` plus what the forward pass needs beyond sizes; `FamilyCard`: what
the README says of an architecture."""

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
        embedding_multiplier: scales the token embeddings before the first layer (Granite's
            `embedding_multiplier`, AFMoE's muP `hidden_size ** 0.5`; 1: none).
        logits_scaling: divides the LM head's logits (Granite's `logits_scaling`; 1: none).
        lm_head_bias: the LM head has a bias [vocab] (PhiMoE's `lm_head_bias`).
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_mtp_layers: int = 0
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    lm_head_bias: bool = False


@dataclasses.dataclass(frozen=True)
class FamilyCard:
    """What the README's families table says of one architecture (`models/families.py` writes
    the table from every registered class's card; nothing here changes how the model runs).

    Attributes:
        name: the family as users call it ("Qwen3-MoE", "DeepSeek-V3 / R1").
        examples: Hugging Face checkpoint ids of released models of this architecture.
        attention: the attention kind(s) in words ("GQA, q/k norm, sliding/full mix").
        cache: the KV-cache kinds its layers use (`kv_cache.spec` kind names: "full",
            "sliding", "mla", "state" for per-request state slots, ...).
        native_4bit: 4-bit expert formats loaded as stored ("mxfp4", "compressed-tensors
            int4"); families with
            `load_time_4bit` also take `--quantization int4|mxfp4` at load time.
        speculation: speculative methods served ("ngram", "mtp"); empty where refused (a
            per-request state cannot take rejected drafts back).
        load_time_4bit: `--quantization int4|mxfp4` is served (False where the experts'
            kernels cannot take it and startup refuses it: Nemotron-H's relu^2 experts).
    """

    name: str
    examples: tuple[str, ...]
    attention: str
    cache: tuple[str, ...] = ("full",)
    native_4bit: tuple[str, ...] = ("compressed-tensors int4",)
    speculation: tuple[str, ...] = ("ngram",)
    load_time_4bit: bool = True
