"""The DeepSeek Sparse Attention families of issue 43 against transformers 5.24
(`tests/family_check.py`): DeepSeek-V3.2 (`deepseek_v32`), GLM-5 (`glm_moe_dsa`) and A.X-K2
(`axk2`), tiny float32
checkpoints whose `index_topk` (8) is below the prompts' lengths, so every query past the 8th
attends a strict subset of its keys: token-exact with chunked prefill, with prefix caching (the
indexer keys are cached beside the latent in the same blocks), ep 2, 4-bit experts, n-gram
speculation, the Triton backend; the indexer's selection itself against transformers'
`DeepseekV32Indexer` on fresh random inputs; the cache arithmetic of the indexer keys.
"""

from __future__ import annotations

import os

import pytest
import torch
from family_check import (
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)
from fixtures import dequantized_experts_copy, hf_greedy

EP_ALL = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of every family: MOE_ENGINE_FAMILY_EP=all (one family of this module runs it)",
)

#: MLA + indexer sizes both families share: 4 heads, q LoRA 48, latent 32 + rope 8, nope 16,
#: v 16; indexer of 8 heads x 16 dims keeping 8 keys per query.
DSA = {
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": None,
    "index_topk": 8,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 1.5,
}

#: DeepSeek-V3.2: 3 layers, the first dense (first_k_dense_replace), 8 experts in 2 groups (1
#: kept), one shared expert, YaRN with mscale_all_dim (the indexer's rope reads the same table).
DEEPSEEK_V32 = {
    **DSA,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}

#: GLM-5: 4 layers (0 dense), layers 1 and 3 without an indexer (they reuse the top-k of
#: layers 0 and 2), 8 experts top-2 ungrouped, two shared experts.
GLM_MOE_DSA = {
    **DSA,
    "num_hidden_layers": 4,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "indexer_types": ["full", "shared", "full", "shared"],
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
}

#: A.X-K2: 3 layers (0 dense: a plain post-attention norm), ungrouped routing (n_group null),
#: the gated query (q_gate_proj) and gated norms of rank 8.
AXK2 = {
    **DSA,
    "num_hidden_layers": 3,
    "mlp_layer_types": ["dense", "sparse", "sparse"],
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "gated_norm_rank": 8,
}

#: Parameters transformers initialises to zero / one whose paths the tests must exercise.
DRAWN = ("e_score_correction_bias", "k_norm.weight", "k_norm.bias")


@pytest.fixture(scope="module")
def deepseek_v32_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "deepseek_v32", DEEPSEEK_V32, tmp_path_factory.mktemp("dsa"), drawn=DRAWN
    )


@pytest.fixture(scope="module")
def glm_moe_dsa_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "glm_moe_dsa", GLM_MOE_DSA, tmp_path_factory.mktemp("dsa"), drawn=DRAWN
    )


def test_deepseek_v32_token_exact(deepseek_v32_ckpt):
    check_token_exact(deepseek_v32_ckpt)


def test_deepseek_v32_prefix_cache(deepseek_v32_ckpt):
    check_prefix_cache(deepseek_v32_ckpt)


def test_deepseek_v32_ep2(deepseek_v32_ckpt):
    check_ep_token_exact(deepseek_v32_ckpt, 2)


def test_deepseek_v32_int4_experts(deepseek_v32_ckpt, tmp_path):
    ref = dequantized_experts_copy(deepseek_v32_ckpt, tmp_path, "int4", 32)
    prompts = family_prompts(512, (11, 37))
    check_token_exact(deepseek_v32_ckpt, prompts=prompts, expected=hf_greedy(ref, prompts, 8),
                      quantization="int4", quant_group_size=32)


def test_deepseek_v32_ngram_drafts(deepseek_v32_ckpt):
    """n-gram drafts are verified as multi-token rows (each draft position selects its own
    keys); a repetitive prompt makes drafts that are accepted and rejected."""
    prompts = [[5, 6, 7, 8, 9] * 8, family_prompts(512, (37,), seed=4)[0]]
    check_token_exact(deepseek_v32_ckpt, prompts=prompts, speculative_method="ngram",
                      num_speculative_tokens=3)


def test_deepseek_v32_triton_backend(deepseek_v32_ckpt):
    """The Triton kernels (interpreted on a CPU): fused MoE, the sigmoid router, the MLA
    prologue, the indexer's scores (`triton_indexer`) and, while every row sees at most
    index_topk keys, the absorbed MLA decode."""
    from moe_engine.models.layers.indexer import LightningIndexer

    llm = check_token_exact(
        deepseek_v32_ckpt, kernel_backend="triton", prompts=family_prompts(512, (1, 37)),
        max_new=4,
    )
    indexers = [m for m in llm.engine.model.modules() if isinstance(m, LightningIndexer)]
    assert indexers and all(m.scores_kernel is not None for m in indexers)


def test_deepseek_v32_refuses_mtp_drafts(deepseek_v32_ckpt):
    from moe_engine import LLM
    from moe_engine.errors import StartupError

    with pytest.raises(StartupError, match="speculative_method 'mtp'.*DeepseekV32ForCausalLM"):
        LLM(model=str(deepseek_v32_ckpt), max_model_len=256, num_blocks_override=64,
            speculative_method="mtp", num_speculative_tokens=1)


def test_glm_moe_dsa_token_exact(glm_moe_dsa_ckpt):
    check_token_exact(glm_moe_dsa_ckpt)


def test_glm_moe_dsa_prefix_cache(glm_moe_dsa_ckpt):
    check_prefix_cache(glm_moe_dsa_ckpt)


@EP_ALL
def test_glm_moe_dsa_ep2(glm_moe_dsa_ckpt):
    check_ep_token_exact(glm_moe_dsa_ckpt, 2)


def test_glm_moe_dsa_refuses_a_first_layer_without_an_indexer():
    from transformers import AutoConfig

    from moe_engine.models.glm_moe_dsa import GlmMoeDsaForCausalLM

    cfg = AutoConfig.for_model("glm_moe_dsa", **{**GLM_MOE_DSA, "head_dim": 8,
                               "indexer_types": ["shared", "full", "full", "full"]})
    with pytest.raises(ValueError, match=r"indexer_types .* the first 'full'"):
        GlmMoeDsaForCausalLM.arch_spec(cfg)


@pytest.fixture(scope="module")
def axk2_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "axk2", AXK2, tmp_path_factory.mktemp("dsa"), drawn=(*DRAWN, "layernorm.norm.weight")
    )


def test_axk2_token_exact(axk2_ckpt):
    check_token_exact(axk2_ckpt)


def test_axk2_prefix_cache(axk2_ckpt):
    check_prefix_cache(axk2_ckpt)


@EP_ALL
def test_axk2_ep2(axk2_ckpt):
    check_ep_token_exact(axk2_ckpt, 2)


def test_the_indexer_selects_what_transformers_selects(deepseek_v32_ckpt):
    """`LightningIndexer` against transformers' `DeepseekV32Indexer` (the checkpoint's layer 1
    weights, fresh random inputs): the same keys per query, whole and in two chunks over the
    paged key cache."""
    from fixtures import _load_hf

    from moe_engine.models.layers.attention import build_attention_batch
    from moe_engine.models.layers.indexer import LightningIndexer
    from moe_engine.models.layers.rotary import RotaryEmbedding

    hf = _load_hf(str(deepseek_v32_ckpt))
    reference = hf.model.layers[1].self_attn.indexer
    ours = LightningIndexer(64, 48, 8, 16, 8, 8, False, torch.float32)
    ours.load_state_dict(reference.state_dict())
    rotary = RotaryEmbedding(8, 256, 10000.0, interleaved=True)
    t, block = 40, 16
    g = torch.Generator().manual_seed(11)
    h, q_resid = torch.randn(t, 64, generator=g), torch.randn(t, 48, generator=g)
    positions = torch.arange(t)
    cos, sin = rotary.cos_cache[positions][None], rotary.sin_cache[positions][None]
    causal = torch.full((t, t), float("-inf")).triu(1)[None]
    with torch.no_grad():
        want = reference(h[None], q_resid[None], (cos, sin), causal, positions[None])[0]
    keys = torch.zeros(5, block, 16)
    tables = torch.tensor([[1, 2, 3, 0]])
    selected = []
    for start, end in ((0, t), (0, 24), (24, t)):
        batch = build_attention_batch(0, torch.tensor([end - start]), torch.tensor([start]),
                                      tables, block)
        rows = positions[start:end]
        q, w = ours(h[rows], q_resid[rows], rows, rotary, keys, rows + block)
        selected.append(ours.select(q, w, keys, batch)[0, 0])
    for j in range(t):
        expected = {int(s) for s in want[j] if s <= j}
        assert set(selected[0][j].nonzero().flatten().tolist()) == expected, j
        part, row = (selected[1], j) if j < 24 else (selected[2], j - 24)
        assert set(part[row].nonzero().flatten().tolist()) == expected, j
        assert len(expected) == min(j + 1, 8)


def test_the_indexer_keys_are_sized_in_the_cache_and_the_plan():
    from moe_engine.kv_cache.spec import MLAAttentionSpec
    from moe_engine.models import model_shape
    from moe_engine.startup.plan import make_plan

    spec = MLAAttentionSpec.make(16, 32, 8, torch.bfloat16, 3, index_head_dim=16)
    assert spec.bytes_per_token == 3 * (32 + 8 + 16) * 2
    cfg = {**DEEPSEEK_V32, "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 512,
           "num_experts_per_tok": 2,
           "hidden_size": 64, "num_attention_heads": 4}
    shape = model_shape(cfg)
    assert shape.kv_elements_per_token() == 3 * (32 + 8 + 16)
    # wq_b [48 -> 8 x 16], wk [64 -> 16], k_norm 2 x 16, weights_proj [64 -> 8]
    assert shape.indexer_params() == 48 * 128 + 64 * 16 + 2 * 16 + 64 * 8
    plan = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=256,
                     kv_cache_memory=None, num_blocks_override=64)
    assert plan.kv_specs[0].bytes_per_block == 16 * 3 * (32 + 8 + 16) * 2
    assert "MLA latent + indexer keys, 3 layers" in plan.group_lines()[0]
    assert "+ indexer keys 16 x 3 layers" in plan.describe()


def test_the_triton_indexer_scores_equal_the_torch_path():
    """`kernels/attention/triton_indexer.indexer_scores` (interpreted) against the torch path's
    scores over the same paged keys: a prefill batch of two rows (one continuing a cached
    context), the same -inf pattern, float32 values within 1e-5, the same selection."""
    from kernels.attention.triton_indexer import indexer_scores
    from moe_engine.models.layers.attention import build_attention_batch
    from moe_engine.models.layers.indexer import LightningIndexer

    g = torch.Generator().manual_seed(5)
    indexer = LightningIndexer(64, 48, 8, 16, 8, 8, False, torch.float32)
    keys = torch.randn(9, 16, 16, generator=g)
    tables = torch.tensor([[3, 1, 7, 0], [2, 5, 0, 0]])
    batch = build_attention_batch(0, torch.tensor([21, 9]), torch.tensor([19, 0]), tables, 16)
    n = 30
    q, w = torch.randn(n, 8, 16, generator=g), torch.randn(n, 8, generator=g)
    want = indexer._scores(q, w, keys, batch).masked_fill(~batch.mask[:, 0], float("-inf"))
    got = indexer_scores(q, w, keys, tables, batch.tok_b, batch.q_pos[batch.tok_b, batch.tok_q],
                         batch.seq_lens, batch.num_keys, indexer.softmax_scale)
    want = want[batch.tok_b, batch.tok_q]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    rows = (batch.tok_b, batch.tok_q)  # the tokens' rows (padding rows attend nothing kept)
    torch_path = indexer.select(q, w, keys, batch)[:, 0][rows]
    indexer.scores_kernel = indexer_scores
    assert torch.equal(indexer.select(q, w, keys, batch)[:, 0][rows], torch_path)
    assert (torch_path.sum(-1) == batch.seq_lens[batch.tok_b].clamp(max=8).minimum(
        batch.q_pos[rows] + 1)).all()
