"""The triton kernel backend end to end: `--kernel-backend triton` serves the tiny checkpoints
through gRPC, greedy ids equal to transformers.

On this CPU the Triton kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set by
conftest.py before anything imports triton), so every fused-MoE and paged-attention launch of
the model is the real kernel source executed step by step: slow, hence short prompts and few
tokens. The prompts still cover what the kernels must get right: a chunked prefill over cached
context (a 24-token prompt with a 16-token budget), block boundaries (16-token blocks),
gpt-oss's sliding window (8 tokens) and sinks, GQA, concurrent decodes of different lengths.
Oracles: transformers in float32 on the checkpoint (float experts), on its experts quantized
and dequantized (int4 at load), on its own MXFP4 dequantization (the gpt-oss MXFP4 checkpoint).
"""

from __future__ import annotations

import grpc
import pytest
import torch
from fixtures import dequantized_experts_copy, greedy_generate, hf_greedy
from grpc_helpers import ServerThread, greedy_streams, stats

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    QuantConfig,
    SchedulerConfig,
)

PROMPT_LENS = [1, 7, 24]
MAX_NEW = [5, 4, 4]
TRITON_OPS = ("fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
              "attention_decode", "mla_decode", "router_topk", "rms_norm", "rotary")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(15)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _serve(ckpt, quantization: str = "none") -> tuple[list[list[int]], pb.ModelInfo]:
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=64),
        cache=CacheConfig(num_blocks_override=16),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        quant=QuantConfig(method=quantization, group_size=32),
        kernel_backend="triton",
    )
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            got = greedy_streams(stub, _prompts(), MAX_NEW, timeout_s=600)
            s = stats(stub)
    finally:
        handle.close()
    assert s.kv_blocks_free == s.kv_blocks_total  # nothing leaked
    return got, info


@pytest.mark.parametrize("ckpt_name", ["qwen3_ckpt", "mixtral_ckpt", "gpt_oss_ckpt"])
def test_float_experts_match_transformers(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    expected = [hf_greedy(ckpt, [p], n)[0] for p, n in zip(_prompts(), MAX_NEW, strict=True)]
    got, info = _serve(ckpt)
    for op in TRITON_OPS:
        assert info.kernel_backends[op] == "triton", (op, dict(info.kernel_backends))
    assert got == expected


def test_int4_experts_match_transformers_on_the_dequantized_weights(qwen3_ckpt, tmp_path):
    oracle = dequantized_experts_copy(qwen3_ckpt, tmp_path, "int4", 32)
    expected = [hf_greedy(oracle, [p], n)[0] for p, n in zip(_prompts(), MAX_NEW, strict=True)]
    got, info = _serve(qwen3_ckpt, "int4")
    assert info.expert_weight_format == "int4" and info.kernel_backends["fused_moe_int4"] == (
        "triton"
    )
    assert got == expected


def test_mxfp4_checkpoint_matches_transformers_dequantizing_it(gpt_oss_mxfp4_ckpt):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4_ckpt, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    expected = [greedy_generate(hf, [p], n)[0] for p, n in zip(_prompts(), MAX_NEW, strict=True)]
    got, info = _serve(gpt_oss_mxfp4_ckpt)
    assert info.expert_weight_format == "mxfp4"
    assert info.kernel_backends["fused_moe_mxfp4"] == "triton"
    assert got == expected


def test_mla_latent_decode_matches_transformers(deepseek_v3_ckpt):
    """DeepSeek-V3's absorbed decode through the Triton MLA kernel over the latent cache."""
    expected = [
        hf_greedy(deepseek_v3_ckpt, [p], n)[0] for p, n in zip(_prompts(), MAX_NEW, strict=True)
    ]
    got, info = _serve(deepseek_v3_ckpt)
    assert info.kernel_backends["mla_decode"] == "triton"
    assert got == expected


def test_every_module_is_bound_to_the_triton_kernels(qwen3_ckpt):
    """What the servers above ran: the plan reached every expert and attention module, and
    every norm and attention prologue."""
    from kernels.dense import triton_norm, triton_rope
    from kernels.moe.router_kernels import fused_softmax_topk
    from moe_engine import LLM
    from moe_engine.models.layers.attention import PagedAttention
    from moe_engine.models.layers.norm import RMSNorm
    from moe_engine.models.layers.self_attention import Attention

    for quantization, attr in (("none", "kernel_backend"), ("int4", "backend")):
        llm = LLM(model=str(qwen3_ckpt), max_model_len=64, quantization=quantization,
                  quant_group_size=32, kernel_backend="triton")
        moes = [moe for _, moe in llm.engine.model.moe_layers()]
        bound = {getattr(m.quantized if m.quantized is not None else m, attr) for m in moes}
        assert bound == {"triton"}, (quantization, bound)
        assert {m.router_kernel for m in moes} == {fused_softmax_topk}
        attention = [m for m in llm.engine.model.modules() if isinstance(m, PagedAttention)]
        assert {(m.kernels.decode_backend, m.kernels.prefill_backend) for m in attention} == {
            ("triton", "triton")
        }
        modules = list(llm.engine.model.modules())
        assert {(m.kernel, m.add_kernel) for m in modules if isinstance(m, RMSNorm)} == {
            (triton_norm.rms_norm, triton_norm.fused_add_rms_norm)
        }
        prologues = {m.prologue for m in modules if isinstance(m, Attention)}
        assert prologues == {triton_rope.qk_norm_rope_cache}
