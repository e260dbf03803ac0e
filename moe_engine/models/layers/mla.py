"""Multi-head latent attention (MLA) over the paged KV cache (DeepSeek-V2/V3).

DeepSeek-V2 (Liu et al. 2024, arXiv:2405.04434) sec. 2.1, "low-rank key-value joint
compression": each token's keys and values come from one compressed latent
c_kv = RMSNorm(W_DKV h) of `kv_lora_rank` values (r) plus one decoupled, roped key k_pe of
`qk_rope_head_dim` values shared by all heads. Per head i,
k_i = [W_UK_i c_kv | k_pe] and v_i = W_UV_i c_kv, where `kv_b_proj` stacks W_UK_i [nope, r]
and W_UV_i [v, r] for every head. The cache holds only [c_kv | k_pe] per token and layer
(`kv_cache.MLAAttentionSpec`): 576 values for DeepSeek-V3 instead of 2 x 128 heads x 128.

Two ways to attend, chosen per query batch (models/layers/attention.py's batching: at most two
batched calls per layer and step, never a loop per request):
- Expanded (prefill chunks, and decode when `absorb` is off): the gathered latents go through
  `kv_b_proj` into per-head keys and values, then one `scaled_dot_product_attention` with the
  causal mask (a chunk's queries see the cached latents and the chunk's own).
- Absorbed (decode, q_len 1): as q_i . k_i = (W_UK_i^T q_nope_i) . c_kv + q_pe_i . k_pe, the
  query is moved into latent space once (q_lat_i = q_nope_i W_UK_i, [r]) and every head attends
  the one shared latent [c_kv | k_pe] directly (multi-query attention with head dim r + rope),
  with c_kv as the value; W_UV_i is applied to the r-dim output afterwards. No key or value is
  ever expanded: the per-step cost is O(context x (r + rope)) per head instead of
  O(context x r x heads x (nope + v)) for the expansion (DeepSeek-V2 sec. 2.1.2, "absorbed into
  W_Q / W_O"; vLLM `MLACommonImpl` / `_forward_decode` with `W_UK_T` and `W_UV`; SGLang's
  `forward_absorb`).

The parameter names are transformers' (`DeepseekV3Attention`, `DeepseekV2Attention` in
transformers 5.24), so checkpoints load by name, but for one: with a query LoRA (V2, V3) the two
down-projections of the hidden state, `q_a_proj` [q_lora_rank, H] and `kv_a_proj_with_mqa`
[r + rope, H], are the rows of one `MergedLinear` `fused_qkv_a_proj` (shards "q_a" and "kv_a",
vLLM's `fused_qkv_a_proj`), one GEMM per step instead of two; `MLA_STACKED` maps the
checkpoint's names onto it for loading and weight updates, and `load_state_dict` takes
transformers' state dicts as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.plan import KernelPlan
from moe_engine.kv_cache.spec import MLA_ATTENTION
from moe_engine.models.layers.attention import AttentionBatch, AttentionMetadata, KVCacheLayer
from moe_engine.models.layers.linear import Linear, MergedLinear
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding, yarn_softmax_scale_factor

#: The query and KV down-projections stacked into `fused_qkv_a_proj` (a `WeightMapping`'s
#: `stacked_params`: merged module, checkpoint module, shard id).
MLA_STACKED = (
    (".fused_qkv_a_proj.", ".q_a_proj.", "q_a"),
    (".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.", "kv_a"),
)


class MLAAttention(KVCacheLayer):
    """One MLA layer: projections, RoPE on the decoupled part, latent cache write, attention.

    Args:
        hidden_size: width of the residual stream (H).
        num_heads: query heads (n).
        q_lora_rank: width of the compressed query (q_a_proj -> q_a_layernorm -> q_b_proj);
            None: one direct q_proj (DeepSeek-V2-Lite).
        kv_lora_rank: width r of the compressed KV latent c_kv.
        qk_nope_head_dim, qk_rope_head_dim: per-head widths of the unroped and roped query/key
            parts (qk_head_dim is their sum); v_head_dim: per-head value width.
        rotary: RoPE over qk_rope_head_dim dims (shared by all layers), with
            `interleaved=True` for DeepSeek checkpoints (V3 `rope_interleave`, V2's complex
            form) and its YaRN scaling, if any (cos/sin carry YaRN's attention factor); None:
            no rotation at all (NoPE, Kimi-Linear's MLA layers: the qk_rope_head_dim part is
            still one key shared by the heads).
        attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj (as transformers;
            q_proj, q_b_proj and kv_b_proj never have one).
        norm_eps: epsilon of q_a_layernorm and kv_a_layernorm (transformers builds both with
            its RMSNorm default 1e-6, whatever `rms_norm_eps` says).
        softmax_scale: None: qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim)^2
            when the rotary has YaRN with `mscale_all_dim` (transformers `yarn_apply_mscale`).
        query_position_scaling: (beta, period): queries (both parts, after the rope) times
            1 + beta * log(1 + floor(position / period)) (Llama-4's attention temperature
            tuning as Mistral-4 applies it: transformers' `get_llama_4_attn_scale` with
            `rope_parameters` llama_4_scaling_beta and original_max_position_embeddings);
            None: none.
        latent_scale: multiplies c_kv after kv_a_layernorm (what the cache holds, so keys'
            unroped parts and values alike; LongCat-Flash's `mla_scale_kv_lora`,
            sqrt(hidden_size / kv_lora_rank)); 1.0: none. A query scale is a factor of
            `softmax_scale` (rope and dot products are linear in q).
        dtype: parameter dtype.
        absorb: decode with weight absorption (default); False runs the expanded path for
            decode too (the reference for tests, and the baseline of bench/mla.py). Also
            settable on the instance.
        output_gate: the query LoRA also yields a per-head output gate (A.X-K2's
            `q_gate_proj`): one `q_gate_proj` [2 q_lora_rank -> n x (qk_head_dim + v)] over
            [q_a_layernorm(q_a) | q_a] replaces q_b_proj, and the attention output is
            multiplied by sigmoid(gate) (float32) before o_proj.
        head_gate: a per-head output gate from the layer input, `g_proj` [H -> n]: the attention
            output of head i times sigmoid(g_proj(h)[i]) (float32, rounded once) before o_proj
            (dots3's `g_proj`; transformers `BailingHybridAttention` rounds the sigmoid to the
            model dtype first: equal in float32); excludes `output_gate`.
        rope_key_norm: an RMSNorm (`k_pe_norm`, epsilon `norm_eps`) over the shared k_pe
            before its rope (dots3's `k_rope_only_layernorm`); the cache holds the normed,
            roped k_pe. Runs the module path, not the fused MLA prologue.

    Raises:
        ValueError: a non-positive size, rotary over other than qk_rope_head_dim dims, or an
            output gate without a query LoRA.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: RotaryEmbedding | None,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        softmax_scale: float | None = None,
        query_position_scaling: tuple[float, int] | None = None,
        latent_scale: float = 1.0,
        dtype: torch.dtype = torch.float32,
        absorb: bool = True,
        output_gate: bool = False,
        head_gate: bool = False,
        rope_key_norm: bool = False,
    ) -> None:
        super().__init__()
        sizes = dict(hidden_size=hidden_size, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                     v_head_dim=v_head_dim, q_lora_rank=q_lora_rank or 1)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"MLAAttention: {name} {value} must be >= 1")
        if rotary is not None and rotary.head_dim != qk_rope_head_dim:
            raise ValueError(
                f"MLAAttention: rotary rotates {rotary.head_dim} dims, but qk_rope_head_dim is "
                f"{qk_rope_head_dim}"
            )
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        if output_gate and q_lora_rank is None:
            raise ValueError("MLAAttention: an output gate needs q_lora_rank (a query LoRA)")
        if output_gate and head_gate:
            raise ValueError("MLAAttention: output_gate and head_gate exclude each other")
        self.output_gate = output_gate
        self.g_proj = Linear(hidden_size, num_heads, bias=False, dtype=dtype) if head_gate else None
        self.k_pe_norm = (RMSNorm(qk_rope_head_dim, norm_eps, dtype=dtype) if rope_key_norm
                          else None)
        q_out = num_heads * self.qk_head_dim
        kv_a_rows = kv_lora_rank + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_out, bias=False, dtype=dtype)
            self.kv_a_proj_with_mqa = Linear(hidden_size, kv_a_rows, attention_bias, dtype=dtype)
        else:  # q_a_proj and kv_a_proj_with_mqa as one GEMM (rows: q_a, then kv_a)
            self.fused_qkv_a_proj = MergedLinear(
                hidden_size, {"q_a": q_lora_rank, "kv_a": kv_a_rows}, bias=attention_bias,
                dtype=dtype,
            )
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, dtype=dtype)
            if output_gate:
                gate_out = num_heads * (self.qk_head_dim + v_head_dim)
                self.q_gate_proj = Linear(2 * q_lora_rank, gate_out, bias=False, dtype=dtype)
            else:
                self.q_b_proj = Linear(q_lora_rank, q_out, bias=False, dtype=dtype)
            self._register_load_state_dict_pre_hook(_stack_qkv_a)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, dtype=dtype
        )
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias, dtype=dtype)
        self.rotary = rotary
        if softmax_scale is None:
            yarn = rotary.yarn if rotary is not None else None
            softmax_scale = self.qk_head_dim**-0.5 * yarn_softmax_scale_factor(yarn)
        self.scale = softmax_scale
        self.latent_scale = latent_scale
        self.query_position_scaling = query_position_scaling
        self.absorb = absorb
        self._w_uk: torch.Tensor | None = None  # [n, nope, r]
        self._w_uv: torch.Tensor | None = None  # [n, r, v]
        self._absorbed_key: tuple | None = None  # which kv_b_proj weight they came from
        #: The registry's absorbed decode kernel (`bind_kernels`), None: the torch path.
        self.decode_kernel: Any = None
        #: The registry's one-call prologue (`KernelPlan.mla_rope_prologue`: kv_a_layernorm,
        #: rope of k_pe and q_pe, the latent-cache write), None: the module path.
        self.prologue: Any = None
        self._pad_values = False  # torch prefill on a CPU: values padded to the keys' width

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's "mla_decode" backend (absorbed decode; prefill chunks stay on
        the torch expanded path) and its MLA prologue where this layer's pieces fit it (a
        `RotaryEmbedding`; a `kv_a_layernorm` of Qwen3-style rounding in the weights' dtype)."""
        self.decode_kernel = plan.mla_decode()
        self._pad_values = plan.device == "cpu"
        norm = self.kv_a_layernorm
        fits = (type(self.rotary) is RotaryEmbedding and type(norm) is RMSNorm
                and self.k_pe_norm is None and not norm.weight_in_float32
                and norm.weight.dtype == self._kv_a_weight_dtype())
        self.prologue = plan.mla_rope_prologue() if fits else None
        if self.absorb and not self.kv_b_proj.weight.is_meta:  # bound after loading: split
            self.process_weights_after_loading()  # W_UK/W_UV now, not in the first decode step

    def _kv_a_weight_dtype(self) -> torch.dtype:
        """The dtype of the weight that computes kv_a (alone, or stacked under q_a)."""
        proj = self.kv_a_proj_with_mqa if self.q_lora_rank is None else self.fused_qkv_a_proj
        return proj.weight.dtype

    @property
    def cache_kind(self) -> str:
        return MLA_ATTENTION

    @property
    def latent_dim(self) -> int:
        """Cache values per token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj's weight [n x (nope + v), r] into W_UK [n, nope, r] and W_UV
        [n, r, v] for absorbed decode (vLLM `MLACommonImpl.process_weights_after_loading`).
        Called at bind time (after loading) and by an absorbed decode whenever the weight was
        replaced or changed in place since (a reload never serves stale weights)."""
        weight = self.kv_b_proj.weight.detach()
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        self._w_uk = w[:, : self.qk_nope_head_dim].contiguous()
        self._w_uv = w[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous()
        self._absorbed_key = self._weight_key()

    def _weight_key(self) -> tuple:
        weight = self.kv_b_proj.weight
        try:
            version = weight._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter
            version = None
        return (id(weight), weight.data_ptr(), version, weight.dtype)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """h: [T, H], positions: [T] int64; kv_cache: this layer's [num_blocks + 1,
        block_size, kv_lora_rank + qk_rope_head_dim] latent tensor (written at the group's
        slot_mapping). Returns [T, H] in h's dtype."""
        meta = meta.for_group(self.kv_group)
        q_nope, q_pe, _, gate = self.project_and_cache(h, positions, meta, kv_cache)
        return self.attend_batches(h, q_nope, q_pe, kv_cache, meta, gate=gate)

    def project_and_cache(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The queries, with this step's latents written into `kv_cache` at
        `meta.slot_mapping` (`meta` the layer's group's).

        Returns:
            q_nope [T, n, nope], q_pe [T, n, rope] (roped); q_resid [T, q_lora_rank], the
            normalised compressed query (q_a_layernorm's output; None without a query LoRA);
            the output gate's logits [T, n x v] (None without `output_gate` / `head_gate`).
        """
        t, n = h.shape[0], self.num_heads
        q_resid = gate = None
        if self.q_lora_rank is None:
            q, kv_a = self.q_proj(h), self.kv_a_proj_with_mqa(h)
        else:  # views of the one GEMM's output [T, q_lora_rank + r + rope], no copy
            q_a, kv_a = self.fused_qkv_a_proj(h).split([self.q_lora_rank, self.latent_dim], -1)
            q_resid = self.q_a_layernorm(q_a)
            if self.output_gate:
                qg = self.q_gate_proj(torch.cat([q_resid, q_a], dim=-1)).view(t, n, -1)
                q, gate = qg.split([self.qk_head_dim, self.v_head_dim], dim=-1)
                gate = gate.reshape(t, n * self.v_head_dim)
            else:
                q = self.q_b_proj(q_resid)
        if self.g_proj is not None:  # [T, n] -> [T, n x v]: one logit per head's v values
            gate = self.g_proj(h)[:, :, None].expand(t, n, self.v_head_dim).reshape(t, -1)
        q_nope, q_pe = q.reshape(t, n, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        if self.prologue is not None and kv_a.dtype == kv_cache.dtype:
            norm_weight = self.kv_a_layernorm.weight
            if self.latent_scale != 1.0:  # [r] values: the scale rides on the norm's weight
                norm_weight = norm_weight * self.latent_scale
            q_pe = self.prologue(
                kv_a, q_pe, positions, self.rotary.cos_cache, self.rotary.sin_cache,
                norm_weight, self.kv_a_layernorm.eps, kv_cache, meta.slot_mapping,
                self.rotary.interleaved,
            )  # fmt: skip
        else:
            c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            if self.k_pe_norm is not None:
                k_pe = self.k_pe_norm(k_pe)
            if self.rotary is not None:  # None: NoPE (the rope part shared but not rotated)
                q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
                k_pe = k_pe.squeeze(1)
            c_kv = self.kv_a_layernorm(c_kv)
            if self.latent_scale != 1.0:
                c_kv = c_kv * self.latent_scale
            latent = torch.cat([c_kv, k_pe], dim=-1)
            kv_cache.view(-1, self.latent_dim).index_copy_(
                0, meta.slot_mapping, latent.to(kv_cache.dtype)
            )
        if self.query_position_scaling is not None:
            scale = position_query_scale(positions, *self.query_position_scaling)
            scale = scale.to(q_nope.dtype)[:, None, None]
            q_nope, q_pe = q_nope * scale, q_pe * scale
        return q_nope, q_pe, q_resid, gate

    def attend_batches(
        self,
        h: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        masks: list[torch.Tensor | None] | None = None,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every query batch of `meta` (the layer's group's), then o_proj ->
        [T, H]. `masks`: per batch, a bool mask that replaces the batch's causal one (a sparse
        selection, `layers/sparse_mla.py`): [B, 1, Lq, Lk] for a prefill batch, [B, 1, 1, Lk]
        for a decode batch; None: causal. `gate`: [T, n x v] output-gate logits
        (`project_and_cache`), the output times sigmoid(gate) before o_proj."""
        t, n = h.shape[0], self.num_heads
        masks = masks or [None] * len(meta.batches)
        if len(meta.batches) == 1 and (meta.batches[0].token_start, meta.batches[0].token_end) == (
            0, t
        ):  # one batch (a decode step): its output is the layer's, no copy into a buffer
            out = self._attend(q_nope, q_pe, kv_cache, meta.batches[0], masks[0])
        else:
            out = h.new_empty(t, n * self.v_head_dim)
            for batch, mask in zip(meta.batches, masks, strict=True):
                rows = slice(batch.token_start, batch.token_end)
                out[rows] = self._attend(q_nope[rows], q_pe[rows], kv_cache, batch, mask)
        if gate is not None:
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.o_proj(out)

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query batch: q_nope [N, n, nope], q_pe [N, n, rope] -> [N, n x v], absorbed for
        decodes (when `absorb`), else expanded; `mask` as `attend_batches`'."""
        if batch.max_q == 1 and self.absorb:
            return self._decode_absorbed(q_nope, q_pe, cache, batch, mask)
        return self._attend_expanded(q_nope, q_pe, cache, batch, mask)

    def _attend_expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope: [N, n, nope], q_pe: [N, n, rope] (the batch's N tokens) -> [N, n x v]: the
        gathered latents expanded through kv_b_proj into per-head keys and values."""
        b, n, nope = batch.seq_lens.shape[0], self.num_heads, self.qk_nope_head_dim
        c_kv, k_pe = _gather_latent(cache, batch.block_ids, b).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        keys_len = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv.to(q_nope.dtype)).view(b, keys_len, n, nope + self.v_head_dim)
        k_nope, values = kv.transpose(1, 2).split([nope, self.v_head_dim], dim=-1)
        k_rope = k_pe.to(q_pe.dtype)[:, None].expand(b, n, keys_len, self.qk_rope_head_dim)
        keys = torch.cat([k_nope, k_rope], dim=-1)  # [B, n, Lk, qk_head_dim]
        q_pad = q_nope.new_zeros(b, batch.max_q, n, self.qk_head_dim)
        q_pad[batch.tok_b, batch.tok_q] = torch.cat([q_nope, q_pe], dim=-1)
        mask = batch.mask if mask is None else mask
        o = _sdpa(q_pad.transpose(1, 2), keys, values, mask, self.scale, self._pad_values)
        return o.transpose(1, 2)[batch.tok_b, batch.tok_q].reshape(-1, n * self.v_head_dim)

    def _decode_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per request: q_nope [B, n, nope], q_pe [B, n, rope] -> [B, n x v].

        q_lat = q_nope W_UK ([B, n, r]); scores = ([q_lat | q_pe] . [c_kv | k_pe]) x scale
        over the gathered latents, the n heads as the query rows of one latent head;
        o_lat = softmax(scores) c_kv; out = o_lat W_UV. A `mask` ([B, 1, 1, Lk], a sparse
        selection) runs the torch path: the decode kernel reads whole contexts."""
        if self._absorbed_key != self._weight_key():
            self.process_weights_after_loading()
        b, r = q_nope.shape[0], self.kv_lora_rank
        q_lat = torch.bmm(q_nope.transpose(0, 1), self._w_uk)  # [n, B, r]
        if self.decode_kernel is not None and mask is None:  # reads the latents in place
            o = self.decode_kernel(
                q_lat.transpose(0, 1), cache, batch.block_tables, batch.seq_lens,
                scale=self.scale, kv_lora_rank=r, q_rope=q_pe,
            )  # [B, n, r], the query's two parts read where they are (no concatenation)
            out = q_lat.new_empty(b, self.num_heads, self.v_head_dim)
            torch.bmm(o.transpose(0, 1), self._w_uv, out=out.transpose(0, 1))  # [n, B, v]
            return out.view(b, self.num_heads * self.v_head_dim)
        query = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [B, n, r + rope]
        latent = _gather_latent(cache, batch.block_ids, b).to(query.dtype)[:, None]
        # The whole latent serves as the value too (equal q/k/v widths keep SDPA on its fused
        # kernel on a CPU, 3x the unfused one at 4k context); its first r output columns are
        # softmax(scores) @ c_kv (FlashMLA reads V as the first r columns of K the same way).
        o_lat = F.scaled_dot_product_attention(
            query.unsqueeze(1), latent, latent,
            attn_mask=batch.mask if mask is None else mask,  # [B, 1, 1, Lk], for every head
            scale=self.scale,
        )[..., :r]  # [B, 1, n, r]
        out = torch.bmm(o_lat.squeeze(1).transpose(0, 1), self._w_uv)  # [n, B, v]
        return out.transpose(0, 1).reshape(b, self.num_heads * self.v_head_dim)


def position_query_scale(positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    """positions [T] int64 -> [T] float32: 1 + beta * log(1 + floor(position / period))
    (transformers' `get_llama_4_attn_scale`, the same float32 ops)."""
    return 1 + beta * torch.log(1 + torch.floor(positions / period))


def _stack_qkv_a(state_dict: dict, prefix: str, *args: Any) -> None:
    """`load_state_dict` pre-hook of an MLA layer with a query LoRA: a state dict with
    transformers' names (`q_a_proj.weight`, `kv_a_proj_with_mqa.weight`, and their biases)
    has them stacked, in place, into `fused_qkv_a_proj.*` (rows q_a, then kv_a); a state dict
    of this module's own names passes through."""
    for kind in ("weight", "bias"):
        q_a, kv_a = f"{prefix}q_a_proj.{kind}", f"{prefix}kv_a_proj_with_mqa.{kind}"
        if q_a in state_dict and kv_a in state_dict:
            rows = [state_dict.pop(q_a), state_dict.pop(kv_a)]
            state_dict[f"{prefix}fused_qkv_a_proj.{kind}"] = torch.cat(rows)


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    pad_values: bool,
) -> torch.Tensor:
    """`scaled_dot_product_attention` of q, keys [B, n, L, qk_head_dim] and values [B, n, Lk,
    v_head_dim] -> [B, n, Lq, v_head_dim]. With `pad_values` (on a CPU), values narrower than
    the keys are zero-padded to their width (and the output cut back): the fused CPU kernel
    takes only equal widths, and is 1.5x the unfused one on a 512-query chunk over 4k keys even
    with the padding."""
    pad = keys.shape[-1] - values.shape[-1]
    if not pad_values or pad <= 0:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    values = F.pad(values, (0, pad))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out[..., : out.shape[-1] - pad]


def _gather_latent(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, L]; block_ids: [rows * nb] -> [rows, nb * block_size, L]
    (whole blocks copied as contiguous rows, as attention.py's `_gather_blocks`)."""
    num_blocks, _, dim = cache.shape
    flat = cache.view(num_blocks, -1).index_select(0, block_ids)
    return flat.view(rows, -1, dim)
