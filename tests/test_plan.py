"""plan.py: weight and KV arithmetic checked against numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from moe_engine.errors import StartupError
from moe_engine.models import model_shape
from moe_engine.startup.host_memory import HostMemory
from moe_engine.startup.plan import format_bytes, make_plan

MiB = 1 << 20
GiB = 1 << 30

#: BENCH.md's bench-qwen3-moe config.json (transformers 5 writes num_local_experts).
BENCH_CFG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
# By hand, bf16 (2 bytes):
#   experts: 8 layers x 32 experts x 3 x 512 x 256            = 100,663,296 params
#   other:   embed + lm_head 2 x 8192 x 512                   =   8,388,608
#            attention per layer 2x512x512 + 2x512x128 + 2x64 =     655,488  (x8 = 5,243,904)
#            router 32 x 512 + norms 2 x 512 per layer        =      17,408  (x8 =   139,264)
#            final norm                                       =         512
#            total                                            =  13,772,288 params
#   KV per token: 2 (K, V) x 8 layers x 2 heads x 64 dims x 2 bytes = 4,096 bytes
EXPERT_BYTES = 201_326_592
OTHER_BYTES = 27_544_576
WEIGHT_BYTES = EXPERT_BYTES + OTHER_BYTES


def bench_plan(**kw) -> object:
    args = {"block_size": 16, "max_model_len": 1024, "kv_cache_memory": GiB} | kw
    return make_plan(model_shape(BENCH_CFG), torch.bfloat16, **args)


def test_bench_shape_and_bytes() -> None:
    shape = model_shape(BENCH_CFG)
    assert shape.num_experts == 32 and shape.top_k == 4 and shape.moe_layers == tuple(range(8))
    assert shape.expert_params() + shape.other_params() == 114_435_584  # BENCH.md: 114.4 M
    plan = bench_plan()
    assert plan.weight_bytes_experts == EXPERT_BYTES
    assert plan.weight_bytes_other == OTHER_BYTES
    assert plan.kv_bytes_per_token == 4096
    assert plan.kv_bytes_per_block == 65536
    assert plan.num_blocks == 16384  # 1 GiB / 64 KiB
    assert plan.max_concurrent_tokens == 262144
    assert plan.kv_cache_memory == GiB
    plan.check(1024)


def test_float32_doubles_bytes_and_budget_rounds_down() -> None:
    shape = model_shape(BENCH_CFG)
    plan = make_plan(
        shape, torch.float32, block_size=32, max_model_len=512, kv_cache_memory=MiB + 5
    )
    assert plan.weight_bytes_experts == 2 * EXPERT_BYTES
    assert plan.kv_bytes_per_token == 8192 and plan.kv_bytes_per_block == 262144
    assert plan.num_blocks == 4 and plan.kv_cache_memory == MiB
    assert plan.max_concurrent_tokens == 128


def test_qwen3_dense_layers_and_transformers4_keys() -> None:
    # 4 layers, decoder_sparse_step 2 -> layers 1 and 3 MoE, but 3 is in mlp_only_layers.
    cfg = BENCH_CFG | {
        "num_hidden_layers": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "num_experts": 32,
    }
    del cfg["num_local_experts"]
    shape = model_shape(cfg)
    assert shape.moe_layers == (1,) and shape.num_dense_layers == 3
    assert shape.intermediate_size == 1024
    assert shape.expert_params() == 32 * 3 * 512 * 256
    # other: embeddings 8,388,608 + 4 x (655,488 + 1,024) + 1 router 16,384
    #        + 3 dense MLPs x 3 x 512 x 1024 + final norm 512
    assert shape.other_params() == 8_388_608 + 2_626_048 + 16_384 + 4_718_592 + 512


def test_mixtral_all_layers_moe() -> None:
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
    }
    shape = model_shape(cfg)
    assert shape.moe_layers == (0, 1) and shape.head_dim == 16 and shape.intermediate_size == 0
    assert shape.expert_params() == 2 * 8 * 3 * 64 * 32
    # attention 2x64x64 + 2x64x32 = 12,288; norms 128; router 512; per layer 12,928 (x2)
    # tied embedding 64,000; final norm 64
    assert shape.other_params() == 2 * 12_928 + 64_000 + 64
    assert shape.norm_topk_prob and not shape.qk_norm


def test_too_small_cache_names_numbers_and_flags() -> None:
    plan = bench_plan(kv_cache_memory=10 * 65536)  # 10 blocks = 160 tokens
    with pytest.raises(StartupError) as err:
        plan.check(1024)
    msg = str(err.value)
    for piece in (
        "1024",
        "64 blocks",
        "4194304",
        "10 blocks",
        "655360",
        "160",
        "--kv-cache-memory 4194304",
        "--max-model-len 160",
    ):
        assert piece in msg, (piece, msg)
    plan.check(160)  # exactly 10 blocks fits


def test_override_and_position_limit() -> None:
    plan = bench_plan(num_blocks_override=3)
    assert plan.num_blocks == 3 and plan.kv_cache_memory == 3 * 65536
    with pytest.raises(StartupError, match="num_blocks_override"):
        plan.check(1024)
    with pytest.raises(StartupError, match="--max-model-len 4096"):
        bench_plan(max_model_len=8192).check(8192)


def test_default_budget_from_host_memory() -> None:
    """The derived budget: 0.8 x total - in use - weights held - activations (bench config:
    8 heads of 64 + 2 x 2 kv heads of 64, H 512, top-4 of experts of 256, vocab 8192), capped
    at max_num_seqs requests of max_model_len; refused when one request does not fit."""
    acts = 4 * (2048 * (3 * 512 + max(2 * 768 + 512 + 512, 4 * 3 * 256 + 2 * 512))
                + 3 * 64 * 8192)
    host = HostMemory(total=10 * GiB, available=10 * GiB)
    args = dict(kv_cache_memory=None, max_num_batched_tokens=2048)
    # plenty of memory: max_num_seqs (64) x 1024 tokens = 64 x 64 blocks
    plan = bench_plan(host=host, max_num_seqs=64, **args)
    assert plan.num_blocks == 64 * 64 and plan.kv_cache_source == "max_num_seqs x max_model_len"
    assert plan.host.activations == acts
    # 8 MiB left after weights and activations: 8 MiB / 64 KiB per block = 128 blocks
    total = WEIGHT_BYTES + acts + 8 * MiB
    plan = bench_plan(host=HostMemory(total=total, available=total),
                      cpu_memory_utilization=1.0, max_num_seqs=64, **args)
    assert plan.num_blocks == 128 and plan.kv_cache_source == "cpu_memory_utilization 1"
    # memory in use elsewhere comes off the top
    used = bench_plan(host=HostMemory(total=total + 4 * MiB, available=total),
                      cpu_memory_utilization=1.0, max_num_seqs=64, **args)
    assert used.num_blocks == 128
    # 1 MiB left: less than one 1024-token request (64 blocks, 4 MiB): refused before loading
    short = WEIGHT_BYTES + acts + MiB
    with pytest.raises(StartupError, match="does not fit in host memory"):
        bench_plan(host=HostMemory(total=short, available=short), cpu_memory_utilization=1.0,
                   max_num_seqs=64, **args)


def test_expert_parallel_split_and_divisibility() -> None:
    assert bench_plan(ep_size=4).weight_bytes_experts == EXPERT_BYTES // 4
    assert bench_plan(ep_size=4).weight_bytes_other == OTHER_BYTES
    with pytest.raises(StartupError, match="divisible"):
        bench_plan(ep_size=3)


def test_describe_is_human_readable() -> None:
    text = bench_plan().describe()
    assert "192.0 MiB experts" in text and "26.27 MiB other" in text
    assert "4.00 KiB per token" in text and "16384" in text and "262144" in text
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"


def test_missing_field_is_named() -> None:
    cfg = dict(BENCH_CFG)
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        model_shape(cfg)


def test_derived_budget_is_capped_by_max_num_seqs() -> None:
    import torch

    from moe_engine.startup.plan import make_plan

    shape = model_shape(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "intermediate_size": 64,
            "max_position_embeddings": 256,
        }
    )
    plan = make_plan(
        shape,
        torch.float32,
        block_size=16,
        max_model_len=100,
        kv_cache_memory=None,
        host=HostMemory(total=1 << 33, available=1 << 33),
        max_num_seqs=3,
    )
    assert plan.num_blocks == 3 * 7  # ceil(100 / 16) = 7 blocks per request
    assert "max_num_seqs" in plan.kv_cache_source


def test_quantized_experts_are_counted_at_their_bits() -> None:
    import torch

    from moe_engine.startup.config import QuantConfig
    from moe_engine.startup.plan import make_plan

    shape = model_shape(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 64,
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "intermediate_size": 256,
            "max_position_embeddings": 256,
        }
    )
    params = 2 * 4 * 3 * 128 * 128  # layers x experts x (gate, up, down) x H x I
    kw = dict(block_size=16, max_model_len=64, kv_cache_memory=1 << 20)
    bf16 = make_plan(shape, torch.bfloat16, **kw)
    int4 = make_plan(
        shape, torch.bfloat16, **kw, expert_bits_per_weight=QuantConfig("int4", 128).bits_per_weight
    )
    mx = make_plan(
        shape, torch.bfloat16, **kw, expert_bits_per_weight=QuantConfig("mxfp4").bits_per_weight
    )
    assert bf16.weight_bytes_experts == params * 2
    assert int4.weight_bytes_experts == params * 4.25 / 8  # 4 bits + a 32-bit scale per 128
    assert mx.weight_bytes_experts == params * 4.25 / 8  # 4 bits + an 8-bit scale per 32
    assert int4.weight_bytes_other == bf16.weight_bytes_other
