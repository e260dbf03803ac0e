"""The MLA latent KV cache: `MLAAttentionSpec` arithmetic, "mla" groups, the startup plan's
bytes per token (DeepSeek-V3's published shape: 61 x 576 x 2 = 70,272 B at bf16), MLA
attention parameter counts against transformers, and the ModelRunner's latent tensors end to
end through the scheduler with chunked prefill and prefix-cache hits on latent blocks."""

from __future__ import annotations

import pytest
import torch
from mla_helpers import HEADS, HIDDEN, KV_LORA, MAX_POS, NOPE, ROPE, V, hf_config
from torch import nn

from moe_engine.kv_cache import (
    FULL_ATTENTION,
    MLA_ATTENTION,
    KVCacheManager,
    MLAAttentionSpec,
    make_kv_cache_groups,
)
from moe_engine.models import model_shape
from moe_engine.models.layers.attention import PagedAttention
from moe_engine.models.layers.mla import MLAAttention
from moe_engine.models.layers.rotary import RotaryEmbedding
from moe_engine.request import Request
from moe_engine.runner.model_runner import ModelRunner
from moe_engine.runner.sampler import Sampler
from moe_engine.sampling_params import SamplingParams
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig
from moe_engine.startup.model_shape import ModelShape
from moe_engine.startup.plan import make_plan

#: DeepSeek-V3's config.json (huggingface.co/deepseek-ai/DeepSeek-V3), the fields read here.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "vocab_size": 129280,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 163840, "attention_bias": False,
    "tie_word_embeddings": False,
}
BS = 4


def test_mla_spec_bytes_are_the_latent_only():
    spec = MLAAttentionSpec.make(16, 512, 64, torch.bfloat16, 61)
    assert (spec.kind, spec.sliding_window, spec.latent_dim) == (MLA_ATTENTION, None, 576)
    assert spec.bytes_per_token == 61 * 576 * 2 == 70_272
    assert spec.bytes_per_block == 70_272 * 16
    assert spec.max_blocks_held(33) == spec.blocks_needed(33) == 3  # as full attention
    with pytest.raises(ValueError, match="kv_lora_rank 0"):
        MLAAttentionSpec.make(16, 0, 64, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="num_kv_heads 2"):
        MLAAttentionSpec(16, 2, 576, torch.bfloat16, 1, 512, 64)


def test_mla_groups():
    kw = dict(block_size=BS, num_kv_heads=8, head_dim=64, dtype=torch.float32)
    groups = make_kv_cache_groups(
        [(MLA_ATTENTION, None, (0, 1, 2))], **kw, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE
    )
    assert len(groups) == 1 and groups[0].layers == (0, 1, 2)
    assert isinstance(groups[0].spec, MLAAttentionSpec)
    assert groups[0].spec.bytes_per_token == 3 * (KV_LORA + ROPE) * 4
    with pytest.raises(ValueError, match="needs kv_lora_rank"):
        make_kv_cache_groups([(MLA_ATTENTION, None, (0,))], **kw)
    with pytest.raises(ValueError, match="cannot share"):
        make_kv_cache_groups(
            [(MLA_ATTENTION, None, (0,)), (FULL_ATTENTION, None, (1,))], **kw, kv_lora_rank=16
        )


def test_plan_reports_deepseek_v3_latent_bytes():
    shape = model_shape(DEEPSEEK_V3)
    assert (shape.kv_lora_rank, shape.q_lora_rank, shape.qk_rope_head_dim) == (512, 1536, 64)
    assert shape.attention_groups() == [(MLA_ATTENTION, None, tuple(range(61)))]
    assert shape.kv_elements_per_token() == 61 * 576
    plan = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=4096,
                     kv_cache_memory=1 << 30)
    assert plan.kv_bytes_per_token == 70_272
    assert plan.kv_bytes_per_block == 70_272 * 16
    assert plan.num_blocks == (1 << 30) // (70_272 * 16)
    assert "68.62 KiB per token over all layers (MLA latent 576 x 61 layers)" in plan.describe()
    # a GQA model of the same sizes keeps 2 x L x kv_heads x d (a DeepSeek-V3 config without
    # kv_lora_rank is refused: test_deepseek.py)
    gqa = model_shape({
        **{k: v for k, v in DEEPSEEK_V3.items() if "lora" not in k},
        "architectures": ["Qwen3MoeForCausalLM"],
    })
    gqa_plan = make_plan(gqa, torch.bfloat16, block_size=16, max_model_len=4096,
                         kv_cache_memory=1 << 30)
    assert gqa_plan.kv_bytes_per_token == 2 * 61 * 128 * (7168 // 128) * 2
    assert "MLA" not in gqa_plan.describe()
    with pytest.raises(ValueError, match="'v_head_dim' is missing"):
        model_shape({k: v for k, v in DEEPSEEK_V3.items() if k != "v_head_dim"})


@pytest.mark.parametrize("q_lora_rank,bias", [(24, False), (None, False), (24, True)])
def test_mla_attention_params_match_transformers(q_lora_rank, bias):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = hf_config("v3", q_lora_rank, False)
    cfg.attention_bias = bias
    expected = sum(p.numel() for p in DeepseekV3Attention(cfg, 0).parameters())
    shape = mla_shape(num_layers=1, q_lora_rank=q_lora_rank, attention_bias=bias)
    assert shape.attention_params() == expected


def mla_shape(num_layers: int = 2, q_lora_rank: int | None = 24, **kw) -> ModelShape:
    return ModelShape(
        architecture="MLAStub", vocab_size=48, hidden_size=HIDDEN, num_layers=num_layers,
        num_heads=HEADS, num_kv_heads=HEADS, head_dim=HIDDEN // HEADS, num_experts=0, top_k=0,
        moe_intermediate_size=0, intermediate_size=0, moe_layers=(),
        max_position_embeddings=MAX_POS, kv_lora_rank=KV_LORA, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, **kw,
    )


class _Layer(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn


class StubMLAModel(nn.Module):
    """Embeddings -> MLA layers (residual only) -> LM head: just enough of a model for the
    ModelRunner (the DeepSeek model files are built elsewhere). Records the logits it returns."""

    def __init__(self, spec: ModelShape, paged_layer: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.spec = spec
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, HIDDEN)
        rotary = RotaryEmbedding(ROPE, MAX_POS, 10000.0, interleaved=True)
        layers = []
        for i in range(spec.num_layers):
            if i == paged_layer:
                layers.append(_Layer(PagedAttention(HEADS, HEADS, 16, 0.25)))
                continue
            layers.append(_Layer(MLAAttention(
                HIDDEN, HEADS, q_lora_rank=spec.q_lora_rank, kv_lora_rank=KV_LORA,
                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rotary=rotary,
            )))
        self.model.layers = nn.ModuleList(layers)
        self.lm_head = nn.Linear(HIDDEN, spec.vocab_size, bias=False)
        self.logits: list[torch.Tensor] = []

    def kv_cache_groups(self):
        return self.spec.attention_groups()

    def moe_layers(self) -> list:
        return []  # no MoE block: the runner finds no communicator to begin steps on

    def forward(self, input_ids, positions, meta, kv_caches):
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = h + layer.self_attn(h, positions, meta, kv_cache)
        return h

    def compute_logits(self, h):
        logits = self.lm_head(h)
        self.logits.append(logits.clone())
        return logits


def test_runner_allocates_one_latent_tensor_per_layer():
    runner = ModelRunner(StubMLAModel(mla_shape(3)), 10, BS, torch.float32, Sampler(0))
    assert [g.spec.kind for g in runner.kv_groups] == [MLA_ATTENTION]
    caches = runner.kv_caches
    assert all(isinstance(c, torch.Tensor) for c in caches)
    assert {tuple(c.shape) for c in caches} == {(11, BS, KV_LORA + ROPE)}
    assert len({c.data_ptr() for c in caches}) == 3  # one per layer slot, not shared
    with pytest.raises(ValueError, match="attention kind 'full_attention', but its KV cache "
                                         "group 0 is 'mla'"):
        ModelRunner(StubMLAModel(mla_shape(2), paged_layer=1), 10, BS, torch.float32, Sampler(0))


def serve(prompts: list[list[int]], caching: bool) -> tuple[list[torch.Tensor], KVCacheManager]:
    """Run the prompts one after another (each to max_tokens 3) through scheduler, KV manager
    and ModelRunner -> (the logits of every sampled row, in order; the KV manager)."""
    model = StubMLAModel(mla_shape(2))
    runner = ModelRunner(model, 16, BS, torch.float32, Sampler(0))
    kv = KVCacheManager([g.spec for g in runner.kv_groups], 16, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), kv)
    for i, ids in enumerate(prompts):
        sched.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=3, temperature=0)))
        for _ in range(50):
            if not sched.num_unfinished:
                break
            out = sched.schedule()
            rows, sampled = runner.execute(out, kv)
            sched.update(out, {s.request.request_id: t
                               for s, t in zip(rows, sampled.token_ids, strict=True)})
        assert not sched.num_unfinished
    return model.logits, kv


def test_prefix_cache_hits_on_latent_blocks_change_nothing():
    prompt = [(7 * i + 3) % 48 for i in range(14)]  # 14 tokens: chunks of 8 + 6
    second = prompt[:12] + [5, 9, 11, 2, 30]  # shares 3 full blocks of 4 tokens
    cached, kv = serve([prompt, second], caching=True)
    fresh, kv_off = serve([prompt, second], caching=False)
    assert kv.prefix_cache_hits == 12 and kv_off.prefix_cache_hits == 0
    assert len(cached) == len(fresh) == 6
    for a, b in zip(cached, fresh, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_never_fits_names_the_latent_group():
    spec = MLAAttentionSpec.make(BS, KV_LORA, ROPE, torch.float32, 2)
    kv = KVCacheManager([spec], 3)
    with pytest.raises(ValueError, match=r"needs 4 KV blocks of 4 tokens \(MLA latent 4\)"):
        kv.check_fits(16)
