"""A multi-token-prediction (MTP) layer: DeepSeek-V3's "next-n" module (DeepSeek-AI,
"DeepSeek-V3 Technical Report", arXiv:2412.19437, sec. 2.2), also GLM-4.5's.

At position i it combines the main model's final hidden state h_i with the embedding of the
next token t_{i+1} and predicts t_{i+2}:

    x_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])       (embedding first, as vLLM and
    h'_i = DecoderLayer(x_i)                                   SGLang load the checkpoints)
    logits_i = lm_head(shared_head.norm(h'_i))

The decoder block is the architecture's own (attention with its own KV cache, an MoE or dense
MLP). The embedding and the LM head are the main model's (the checkpoints' per-layer copies
`embed_tokens` and `shared_head.head` are the same tensors and are not read). Chained drafts
feed h'_i back in place of h (vLLM's `DeepSeekMTP`).

Checkpoint names: `model.layers.{num_hidden_layers + j}.{enorm, hnorm, eh_proj,
shared_head.norm, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm}`, loaded into
`mtp_layers.{j}.*` (`weight_mapping.mtp_model_name`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine.models.layers.attention import AttentionMetadata
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.linear import Linear


class SharedHead(nn.Module):
    """The MTP layer's own final norm (`shared_head.norm`) before the shared LM head."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


class MTPLayer(DecoderLayer):
    """A `DecoderLayer` with the MTP input projection and its own output norm.

    Args:
        self_attn, mlp, input_layernorm, post_attention_layernorm: the decoder block's modules
            (as `DecoderLayer`); enorm, hnorm, head_norm: norms over hidden_size features.
        hidden_size: H; dtype: parameter dtype.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
        *,
        enorm: nn.Module,
        hnorm: nn.Module,
        head_norm: nn.Module,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(self_attn, mlp, input_layernorm, post_attention_layernorm)
        self.enorm = enorm
        self.hnorm = hnorm
        self.eh_proj = Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.shared_head = SharedHead(head_norm)

    def predict(
        self,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
    ) -> torch.Tensor:
        """One MTP pass.

        Args:
            embeds: [T, H] the embeddings of each position's next token t_{i+1}.
            previous_hidden: [T, H] the main model's final (normed) hidden state at each
                position, or this layer's output there for a chained draft.
            positions: [T] int64; meta: attention metadata over this layer's KV cache (the
                same block tables and slots as the main model's full-attention group).

        Returns:
            [T, H] h' (before `shared_head.norm`).
        """
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        return self.forward(x, positions, meta, kv_cache)
