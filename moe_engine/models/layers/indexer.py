"""The lightning indexer of DeepSeek Sparse Attention (DSA): which keys each query attends.

DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse
Attention" (2025), the "lightning indexer"; transformers 5.24 `DeepseekV32Indexer`
(models/deepseek_v32/modeling_deepseek_v32.py), whose float math this follows. Per layer,
with q_resid the attention's normalised compressed query (q_a_layernorm's output):

    q_j = wq_b(q_resid)[j]                   [heads, d]   (rope on the first rope dims)
    k_s = LayerNorm(wk(h_s))                 [d]          (rope likewise; one key per token)
    w_j = weights_proj(h_j) * heads^-0.5     [heads]      (float32)
    I(j, s) = sum_h w_j,h * ReLU(q_j,h . k_s * d^-0.5)   (float32)

and query j attends the `index_topk` visible keys s <= j of highest I(j, s) (all of them when
it sees fewer). The keys k_s are cached per token beside the MLA latent (the layer's second
cache tensor, `kv_cache.MLAAttentionSpec.index_head_dim`), written at the same slots. The
reference indexer's Hadamard rotation and FP8 scoring are skipped, as transformers skips them
(the rotation preserves dot products; FP8 is a precision optimisation): scores are float32.

Ties: transformers takes `torch.topk` over each query's row of keys; torch's order among equal
scores is unspecified and depends on the row's length, so a tie exactly at the top-k boundary
(possible only where ReLU zeroes a key's score for every head) may select another of the tied
keys than transformers does. Every other selection is the same set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.plan import KernelPlan
from moe_engine.models.layers.attention import AttentionBatch
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.rotary import RotaryEmbedding, apply_rotary

#: Bytes the float32 scores [B, rows, heads, keys] of one piece of a batch may take; longer
#: batches are scored a few query rows at a time (the selection is per row).
SCORE_BUDGET_BYTES = 64 << 20


class LightningIndexer(nn.Module):
    """The indexer's projections and its key cache write (names as transformers': `wq_b`,
    `wk`, `k_norm`, `weights_proj`, under the attention's `indexer.`).

    Args:
        hidden_size: H. q_lora_rank: width of q_resid.
        num_heads: indexer query heads (config.json `index_n_heads`).
        head_dim: d, their width and the key's (`index_head_dim`).
        rope_dim: leading dims of each query head and key that are roped
            (`qk_rope_head_dim`).
        index_topk: keys kept per query (`index_topk`).
        interleaved_rope: rope on interleaved pairs (GLM-5); False: rotate-half pairs
            (DeepSeek-V3.2, whose MLA rope is interleaved but whose indexer's is not).
        dtype: parameter dtype.

    Raises:
        ValueError: a size below 1, or rope_dim above head_dim.
    """

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        index_topk: int,
        interleaved_rope: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        sizes = dict(num_heads=num_heads, head_dim=head_dim, index_topk=index_topk,
                     q_lora_rank=q_lora_rank)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"LightningIndexer: {name} {value} must be >= 1")
        if not 0 <= rope_dim <= head_dim:
            raise ValueError(
                f"LightningIndexer: qk_rope_head_dim {rope_dim} must be in [0, index_head_dim "
                f"{head_dim}]"
            )
        self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
        self.index_topk, self.interleaved_rope = index_topk, interleaved_rope
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, bias=False, dtype=dtype)
        self.wk = Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(hidden_size, num_heads, bias=False, dtype=dtype)
        self.softmax_scale = head_dim**-0.5
        #: The registry's paged scoring kernel (`KernelPlan.indexer_scores`), None: torch.
        self.scores_kernel: Callable[..., torch.Tensor] | None = None

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's indexer scoring kernel (Triton where the MLA decode is)."""
        self.scores_kernel = plan.indexer_scores()

    def forward(
        self,
        h: torch.Tensor,
        q_resid: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        key_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project this step's tokens and write their keys into the cache.

        Args:
            h: [T, H] the layer's normed input; q_resid: [T, q_lora_rank].
            positions: [T] int64. rotary: the model's table (cos/sin rows by position).
            key_cache: [num_blocks + 1, block_size, d], written at `slot_mapping` ([T] int64).

        Returns:
            q [T, heads, d] (roped, h's dtype) and weights [T, heads] float32 (times
            heads^-0.5).
        """
        t, rope = h.shape[0], self.rope_dim
        cos = rotary.cos_cache[positions].to(h.dtype)  # [T, rope]
        sin = rotary.sin_cache[positions].to(h.dtype)
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        q = torch.cat([apply_rotary(q[..., :rope], cos[:, None], sin[:, None],
                                    self.interleaved_rope), q[..., rope:]], dim=-1)
        k = self.k_norm(self.wk(h))
        k = torch.cat([apply_rotary(k[:, :rope], cos, sin, self.interleaved_rope), k[:, rope:]],
                      dim=-1)
        key_cache.view(-1, self.head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
        weights = self.weights_proj(h).float() * self.num_heads**-0.5
        return q, weights

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor | None:
        """The keys each query of `batch` attends.

        Args:
            q: [N, heads, d], weights: [N, heads] float32: the batch's N tokens (`forward`).
            key_cache: [num_blocks + 1, block_size, d], this step's keys already written.

        Returns:
            [B, 1, Lq, nb * block_size] bool, True where the query attends the key (visible
            and among its `index_topk` best); None when no row can have more than index_topk
            keys (every visible key is kept: the causal mask; decided from the gathered width,
            a host int, so no device sync).
        """
        if batch.num_keys <= self.index_topk:
            return None
        visible = batch.mask[:, 0]  # [B, Lq, Lk]
        if self.scores_kernel is None:
            index = self._scores(q, weights, key_cache, batch)
        else:  # reads the keys in place through the block tables
            index = torch.full(visible.shape, float("-inf"), device=visible.device)
            index[batch.tok_b, batch.tok_q] = self.scores_kernel(
                q, weights, key_cache, batch.block_tables, batch.tok_b,
                batch.q_pos[batch.tok_b, batch.tok_q], batch.seq_lens, visible.shape[-1],
                self.softmax_scale,
            )  # fmt: skip
        index.masked_fill_(~visible, float("-inf"))
        top = index.topk(min(self.index_topk, visible.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return (chosen & visible).unsqueeze(1)

    def _scores(
        self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """The torch reference of the scores: [B, Lq, nb * block_size] float32 over the
        gathered keys (transformers' two matmuls, a few query rows at a time)."""
        b, heads, d = batch.seq_lens.shape[0], self.num_heads, self.head_dim
        keys = key_cache.view(key_cache.shape[0], -1).index_select(0, batch.block_ids)
        keys_t = keys.view(b, -1, d).float().transpose(1, 2).unsqueeze(1)  # [B, 1, d, Lk]
        q_pad = q.new_zeros(b, batch.max_q, heads, d, dtype=torch.float32)
        q_pad[batch.tok_b, batch.tok_q] = q.float()
        w_pad = weights.new_zeros(b, batch.max_q, 1, heads)
        w_pad[batch.tok_b, batch.tok_q, 0] = weights
        lk = keys_t.shape[-1]
        step = max(1, SCORE_BUDGET_BYTES // (4 * b * heads * lk))
        index = torch.empty(b, batch.max_q, lk, dtype=torch.float32, device=q.device)
        for r in range(0, batch.max_q, step):
            scores = F.relu(torch.matmul(q_pad[:, r : r + step], keys_t) * self.softmax_scale)
            index[:, r : r + step] = torch.matmul(w_pad[:, r : r + step], scores).squeeze(-2)
        return index
