"""The Llama-style blocks the architecture files compose: the dense SwiGLU MLP, the pre-norm
decoder layer and the backbone (the attention block is `layers/self_attention.Attention`).

Per layer: norm -> attention -> residual -> norm -> MLP (a sparse MoE block or a dense MLP) ->
residual (Touvron et al., "LLaMA", 2023; Hugging Face `LlamaDecoderLayer`). What differs per
architecture (biases, q/k norm, sinks, the rotary module, the MLP of each layer, the norms) is
passed in; `models/base.py`'s `MoeCausalLM` builds these from an `ArchSpec`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.decode_layer.native import DecodeLayerKernel
from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.linear import Linear
from moe_engine.phase_timer import PhaseTimer

_NO_PHASE = contextlib.nullcontext()

if TYPE_CHECKING:
    pass


class DecodeInputs(Protocol):
    """What a layer's native decode step reads of its step (`native_decode.DecodeStep`).

    Attributes:
        topk_weights: [T, k] float32, the routing weights of the layer that just ran.
    """

    topk_weights: torch.Tensor | None

    def args(self, group: int) -> object | None:
        """The kernel's arguments for KV-cache group `group`, None where it holds prefills."""
        ...

    def topk_ids(self, layer_index: int, recorder: object) -> torch.Tensor:
        """[T, k] int32: where layer `layer_index` writes its routing."""
        ...


class DenseMLP(nn.Module):
    """SwiGLU MLP, down(silu(gate(h)) * up(h)): the dense layers (Qwen3-MoE `mlp_only_layers`,
    DeepSeek `first_k_dense_replace`) and shared experts.

    Args:
        hidden_size: H; intermediate_size: I; dtype: parameter dtype.
        bias: the three projections have biases (HY-V3's `mlp_bias`, ERNIE-4.5's `use_bias`;
            default none).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, H] -> [T, H]."""
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class NonGatedMLP(nn.Module):
    """Non-gated MLP, down(act(up(h))) (Nemotron-H's `NemotronHMLP`, act relu^2: its dense
    blocks and shared experts).

    Args:
        hidden_size: H; intermediate_size: I; activation: called on [T, I] (e.g.
            `kernels.moe.activation.RELU2`); dtype: parameter dtype; bias: biases on both.
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 activation: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.activation = activation

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, H] -> [T, H]."""
        return self.down_proj(self.activation(self.up_proj(h)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm1(h)), then + mlp(norm2(h)); or, without a
    post-attention norm, the parallel block h + attn(norm1(h)) + mlp(norm1(h)) (GPT-J's;
    Cohere's `CohereDecoderLayer`, summed in that order); with output norms ("sandwich"
    norms: Gemma-2, GLM-4's `Glm4DecoderLayer`, AFMoE) each branch's output is normalised
    before its residual add: h + post_attn(attn(norm1(h))), then + post_mlp(mlp(norm2(h))).

    Args:
        self_attn: called `(h [T, H], positions, meta, kv_cache) -> [T, H]`.
        mlp: called `(h [T, H]) -> [T, H]` (a `FusedMoE`, a `DenseMLP`, ...).
        input_layernorm, post_attention_layernorm: the two norms; post_attention_layernorm
            None: the parallel block.
        post_self_attn_layernorm, post_mlp_layernorm: the branches' output norms (GLM-4's
            names), or None (default).
        residual_multiplier: scales the attention's and the MLP's outputs before each
            residual add, h + m * attn(...) (Granite's `residual_multiplier`; default 1).
        residual_scales: None, or (attention branch, stream, MLP branch, stream) factors of a
            depth-scaled residual: each add is branch * a + stream * b (Beam's
            `depth_scaled_residual_add`), the products kept as the stream's two parts so that
            the norm after them adds them as transformers does.

    `timer`, when set (`MoeCausalLM.attach_timer`), times the attention phase (and a native
    decode step, which has no phases of its own, as "decode_layer").

    Bound to native-cpu for "decode_layer", a decode-only step of up to
    `cpu_decode_layer.MAX_ROWS` tokens (`MoeCausalLM.forward` passes its `DecodeStep`) runs
    the whole layer as one native call (`kernels.decode_layer.native.DecodeLayerKernel`, the
    residual stream bit-identical to this module path) where the layer's modules are the ones
    it implements (`native_decode.decode_misfit`).
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module | None,
        *,
        residual_multiplier: float = 1.0,
        post_self_attn_layernorm: nn.Module | None = None,
        post_mlp_layernorm: nn.Module | None = None,
        residual_scales: tuple[float, float, float, float] | None = None,
    ) -> None:
        super().__init__()
        self.residual_multiplier = residual_multiplier
        self.residual_scales = residual_scales
        self.post_self_attn_layernorm = post_self_attn_layernorm
        self.post_mlp_layernorm = post_mlp_layernorm
        self.self_attn = self_attn
        self.timer: PhaseTimer | None = None
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        #: Attached by `kernel_binding.bind_kernels` (`native_decode.attach_decode_kernel`):
        #: the native decode step, or None (the module path), and why not.
        self.decode_kernel: DecodeLayerKernel | None = None
        self.decode_misfit: str | None = "not bound"

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
        step: DecodeInputs | None = None,
    ) -> torch.Tensor:
        """h: [T, H] -> [T, H] (`forward_residual` with the stream in h, its two parts added)."""
        out, residual = self.forward_residual(h, None, positions, meta, kv_cache, step)
        return out if residual is None else out + residual

    def forward_residual(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
        step: DecodeInputs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer on the residual stream h + residual (residual None: h alone), with each
        residual add fused into the norm after it (`RMSNorm(x, residual)`; vLLM's decoder
        layers): the stream's next value is x + residual' for the returned (x, residual').

        Args:
            h, residual: [T, H], the stream in two parts (the previous layer's MLP output and
                its residual), or the stream in h and None.
            positions, meta, kv_cache, step: as `forward`.

        Returns:
            (x, residual'): x [T, H] this layer's MLP output and residual' [T, H]; or (the new
            stream, None) where a native decode kernel ran the layer on h in place.
        """
        kernel = self.decode_kernel
        if kernel is not None and step is not None:
            args = step.args(self.self_attn.attn.kv_group)
            if args is not None:
                if residual is not None:
                    h = h + residual
                # counted once a step, for all layers (DecodeStep.record_routing)
                ids = step.topk_ids(self.mlp.layer_index, self.mlp.load_recorder,
                                    self.mlp.routed_capture, self.mlp.routed_row)
                with self.timer.phase("decode_layer") if self.timer is not None else _NO_PHASE:
                    kernel.run(h, args, kv_cache, step.topk_weights, ids)
                return h, None
        with self.timer.phase("attention") if self.timer is not None else _NO_PHASE:
            if residual is None:
                x, residual = self.input_layernorm(h), h
            else:
                x, residual = self.input_layernorm(h, residual)
            attn_out = self.self_attn(x, positions, meta, kv_cache)
        m = self.residual_multiplier
        if m != 1.0:
            attn_out = attn_out * m
        if self.post_attention_layernorm is None:  # parallel: the MLP reads norm1's output too
            out = self.mlp(x)
            return (out * m if m != 1.0 else out), residual + attn_out
        if self.post_self_attn_layernorm is not None:
            attn_out = self.post_self_attn_layernorm(attn_out)
        scales = self.residual_scales
        if scales is not None:
            attn_out, residual = attn_out * scales[0], residual * scales[1]
        x, residual = self.post_attention_layernorm(attn_out, residual)
        out = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            out = self.post_mlp_layernorm(out)
        if scales is not None:
            out, residual = out * scales[2], residual * scales[3]
        return (out * m if m != 1.0 else out), residual


class PostNormDecoderLayer(DecoderLayer):
    """Norms on the sublayers' outputs instead of their inputs: h + norm1(attn(h)), then
    + norm2(mlp(h)) (OLMo 2's reordered norms; transformers `FlexOlmoDecoderLayer`).

    Args:
        self_attn, mlp: as `DecoderLayer`.
        post_attention_layernorm: the norm of the attention's output.
        post_feedforward_layernorm: the norm of the MLP's output.

    Checkpoint names: `post_attention_layernorm`, `post_feedforward_layernorm` (no
    `input_layernorm`). It never takes the native decode step (`native_decode.decode_misfit`:
    the kernel implements the pre-norm layer).
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        post_attention_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ) -> None:
        super().__init__(self_attn, mlp, None, post_attention_layernorm)
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward_residual(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
        step: DecodeInputs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `DecoderLayer.forward_residual` (the stream is x + residual'); `step` is
        unused."""
        if residual is not None:
            h = h + residual
        with self.timer.phase("attention") if self.timer is not None else _NO_PHASE:
            x = self.self_attn(h, positions, meta, kv_cache)
        h = h + self.post_attention_layernorm(x)
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Backbone(nn.Module):
    """Embeddings, decoder layers, final norm (checkpoint prefix `model.`).

    Args:
        embed_tokens: [vocab, H] embedding; layers: the decoder layers in order; norm: the
            final norm.
    """

    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

