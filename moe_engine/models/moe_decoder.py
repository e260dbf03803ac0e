"""A decoder-only MoE transformer over the paged KV cache, shared by the Llama-family MoE models.

Per layer: RMSNorm -> attention (GQA, optional per-head q/k RMSNorm, RoPE) -> residual ->
RMSNorm -> sparse MoE block (or a dense SwiGLU MLP on layers the config marks dense) ->
residual. Architecture files (qwen3_moe.py, mixtral.py) only describe their config and names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.kv_cache.spec import AttentionGroup
from moe_engine.models.layers.attention import AttentionMetadata, PagedAttention
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding
from moe_engine.phase_timer import PhaseTimer
from moe_engine.plan import ModelShape
from quant.int4 import Int4Weight, dequantize_int4


@dataclasses.dataclass(frozen=True)
class ArchSpec(ModelShape):
    """A `ModelShape` (the sizes `plan.py` does its arithmetic on) plus what the forward pass
    needs beyond sizes. Architecture files build it from config.json.

    Attributes:
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_shape(cls, shape: ModelShape, **extra) -> ArchSpec:
        """The shape's fields plus `extra` (rms_norm_eps, rope_theta, overrides)."""
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)}
        return cls(**{**fields, **extra})


class Attention(nn.Module):
    """Fused QKV projection, optional q/k norm, RoPE, paged attention, output projection.

    `sliding_window`: this layer's window (tokens, the query included; config.json
    `sliding_window` when the layer is sliding), None for full attention. `o_bias`: a bias on
    the output projection; `sinks`: learned per-head sink logits in the softmax (gpt-oss).
    """

    def __init__(
        self,
        spec: ArchSpec,
        dtype: torch.dtype,
        rotary: RotaryEmbedding,
        sliding_window: int | None = None,
        *,
        o_bias: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(
            spec.hidden_size, sum(self.sizes), bias=spec.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(q_size, spec.hidden_size, bias=o_bias, dtype=dtype)
        # learned per-head sink logits (gpt-oss), filled from the checkpoint
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads, dtype=dtype)) if sinks else None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype)
        self.rotary = rotary  # shared by all layers
        self.attn = PagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache
    ) -> torch.Tensor:
        """h: [T, H] -> [T, H]."""
        t, s = h.shape[0], self.spec
        q, k, v = self.qkv_proj(h).split(self.sizes, dim=-1)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, sinks=self.sinks))


class DenseMLP(nn.Module):
    """SwiGLU MLP for the layers a config marks dense (Qwen3-MoE `mlp_only_layers`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: ArchSpec, index: int, dtype: torch.dtype, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        sliding = bool(spec.layer_types) and spec.layer_types[index] == "sliding_attention"
        self.self_attn = Attention(spec, dtype, rotary, spec.sliding_window if sliding else None)
        self.timer: PhaseTimer | None = None
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        if index in spec.moe_layers:
            self.mlp: nn.Module = FusedMoE(
                spec.num_experts,
                spec.top_k,
                spec.hidden_size,
                spec.moe_intermediate_size,
                spec.norm_topk_prob,
                dtype,
            )
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, dtype)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache
    ) -> torch.Tensor:
        if self.timer is None:
            h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_cache)
        else:
            with self.timer.phase("attention"):
                h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, dtype, rotary) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)


_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$"
)
_EXPERT_ID = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_SHARD = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_QKV = re.compile(r"(model\.layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)$")


class MoeCausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm, LM head.

    Architecture subclasses implement `arch_spec(hf_config)`.

    Args:
        spec: the architecture's numbers; dtype: parameter dtype.
        max_position: positions the rotary table covers (tokens); default the model's
            max_position_embeddings (the engine passes max_model_len).
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype, max_position: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.model = self.build_backbone(spec, dtype, max_position or spec.max_position_embeddings)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def arch_spec(cls, hf_config) -> ArchSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def kv_cache_groups_for(cls, spec: ArchSpec) -> list[AttentionGroup]:
        """The layers by attention kind, (kind, sliding window or None, layer indices), from
        which the engine makes its KV-cache groups (`kv_cache.make_kv_cache_groups`) before the
        model is built; default `spec.attention_groups()` (config.json `layer_types`: one
        full-attention group with every layer unless some layers are sliding)."""
        return spec.attention_groups()

    def kv_cache_groups(self) -> list[AttentionGroup]:
        """`kv_cache_groups_for(self.spec)`."""
        return self.kv_cache_groups_for(self.spec)

    def build_backbone(self, spec: ArchSpec, dtype: torch.dtype, max_position: int) -> nn.Module:
        """The embeddings, decoder layers and final norm (attributes `embed_tokens`, `layers`,
        `norm`); architectures whose layers differ from `DecoderLayer` override it."""
        return Backbone(spec, dtype, max_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H]."""
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, positions, meta, kv_cache)
        return self.model.norm(h)

    def attach_timer(self, timer: PhaseTimer) -> None:
        """Time attention and the MoE blocks' phases of every layer into `timer`."""
        for layer in self.model.layers:
            layer.timer = timer
            if isinstance(layer.mlp, FusedMoE):
                layer.mlp.timer = timer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def expected_weight_names(self) -> set[str]:
        """Every piece `load_weights` must fill: parameter names, with the stacked expert
        weights counted per expert and projection ("model.layers.3.mlp.experts.7.up")."""
        names = set()
        for n, _ in self.named_parameters():
            if ".qkv_proj." in n:  # filled from three checkpoint tensors
                names |= {f"{n}.{part}" for part in "qkv"}
            elif not n.endswith((".w13", ".w2")):
                names.add(n)
        for i in sorted(self.spec.moe_layers):
            for e in set(self.model.layers[i].mlp.local_experts):
                names |= {_expert_piece(i, e, p) for p in ("gate", "up", "down")}
        return names

    def weight_bytes_by_kind(self) -> dict[str, int]:
        """Bytes the loaded weights take, by kind, read from the tensors themselves
        (parameters, persistent buffers and 4-bit expert copies; a tied lm_head counts once).

        Returns:
            experts: routed experts (float w13/w2, or the 4-bit weights with their scales);
            attention: q/k/v/o projections and q/k norms; embeddings: embed_tokens and
            lm_head; other: router gates, dense MLPs, layer norms and the rest (bytes).
        """
        sizes = dict.fromkeys(("experts", "attention", "embeddings", "other"), 0)
        tensors = list(self.named_parameters())
        for prefix, module in self.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    tensors.append((f"{prefix}.{name}", buf))
        for name, t in tensors:
            sizes[_weight_kind(name)] += t.numel() * t.element_size()
        for module in self.modules():
            if isinstance(module, FusedMoE) and module.quantized is not None:
                sizes["experts"] += module.quantized.nbytes
        return sizes

    def wants_weight(self, name: str) -> bool:
        """False for a per-expert checkpoint tensor of an expert this rank does not hold (the
        loader then never reads it); True for everything else."""
        if m := _EXPERT_ID.match(name):
            mlp = self.model.layers[int(m[1])].mlp
            return isinstance(mlp, FusedMoE) and bool(mlp.local_slots(int(m[2])))
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the pieces filled (names as in
        `expected_weight_names`).

        Raises:
            ValueError: an unexpected tensor name or a shape mismatch (names both shapes).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            loaded |= self._load_one(name, tensor, params)
        for module in self.modules():  # native kernels' packed copies are stale now
            if isinstance(module, Linear | FusedMoE):
                module.reset_packed()
        return loaded

    def _load_one(
        self, name: str, tensor: torch.Tensor | Int4Weight, params: dict
    ) -> set[str]:
        if isinstance(tensor, Int4Weight):  # a Linear stored int4 (`quant.compressed_tensors`)
            if m := _EXPERT.match(name):
                layer, expert, shard = int(m[1]), int(m[2]), _SHARD[m[3]]
                self.model.layers[layer].mlp.load_quantized_expert_weight(expert, shard, tensor)
                return {_expert_piece(layer, expert, shard)}
            # Only routed experts run in int4; any other Linear is dequantized exactly, in the
            # scale's dtype as compressed-tensors' own decompression does.
            tensor = dequantize_int4(*tensor, dtype=tensor.scales.dtype)
        if m := _EXPERT.match(name):
            layer, expert, proj = int(m[1]), int(m[2]), m[3]
            shard = _SHARD[proj]
            self.model.layers[layer].mlp.load_expert_weight(expert, shard, tensor)
            return {_expert_piece(layer, expert, shard)}
        if m := _FUSED_EXPERTS.match(name):
            layer, shard = int(m[1]), "gate_up" if m[2] == "gate_up_proj" else "down_all"
            self.model.layers[layer].mlp.load_expert_weight(0, shard, tensor)
            pieces = ("gate", "up") if shard == "gate_up" else ("down",)
            experts = self.model.layers[layer].mlp.local_experts
            return {_expert_piece(layer, e, p) for e in experts for p in pieces}
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        if m := _QKV.match(name):
            target = f"{m[1]}qkv_proj.{m[3]}"
            index = "qkv".index(m[2])
            attn = self.model.layers[int(name.split(".")[2])].self_attn
            start = sum(attn.sizes[:index])
            _copy(name, params[target].data[start : start + attn.sizes[index]], tensor)
            return {f"{target}.{m[2]}"}
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return set()
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        _copy(name, params[name].data, tensor)
        return {name}


def _weight_kind(name: str) -> str:
    """"experts", "attention", "embeddings" or "other" for a parameter or buffer name."""
    if name.endswith((".w13", ".w2", ".b13", ".b2")):
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return "embeddings"
    return "other"


def _expert_piece(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}"


def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
