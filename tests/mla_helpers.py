"""Shared pieces of the MLA tests: tiny DeepSeek-V2/V3 attention configs, the engine's
`MLAAttention` built beside transformers' module with the same weights, and the per-step
attention metadata the ModelRunner would build."""

from __future__ import annotations

import torch

from moe_engine.models.layers.attention import AttentionMetadata, build_attention_batch
from moe_engine.models.layers.mla import MLAAttention
from moe_engine.models.layers.rotary import RotaryEmbedding, YarnScaling

HIDDEN, HEADS = 64, 4
KV_LORA, ROPE, NOPE, V = 16, 8, 12, 10  # v differs from qk_head_dim on purpose
MAX_POS = 128  # = factor x original_max_position_embeddings, as YaRN configs state it
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1, mscale=0.8, mscale_all_dim=1.0)


def hf_config(family: str, q_lora_rank: int | None, yarn: bool, interleave: bool = True):
    """A transformers DeepseekV3Config / DeepseekV2Config with the tiny attention sizes."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    rope = dict(YARN) if yarn else dict(rope_type="default", rope_theta=10000.0)
    common = dict(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE, v_head_dim=V, max_position_embeddings=MAX_POS,
        num_hidden_layers=1, vocab_size=32, rope_parameters=rope, attention_bias=False,
    )
    if family == "v3":
        cfg = DeepseekV3Config(**common, rope_interleave=interleave)
    else:
        cfg = DeepseekV2Config(**common)
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg, seed: int = 0):
    """transformers' DeepseekV3Attention / DeepseekV2Attention with random float32 weights
    (norm weights too, so a wrong eps or layout shows)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    torch.manual_seed(seed)
    cls = DeepseekV3Attention if cfg.model_type == "deepseek_v3" else DeepseekV2Attention
    attn = cls(cfg, 0).float().eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "layernorm" not in name else 0.2) + (
                1.0 if "layernorm" in name else 0.0
            ))
            if "proj" in name and name.endswith("weight"):
                p.mul_(p.shape[-1] ** -0.5)
    return attn


def engine_attention(cfg, hf_module, absorb: bool = True) -> MLAAttention:
    """The engine's MLAAttention for `cfg`, with `hf_module`'s weights loaded by name."""
    params = dict(cfg.rope_parameters)
    yarn = None
    if params.get("rope_type") == "yarn":
        yarn = YarnScaling.from_rope_parameters(params, cfg.max_position_embeddings)
    interleaved = getattr(cfg, "rope_interleave", True)  # V2 always rotates pairs
    rotary = RotaryEmbedding(ROPE, MAX_POS, params["rope_theta"], yarn, interleaved=interleaved)
    mla = MLAAttention(
        HIDDEN, HEADS, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rotary=rotary,
        attention_bias=cfg.attention_bias, absorb=absorb,
    )
    mla.load_state_dict(hf_module.state_dict(), strict=True)
    return mla


def hf_reference(cfg, hf_module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' attention over one whole sequence: hidden [N, H] -> [N, H] (causal)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    n = hidden.shape[0]
    x = hidden[None]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        if cfg.model_type == "deepseek_v3":
            cos_sin = DeepseekV3RotaryEmbedding(cfg)(x, pos)
            out, _ = hf_module(x, position_embeddings=cos_sin, attention_mask=mask)
        else:
            freqs = DeepseekV2RotaryEmbedding(cfg)(x, pos)
            out, _ = hf_module(x, attention_mask=mask, position_embeddings=freqs)
    return out[0]


def step_metadata(
    rows: list[tuple[list[int], int, int]], block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(block_table, start, num_tokens) per request, decodes first, as ModelRunner orders them
    -> (positions [T], metadata) built as `ModelRunner._group_metadata` does."""
    q_lens = torch.tensor([r[2] for r in rows])
    starts = torch.tensor([r[1] for r in rows])
    width = max(len(r[0]) for r in rows)
    tables = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
    row = torch.repeat_interleave(torch.arange(len(rows)), q_lens)
    offsets = torch.cumsum(q_lens, 0) - q_lens
    positions = starts[row] + torch.arange(int(q_lens.sum())) - offsets[row]
    slots = tables[row, positions // block_size] * block_size + positions % block_size
    num_decodes = int((q_lens == 1).sum())
    assert bool((q_lens[:num_decodes] == 1).all()), "decodes must come first"
    batches = []
    for lo, hi in ((0, num_decodes), (num_decodes, len(rows))):
        if hi > lo:
            token_start = int(q_lens[:lo].sum())
            batches.append(build_attention_batch(
                token_start, q_lens[lo:hi], starts[lo:hi], tables[lo:hi], block_size
            ))
    return positions, AttentionMetadata(slot_mapping=slots, batches=batches)
