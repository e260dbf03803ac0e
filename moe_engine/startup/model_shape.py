"""`ModelShape`: the sizes of a model that the startup arithmetic (`moe_engine.startup.plan`) needs,
read from config.json alone by the architecture's file (`moe_engine.models`), before any
weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_engine.kv_cache.spec import (
    CHUNKED_LOCAL_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MLA_ATTENTION,
    SLIDING_ATTENTION,
    AttentionGroup,
)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only MoE model, as config.json states them.

    Attributes:
        architecture: config.json "architectures"[0], e.g. "Qwen3MoeForCausalLM".
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream (H).
        num_layers: decoder layers.
        num_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (grouped-query attention).
        head_dim: dims per head.
        num_experts: routed experts per MoE layer (E).
        top_k: experts each token is routed to.
        moe_intermediate_size: width of one expert's gate/up projection (I).
        intermediate_size: width of the dense MLP of non-MoE layers (0 when every layer is MoE).
        moe_layers: indices of the layers whose MLP is an MoE block.
        tie_word_embeddings: lm_head shares the embedding matrix.
        max_position_embeddings: longest context the model was built for (tokens).
        attention_bias: q/k/v/o projections have biases.
        o_proj_bias: the output projection has a bias; None: as `attention_bias` (False for
            q/k/v biases only: GLM-4.5, Qwen2-MoE).
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        norm_topk_prob: top-k routing weights are renormalised to sum to 1.
        layer_types: per layer "full_attention" or "sliding_attention" (gpt-oss); empty means
            every layer is full attention.
        sliding_window: tokens a sliding-attention query sees, itself included (None: no
            sliding layers).
        attention_chunk_size: tokens per chunk of the chunked local attention layers
            (`layer_types` "chunked_attention", Llama 4); None: no such layers.
        attention_sinks: one learned sink logit per query head and layer (gpt-oss).
        router_bias: the router Linear has a bias (gpt-oss).
        expert_bias: each expert has gate/up [2I] and down [H] biases (gpt-oss).
        kv_lora_rank: multi-head latent attention (DeepSeek-V2/V3) when set: width of the
            compressed KV latent c_kv; None: GQA as num_kv_heads / head_dim say.
        q_lora_rank: MLA query compression width (q_a_proj -> q_b_proj); None: direct q_proj.
        qk_rope_head_dim, qk_nope_head_dim, v_head_dim: MLA per-head widths of the roped and
            unroped query/key parts and of the values (0 unless MLA).
        shared_expert_intermediate_size: width of each MoE layer's shared-expert MLP (one
            SwiGLU of gate/up/down, `moe_intermediate_size * n_shared_experts` for GLM-4.5 and
            DeepSeek, `shared_expert_intermediate_size` for Qwen2-MoE); 0: none. Shared experts
            are replicated on every rank, so they count as non-expert weights.
        shared_expert_gate: the shared experts' output is scaled by sigmoid(Linear(H, 1))
            (Qwen2-MoE's `shared_expert_gate`).
        router_correction_bias: each MoE router has an `e_score_correction_bias` [E].
        router_float32: the router weight (and correction bias) are float32 whatever the model
            dtype (transformers' `_keep_in_fp32_modules_strict`: GLM-4.5, DeepSeek-V3).
        attn_output_gate: q_proj also yields a per-head gate, the attention output times
            sigmoid(gate) (Qwen3-Next's gated attention: q_proj [H -> 2 x heads x D]).
        attn_head_gate: one gate per head, g_proj [H -> heads], the attention output of each
            head times sigmoid(gate) (Bailing-hybrid's MLA).
        index_n_heads, index_head_dim: DeepSeek Sparse Attention's lightning indexer in every
            MLA layer (DeepSeek-V3.2, GLM-5): its query heads and their width, which is also
            the width of the indexer key each token leaves in the cache; 0 without one.
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
        linear_value_head_dim, linear_conv_kernel_dim: the Gated DeltaNet layers (layer_types
            "linear_attention"; Qwen3-Next): q/k heads Hk of Dk dims, value heads Hv of Dv,
            the causal conv1d's width W; 0 without such layers.
        zero_experts: zero-computation ("identity") experts each router scores beside the E
            real ones (LongCat-Flash's `zero_expert_num`): router rows, no weights.
        dense_mlp_in_moe_layers: every layer holds a dense MLP of `intermediate_size`, the MoE
            layers too (LongCat-Flash's shortcut MoE sits beside the layer's MLP).
        linear_mixer: the name of the linear layers' mixer, for messages ("Gated DeltaNet",
            "short convolution", "lightning attention", "Kimi Delta Attention").
        linear_state: one linear layer's per-request state shapes (conv state or None,
            recurrent state or None), stated by an architecture whose linear layers are not
            Gated DeltaNet (`linear_state_shapes`); None: Gated DeltaNet's, from the fields
            above.
        linear_mixer_params: parameters of one linear layer when the architecture states them
            (its mixer is not Gated DeltaNet); None: `linear_attention_params`' count.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False
    norm_topk_prob: bool = True
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_sinks: bool = False
    attention_chunk_size: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    o_proj_bias: bool | None = None
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_correction_bias: bool = False
    router_float32: bool = False
    attn_output_gate: bool = False
    attn_head_gate: bool = False
    index_n_heads: int = 0
    index_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    zero_experts: int = 0
    dense_mlp_in_moe_layers: bool = False
    linear_mixer: str = "Gated DeltaNet"
    linear_state: tuple[tuple[int, ...] | None, tuple[int, ...] | None] | None = None
    linear_mixer_params: int | None = None

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP."""
        if self.dense_mlp_in_moe_layers:
            return self.num_layers
        return self.num_layers - len(self.moe_layers)

    def expert_params(self) -> int:
        """Parameters of all routed experts' weights: E x 3 x H x I per MoE layer (gate, up,
        down); biases are `expert_bias_params`."""
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size
        return len(self.moe_layers) * self.num_experts * per_expert

    def expert_bias_params(self) -> int:
        """Parameters of the routed experts' biases: E x (2I + H) per MoE layer when the
        experts have biases (gpt-oss; kept in the model dtype when the weights are 4-bit)."""
        if not self.expert_bias:
            return 0
        per_expert = 2 * self.moe_intermediate_size + self.hidden_size
        return len(self.moe_layers) * self.num_experts * per_expert

    def other_params(self) -> int:
        """Every parameter that is not a routed expert (attention, router, shared experts,
        dense MLPs, norms, embeddings, lm_head)."""
        h = self.hidden_size
        linear = len(self.linear_attention_layers())
        mixers = (self.num_layers - linear) * self.attention_params()
        mixers += linear * self.linear_attention_params()
        shared = 3 * h * self.shared_expert_intermediate_size
        if self.shared_expert_gate:
            shared += h
        dense_mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (
            mixers
            + self.num_layers * 2 * h  # input and post-attention RMSNorm
            + len(self.moe_layers) * (self.router_params() + shared)
            + self.num_dense_layers * dense_mlp
            + embeddings
            + h  # final norm
        )

    def dense_projection_params(self) -> int:
        """An upper bound on the parameters `--quantized-layers all` gives a 4-bit copy: every
        non-expert parameter but the norms, the routers and the input embedding (the LM head
        counts, tied or not; the few kept in float, such as MLA's kv_b_proj, biases and q/k
        norms, are included, so the bound is a little high)."""
        h = self.hidden_size
        norms = self.num_layers * 2 * h + h
        routers = len(self.moe_layers) * self.router_params()
        lm_head = self.vocab_size * h if self.tie_word_embeddings else 0
        return self.other_params() - norms - routers - self.vocab_size * h + lm_head

    def router_params(self) -> int:
        """Parameters of one MoE layer's router: weight [E, H], optional bias [E] and
        `e_score_correction_bias` [E] (E plus the zero-computation experts it scores)."""
        extra = int(self.router_bias) + int(self.router_correction_bias)
        return (self.num_experts + self.zero_experts) * (self.hidden_size + extra)

    def float32_params(self) -> int:
        """Parameters kept in float32 whatever the model dtype: the routers when
        `router_float32` (they are part of `other_params`)."""
        return len(self.moe_layers) * self.router_params() if self.router_float32 else 0

    def attention_params(self) -> int:
        """Parameters of one layer's attention block. GQA: q/k/v/o projections (+ biases, q/k
        norms, sinks). MLA (kv_lora_rank set; transformers `DeepseekV3Attention`): q_proj
        [H -> heads x qk_head_dim] or q_a_proj [H -> q_lora_rank] + q_a_layernorm + q_b_proj;
        kv_a_proj_with_mqa [H -> kv_lora_rank + rope], kv_a_layernorm [kv_lora_rank],
        kv_b_proj [kv_lora_rank -> heads x (nope + v)], o_proj [heads x v -> H]; with
        attention_bias, biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""
        h, n = self.hidden_size, self.num_heads
        if self.kv_lora_rank:
            r, ql, rope = self.kv_lora_rank, self.q_lora_rank, self.qk_rope_head_dim
            q_out = n * (self.qk_nope_head_dim + rope)
            q = ql * (h + 1 + q_out) if ql else h * q_out
            if ql and self.attn_output_gate:  # q_gate_proj [2 ql -> n x (qk + v)] (A.X-K2)
                q = ql * (h + 1) + 2 * ql * (q_out + n * self.v_head_dim)
            kv = h * (r + rope) + r + r * n * (self.qk_nope_head_dim + self.v_head_dim)
            bias = (ql or 0) + r + rope + h if self.attention_bias else 0
            head_gate = h * n if self.attn_head_gate else 0
            return q + kv + n * self.v_head_dim * h + bias + head_gate + self.indexer_params()
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + (h * q if self.attn_output_gate else 0)
        if self.attention_bias:
            attention += q + 2 * kv
        if self.attention_bias if self.o_proj_bias is None else self.o_proj_bias:
            attention += h
        if self.qk_norm:
            attention += 2 * self.head_dim
        if self.attention_sinks:
            attention += n
        if self.attn_head_gate:
            attention += h * n
        return attention

    def indexer_params(self) -> int:
        """Parameters of one layer's lightning indexer (transformers `DeepseekV32Indexer`):
        wq_b [q_lora_rank -> heads x d], wk [H -> d], k_norm (LayerNorm) [d] x 2,
        weights_proj [H -> heads]; 0 without one."""
        heads, d = self.index_n_heads, self.index_head_dim
        if not d:
            return 0
        return (self.q_lora_rank or 0) * heads * d + self.hidden_size * (d + heads) + 2 * d

    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (`layer_types` "linear_attention")."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def linear_conv_channels(self) -> int:
        """C = 2 Hk Dk + Hv Dv: the channels of a linear layer's causal conv1d (q, k, v)."""
        k = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * k + self.linear_num_value_heads * self.linear_value_head_dim

    def linear_attention_params(self) -> int:
        """Parameters of one Gated DeltaNet layer (transformers `Qwen3NextGatedDeltaNet`):
        in_proj_qkvz [H -> 2 Hk Dk + 2 Hv Dv], in_proj_ba [H -> 2 Hv], conv1d [C, W],
        dt_bias and A_log [Hv], the gated norm [Dv], out_proj [Hv Dv -> H]; or
        `linear_mixer_params` where the architecture states them."""
        if self.linear_mixer_params is not None:
            return self.linear_mixer_params
        h, hv, dv = self.hidden_size, self.linear_num_value_heads, self.linear_value_head_dim
        c = self.linear_conv_channels()
        qkvz = h * (c + hv * dv)
        return qkvz + h * 2 * hv + c * self.linear_conv_kernel_dim + 2 * hv + dv + hv * dv * h

    def linear_state_shapes(self) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """One linear layer's per-request state: the conv state [C, W - 1] (the last W - 1
        inputs) and the recurrent state [Hv, Dk, Dv] of Gated DeltaNet, or `linear_state`
        where the architecture states it (None for a part its mixer lacks)."""
        if self.linear_state is not None:
            return self.linear_state
        conv = (self.linear_conv_channels(), self.linear_conv_kernel_dim - 1)
        hv, dk = self.linear_num_value_heads, self.linear_key_head_dim
        return conv, (hv, dk, self.linear_value_head_dim)

    def kv_elements_per_token(self) -> int:
        """Values one token leaves in the cache over all attention layers: 2 x L x kv_heads x d
        (K and V), or L x (kv_lora_rank + qk_rope_head_dim + index_head_dim) for MLA (the
        latent and any indexer key); linear layers keep a fixed state instead
        (`linear_state_shapes`)."""
        if self.kv_lora_rank:
            return self.num_layers * (
                self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim
            )
        layers = self.num_layers - len(self.linear_attention_layers())
        if self.kv_lora_rank:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * layers * self.num_kv_heads * self.head_dim

    def attention_groups(self) -> list[AttentionGroup]:
        """The layers by attention kind, full attention first: (kind, the sliding window or
        the chunk size of chunked layers or None, layer indices), one entry per kind present
        (`layer_types`; all full when empty); one "mla" group of every layer but the linear ones
        when kv_lora_rank is set."""
        if self.kv_lora_rank:
            linear = set(self.linear_attention_layers())
            layers = tuple(i for i in range(self.num_layers) if i not in linear)
            return [(MLA_ATTENTION, None, layers)]
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        windows = {FULL_ATTENTION: None, SLIDING_ATTENTION: self.sliding_window,
                   CHUNKED_LOCAL_ATTENTION: self.attention_chunk_size}
        groups: list[AttentionGroup] = []
        for kind, window in windows.items():
            layers = tuple(i for i, t in enumerate(types) if t == kind)
            if layers:
                groups.append((kind, window, layers))
        return groups
