"""gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; HF `GptOssForCausalLM`).

A decoder-only MoE transformer that differs from the Llama family (`moe_decoder.py`) in:
- attention alternating per `layer_types` between sliding-window ("sliding_attention", window
  `sliding_window`: a query sees itself and the window - 1 tokens before it) and full layers;
  here every layer keeps the full KV cache and the window is an attention mask
  (`layers/attention.py`);
- a learned attention sink per query head (a logit in the softmax denominator with no value);
- YaRN rotary embedding (`layers/rotary.py`, `rope_parameters` with rope_type "yarn");
- biases on q/k/v/o, on the router, and on every expert's gate/up and down projections;
- routing by top-k of the router logits, then softmax over those k (`layers/moe.topk_softmax`);
- the clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`, gate <= limit and
  |up| <= limit (`kernels/activation.py`; `swiglu_alpha`, default 1.702, and `swiglu_limit`);
- RMSNorm multiplying by its weight in float32 (`GptOssRMSNorm`).

Checkpoints (transformers 5 names): experts as `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up columns INTERLEAVED (gate = [..., 0::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I]
(interleaved alike), `down_proj` [E, I, H], `down_proj_bias` [E, H]; or, as OpenAI released them
(config.json quantization_config {"quant_method": "mxfp4"}), `gate_up_proj_blocks`
[E, 2I, H // 32, 16] / `_scales` [E, 2I, H // 32] and `down_proj_blocks` [E, H, I // 32, 16] /
`_scales` [E, H, I // 32] (OCP MX v1.0, `quant/mxfp4.py`; rows are output features, so their
interleave is undone on the packed rows exactly). The router is `mlp.router` (weight, bias) and the
sinks `self_attn.sinks` [num_heads]. The engine stores w13 [E, 2I, H] as gate rows then up rows
and w2 [E, H, I].
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from kernels.activation import SwiGLU
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, YarnScaling, rope_with_scaling_of
from moe_engine.models.moe_decoder import (
    ArchSpec,
    Attention,
    DecoderLayer,
    MoeCausalLM,
    _expert_piece,
)
from moe_engine.phase_timer import PhaseTimer
from moe_engine.plan import ModelShape

#: `GptOssExperts.alpha` when config.json has no `swiglu_alpha` (the released checkpoints).
DEFAULT_SWIGLU_ALPHA = 1.702
#: transformers `GptOssConfig.swiglu_limit` default.
DEFAULT_SWIGLU_LIMIT = 7.0

_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)
_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp\.)router\.(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class GptOssSpec(ArchSpec):
    """`ArchSpec` plus gpt-oss's extras.

    Attributes:
        yarn: YaRN rotary scaling, None for plain RoPE.
        swiglu_alpha: the clamped SwiGLU's sigmoid gain.
        swiglu_limit: its clamp (None: no clamp).
    """

    yarn: YarnScaling | None = None
    swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA
    swiglu_limit: float | None = DEFAULT_SWIGLU_LIMIT


class GptOssDecoderLayer(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> MoE block -> residual."""

    def __init__(
        self, spec: GptOssSpec, index: int, dtype: torch.dtype, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        sliding = spec.layer_types and spec.layer_types[index] == "sliding_attention"
        window = spec.sliding_window if sliding else None
        self.self_attn = Attention(spec, dtype, rotary, window, o_bias=True, sinks=True)
        self.timer: PhaseTimer | None = None
        norm = dict(eps=spec.rms_norm_eps, dtype=dtype, weight_in_float32=True)
        self.input_layernorm = RMSNorm(spec.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, **norm)
        self.mlp = FusedMoE(
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            spec.moe_intermediate_size,
            False,
            dtype,
            routing="topk_softmax",
            router_bias=spec.router_bias,
            expert_bias=spec.expert_bias,
            activation=SwiGLU(alpha=spec.swiglu_alpha, limit=spec.swiglu_limit),
        )

    forward = DecoderLayer.forward  # the same pre-norm residual block


class GptOssBackbone(nn.Module):
    """Embeddings, decoder layers (one rotary table shared), final norm."""

    def __init__(self, spec: GptOssSpec, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, spec.yarn)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(spec, i, dtype, rotary) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(
            spec.hidden_size, spec.rms_norm_eps, dtype=dtype, weight_in_float32=True
        )


class GptOssForCausalLM(MoeCausalLM):
    """gpt-oss on the engine's layers; loads the bf16/float layout and the native MXFP4 one."""

    @classmethod
    def arch_spec(cls, hf_config) -> GptOssSpec:
        """The spec from a transformers `GptOssConfig` (or any config with its fields).

        Raises:
            StartupError: a rope_type other than default or yarn.
            ValueError: a malformed layer_types / sliding_window (`ModelShape`).
        """
        theta, yarn = rope_with_scaling_of(hf_config)
        limit = getattr(hf_config, "swiglu_limit", DEFAULT_SWIGLU_LIMIT)
        return GptOssSpec.from_shape(
            ModelShape.from_hf_config(hf_config.to_dict()),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            yarn=yarn,
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", None) or DEFAULT_SWIGLU_ALPHA),
            swiglu_limit=None if limit is None else float(limit),
            norm_topk_prob=False,
            qk_norm=False,
        )

    def build_backbone(
        self, spec: GptOssSpec, dtype: torch.dtype, max_position: int
    ) -> GptOssBackbone:
        return GptOssBackbone(spec, dtype, max_position)

    def _load_one(self, name: str, tensor, params: dict) -> set[str]:
        """gpt-oss names first (router -> `mlp.gate`; experts de-interleaved, transposed to
        [E, out, in] and sliced to this rank's slots by `FusedMoE`; MXFP4 blocks/scales kept
        packed), everything else as the Llama-family models load it.

        Raises:
            ValueError: a tensor whose shape is not the gpt-oss layout's (names both shapes).
        """
        if m := _ROUTER.match(name):
            return super()._load_one(f"{m[1]}gate.{m[2]}", tensor, params)
        if not (m := _EXPERTS.match(name)):
            return super()._load_one(name, tensor, params)
        layer, gate_up, kind = int(m[1]), m[2] == "gate_up_proj", m[3] or ""
        mlp = self.model.layers[layer].mlp
        experts = mlp.local_experts
        pieces = ("gate", "up") if gate_up else ("down",)
        if kind in ("_blocks", "_scales"):
            if gate_up:
                tensor = deinterleave_gate_up(tensor, dim=1)  # rows = output features
            done = mlp.load_mxfp4_expert_weight("gate_up" if gate_up else "down", kind[1:], tensor)
            return {_expert_piece(layer, e, p) for e in experts for p in pieces} if done else set()
        hidden, size = mlp.gate.in_features, mlp.intermediate_size
        if kind == "_bias":
            _check_shape(name, tensor, (mlp.num_experts, 2 * size if gate_up else hidden))
            if gate_up:
                tensor = deinterleave_gate_up(tensor, dim=1)
            mlp.load_expert_weight(0, "gate_up_bias" if gate_up else "down_bias", tensor)
            return {f"model.layers.{layer}.mlp.{'b13' if gate_up else 'b2'}"}
        want = (mlp.num_experts, hidden, 2 * size) if gate_up else (mlp.num_experts, size, hidden)
        _check_shape(name, tensor, want)
        tensor = tensor.transpose(1, 2)  # [E, out, in]
        if gate_up:
            tensor = deinterleave_gate_up(tensor, dim=1)
        mlp.load_expert_weight(0, "gate_up" if gate_up else "down_all", tensor)
        return {_expert_piece(layer, e, p) for e in experts for p in pieces}


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up features (gate0, up0, gate1, up1, ...) along `dim` ->
    all gate features, then all up features (the engine's w13 order). Any dtype, including
    packed MXFP4 rows; returns a new tensor of the same shape."""
    return torch.cat([_every_other(t, dim, 0), _every_other(t, dim, 1)], dim=dim)


def _every_other(t: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    index = [slice(None)] * t.dim()
    index[dim] = slice(start, None, 2)
    return t[tuple(index)]


def _check_shape(name: str, tensor: torch.Tensor, want: tuple) -> None:
    """Raise ValueError naming the tensor and both shapes."""
    if tuple(tensor.shape) != want:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{want} (gpt-oss layout)"
        )
