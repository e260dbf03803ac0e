"""Families of mixed attention kinds (issue 43), served token-exact against transformers
(tests/family_check.py): Llama 4 (chunked local + NoPE full layers; prefix caching, expert
parallelism, the Triton backend), Flint (sliding RoPE + NoPE full layers with sinks; 4-bit
experts) and MiMo-V2-Flash (sliding layers of twice the KV heads with sinks, value heads
narrower than q/k heads); the refusal of Gemma 4 names what the engine lacks."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from family_check import (
    check_ep_token_exact,
    check_prefix_cache,
    check_token_exact,
    family_prompts,
    make_family_checkpoint,
)

from moe_engine import SamplingParams
from moe_engine.errors import StartupError
from moe_engine.kv_cache import (
    NULL_BLOCK_ID,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheManager,
)
from moe_engine.models import resolve_config_dict
from moe_engine.models.layers.attention import (
    AttentionMetadata,
    build_attention_batch,
    build_decode_batch,
)
from moe_engine.models.layers.chunked_attention import ChunkedLocalPagedAttention
from moe_engine.request import Request
from moe_engine.scheduler import Scheduler
from moe_engine.startup.config import SchedulerConfig

ALL_EP = pytest.mark.skipif(
    os.environ.get("MOE_ENGINE_FAMILY_EP") != "all",
    reason="ep 2 of this family runs with MOE_ENGINE_FAMILY_EP=all (llama4 covers the module)",
)

BS, CHUNK = 4, 8


def test_chunked_spec_block_arithmetic():
    s = ChunkedLocalAttentionSpec(BS, 2, 8, torch.float32, 1, CHUNK)
    assert s.kind == "chunked_attention" and s.attention_chunk_size == CHUNK
    # the next query at 7 reads keys 0..7; at 8 its chunk starts at 8: blocks 0, 1 are done
    assert [s.num_skipped_blocks(n) for n in (7, 8, 15, 16, 17)] == [0, 2, 2, 4, 4]
    assert s.max_blocks_held(1000, 1) == 2  # a decode: its chunk's blocks
    assert s.max_blocks_held(1000, 8) == math.ceil((CHUNK - 1 + 8) / BS) == 4
    assert s.max_blocks_held(6, 8) == 2  # never more than the whole context
    with pytest.raises(ValueError, match="multiple of the KV block size 4"):
        ChunkedLocalAttentionSpec(BS, 2, 8, torch.float32, 1, 6)


@pytest.mark.parametrize("caching", [False, True])
def test_chunked_group_gives_blocks_back(caching):
    """Under chunked prefill, preemption and prefix caching, a chunked group holds only the
    blocks of each step's chunks (null before), and every block comes back."""
    rng = random.Random(5)
    specs = [FullAttentionSpec(BS, 2, 8, torch.float32, 1),
             ChunkedLocalAttentionSpec(BS, 2, 8, torch.float32, 1, CHUNK)]
    kv = KVCacheManager(specs, 40, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), kv)
    initial = kv.num_free_blocks
    stem = [rng.randrange(1, 100) for _ in range(30)]
    for i in range(6):
        n = rng.randrange(5, 31)
        sched.add_request(Request(str(i), stem[:n], SamplingParams(max_tokens=25)))
    for _ in range(400):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for step in out.scheduled:
            table = kv.block_table(step.request.request_id, 1)
            first = step.start // CHUNK * CHUNK // BS
            assert all(b == NULL_BLOCK_ID for b in table[:first])
            assert NULL_BLOCK_ID not in table[first:]
            assert len(table) == math.ceil((step.start + step.num_tokens) / BS)
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        for r in sched.running:  # between steps: only the next query's chunk
            assert kv.num_blocks_held(r.request_id, 1) <= CHUNK // BS
    assert not sched.num_unfinished and (caching or sched.num_preemptions > 0)
    assert kv.num_free_blocks == initial
    if caching:
        assert kv.prefix_cache_hits > 0


def test_chunked_attention_equals_masked_reference():
    """`ChunkedLocalPagedAttention` on a prefill batch (chunks crossing attention chunks) and a
    decode batch equals softmax attention under transformers' chunked causal mask."""
    torch.manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 8, 32
    attn = ChunkedLocalPagedAttention(heads, kv_heads, dim, dim**-0.5, CHUNK)
    starts, q_lens = torch.tensor([0, 5, 13]), torch.tensor([11, 9, 3])
    seq = starts + q_lens
    tables = torch.zeros(3, 8, dtype=torch.int64)
    perm = torch.randperm(num_blocks - 1)[:24] + 1
    for b in range(3):  # scattered blocks, so a wrong table offset reads other keys
        n = math.ceil(int(seq[b]) / BS)
        tables[b, :n] = perm[b * 8 : b * 8 + n]
    keys, values = (torch.randn(3, int(seq.max()), kv_heads, dim) for _ in range(2))
    cache = [torch.zeros(num_blocks, BS, kv_heads, dim) for _ in range(2)]
    for b in range(3):
        for p in range(int(seq[b])):
            for c, src in zip(cache, (keys, values), strict=True):
                c[tables[b, p // BS], p % BS] = src[b, p]
    q = torch.randn(int(q_lens.sum()), heads, dim)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64),
                             [build_attention_batch(0, q_lens, starts, tables, BS)])
    got = attn(q, None, None, cache, meta).view(-1, heads, dim)
    decode = build_decode_batch([int(x) - 1 for x in seq], tables, BS)
    q_dec = torch.randn(3, heads, dim)
    got_dec = attn(q_dec, None, None, cache,
                   AttentionMetadata(torch.empty(0, dtype=torch.int64), [decode]))
    rows = [(b, p) for b in range(3) for p in range(int(starts[b]), int(seq[b]))]
    for out, qs, pairs in ((got, q, rows), (got_dec.view(-1, heads, dim), q_dec,
                                             [(b, int(seq[b]) - 1) for b in range(3)])):
        for i, (b, p) in enumerate(pairs):
            lo = p // CHUNK * CHUNK
            k = keys[b, lo : p + 1].repeat_interleave(heads // kv_heads, 1)
            v = values[b, lo : p + 1].repeat_interleave(heads // kv_heads, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", qs[i], k) * dim**-0.5, -1)
            torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", w, v))


#: Llama 4: chunks of 16 tokens (one KV block; the 37/70-token prompts span 3-5 chunks), layers
#: 0, 1, 3 RoPE + chunked with the L2 q/k norm, layer 2 NoPE + full with the temperature
#: (floor_scale 8 so it changes within the prompts), MoE on odd layers (top-1 sigmoid,
#: weight on the input, shared expert), dense MLPs of another width on even ones.
LLAMA4 = dict(
    num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=1, intermediate_size=32,
    intermediate_size_mlp=48, attention_chunk_size=16, interleave_moe_layer_step=2,
    no_rope_layers=[1, 1, 0, 1], floor_scale=8, attn_scale=0.5, rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory):
    return make_family_checkpoint("llama4_text", LLAMA4, tmp_path_factory.mktemp("llama4"))


def test_llama4_token_exact(llama4_ckpt):
    llm = check_token_exact(llama4_ckpt)
    kinds = [g.spec.kind for g in llm.engine.runner.kv_groups]
    assert kinds.count("chunked_attention") == 3 and kinds.count("full_attention") == 1


@pytest.mark.parametrize("block_size", [16, 8])
def test_llama4_prefix_cache(llama4_ckpt, block_size):
    """Blocks of 16: the 32-token hit ends on a chunk boundary (the chunked group needs no
    block); of 8: the 40-token hit needs the cached block of its chunk (positions 32-39)."""
    check_prefix_cache(llama4_ckpt, block_size=block_size)


#: The other Llama 4 variants: top_k 2 (each (token, expert) pair its own scaled row), Llama 3
#: RoPE scaling (as Scout's; a 32-token original context so that the tiny head's frequencies are
#: divided and smoothed), no q/k norm (as Maverick), no temperature tuning.
LLAMA4_VARIANTS = {
    **LLAMA4, "num_experts_per_tok": 2, "rope_theta": None, "use_qk_norm": False,
    "attn_temperature_tuning": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
}


@pytest.fixture(scope="module")
def llama4_variants_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "llama4_text", LLAMA4_VARIANTS, tmp_path_factory.mktemp("llama4v"), name="llama4-variants"
    )


def test_llama4_variants_block_size_8(llama4_variants_ckpt):
    """The variants with chunks of two 8-token blocks."""
    check_token_exact(llama4_variants_ckpt, block_size=8)


def test_llama4_chunk_not_a_block_multiple_is_refused(llama4_ckpt):
    with pytest.raises(ValueError, match="attention_chunk_size 16 must be a positive multiple"):
        check_token_exact(llama4_ckpt, block_size=32, expected=[])


def test_llama4_triton_backend(llama4_variants_ckpt):
    """Triton: the chunks' virtual batches on the paged kernel, the rope prologue writing the
    chunked layers' cache (no q/k norm: the prologue takes the interleaved rope)."""
    llm = check_token_exact(llama4_variants_ckpt, kernel_backend="triton",
                            prompts=family_prompts(512, (1, 37)), max_new=4)
    assert llm.engine.model.model.layers[0].self_attn.prologue is not None


def test_llama4_ep2(llama4_ckpt):
    check_ep_token_exact(llama4_ckpt, 2)


#: Flint: sliding RoPE layers (window 24) and NoPE full layers, sinks in both, a dense first
#: layer, sigmoid top-2 routing renormalised with an ungated shared expert; norms drawn.
FLINT = dict(
    num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, intermediate_size=64, mlp_only_layers=[0],
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=24, rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def flint_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "flint", FLINT, tmp_path_factory.mktemp("flint"), drawn=("norm.weight",)
    )


def test_flint_token_exact(flint_ckpt):
    check_token_exact(flint_ckpt)


def test_flint_prefix_cache(flint_ckpt):
    check_prefix_cache(flint_ckpt)


@ALL_EP
def test_flint_ep2(flint_ckpt):
    check_ep_token_exact(flint_ckpt, 2)


#: MiMo-V2-Flash: full layers 0 and 3 with 1 KV head, sliding layers (window 20) with 2 and
#: sinks; q/k heads of 48 dims (16 rotated, a theta per layer type), values of 32 scaled by
#: 0.6; a dense first layer, then DeepSeek-V3 routing over 2 groups with a scaling factor;
#: q/k/v biases and the correction bias drawn.
MIMO = dict(
    num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=64, num_key_value_heads=1, head_dim=48, v_head_dim=32,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=20, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, attention_bias=True, attention_value_scale=0.6,
)


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return make_family_checkpoint(
        "mimo_v2_flash", MIMO, tmp_path_factory.mktemp("mimo"), drawn=("bias",)
    )


def test_mimo_v2_flash_token_exact(mimo_ckpt):
    llm = check_token_exact(mimo_ckpt)
    full = llm.engine.model.model.layers[0].self_attn
    assert (full.layer_kv_heads, full.kv_repeat, full.v_head_dim) == (1, 2, 32)


def test_mimo_v2_flash_prefix_cache(mimo_ckpt):
    check_prefix_cache(mimo_ckpt)


@ALL_EP
def test_mimo_v2_flash_ep2(mimo_ckpt):
    check_ep_token_exact(mimo_ckpt, 2)


def test_gemma4_refused_with_what_the_engine_lacks():
    fields = dict(enable_moe_block=True, hidden_activation="gelu_pytorch_tanh")
    with pytest.raises(StartupError, match="hidden_activation=gelu_pytorch_tanh"):
        resolve_config_dict({"architectures": ["Gemma4ForCausalLM"], **fields})


def test_flint_int4_experts(flint_ckpt, tmp_path):
    """4-bit experts (int4, groups of 32) equal transformers serving the same experts
    quantized and dequantized."""
    from fixtures import dequantized_experts_copy, hf_greedy

    prompts = family_prompts(512, (11, 37))
    expected = hf_greedy(dequantized_experts_copy(flint_ckpt, tmp_path, "int4", 32), prompts, 6)
    llm = check_token_exact(flint_ckpt, prompts=prompts, max_new=6, expected=expected,
                            quantization="int4", quant_group_size=32)
    assert all(m.quantized is not None for _, m in llm.engine.model.moe_layers())
