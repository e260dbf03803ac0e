"""The startup plan counts the copies the native kernels pack beside the dense projections and
routers, and beside float routed experts (`Plan.weight_bytes_packed`), and leaves room for
them when it derives the KV budget from host memory."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.native.library import native_unavailable_reason
from kernels.plan import NATIVE_CPU, TORCH, KernelPlan
from moe_engine import LLM, SamplingParams
from moe_engine.models import model_shape
from moe_engine.models.layers.linear import Linear
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.startup.host_memory import HostMemory
from moe_engine.startup.plan import make_plan

CFG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
    "max_position_embeddings": 4096, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def test_the_linear_kernels_copy_bytes_per_weight() -> None:
    native, torch_plan = KernelPlan.uniform(NATIVE_CPU), KernelPlan.uniform(TORCH)
    assert native.linear_copy_bytes(torch.bfloat16) == 2.0
    assert native.linear_copy_bytes(torch.float32) == 4.0
    assert native.linear_copy_bytes(torch.float16) == 0.0  # float16 layers run torch's GEMM
    assert torch_plan.linear_copy_bytes(torch.bfloat16) == 0.0


def test_the_plan_counts_the_packed_copies_and_leaves_them_room() -> None:
    shape = model_shape(CFG)
    args = dict(block_size=16, max_model_len=4096, kv_cache_memory=None, max_num_seqs=256,
                host=HostMemory(total=2 * 2**30, available=2 * 2**30))
    plain = make_plan(shape, torch.bfloat16, **args)
    packed = make_plan(shape, torch.bfloat16, packed_bytes_per_weight=2.0, **args)
    routers = len(shape.moe_layers) * shape.router_params()
    want = math.ceil((routers + shape.dense_projection_params()) * 2.0)
    assert plain.weight_bytes_packed == 0 and packed.weight_bytes_packed == want
    assert packed.weight_bytes == plain.weight_bytes  # the weights as loaded, unchanged
    assert packed.held_bytes == plain.weight_bytes + want
    assert packed.num_blocks < plain.num_blocks  # the derived KV budget leaves them room
    assert "packed by the native kernels" in packed.describe()
    assert "packed by the native kernels" not in plain.describe()
    four_bit = make_plan(shape, torch.bfloat16, packed_bytes_per_weight=2.0,
                         dense_bits_per_weight=4.5, **args)
    assert four_bit.weight_bytes_packed == routers * 2  # 4-bit projections get no float copy


@pytest.mark.skipif(native_unavailable_reason() is not None,
                    reason="the native CPU library does not build here")
def test_planned_copies_match_what_the_kernels_pack(qwen3_ckpt) -> None:
    llm = LLM(model=str(qwen3_ckpt), max_model_len=64)
    llm.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    made = 0
    for module in llm.engine.model.modules():
        if isinstance(module, Linear) and module.kernel is not None:
            copy = module.kernel.packed or module.kernel.amx_copy
            if copy is not None:
                made += copy.nbytes
        if isinstance(module, FusedMoE) and module.quantized is None:  # float experts' copy
            made += sum(t.numel() * t.element_size() for t in module.bound_experts.held
                        if t.numel() > 0)
    planned = llm.engine.plan.weight_bytes_packed
    # within 10% (issue 41's standard); tiny layers pad their tiles by a few percent
    assert made > 0 and abs(planned - made) <= 0.1 * made, (made, planned)
