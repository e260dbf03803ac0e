"""GetModelInfo's weight bytes by kind and expert format: read from the loaded tensors, equal to
the startup plan's arithmetic, and 4-bit experts within the issue's budget of bf16 bytes."""

from __future__ import annotations

import grpc
import pytest
import torch
from fixtures import make_tiny_checkpoint
from grpc_helpers import ServerThread

from moe_engine import LLM
from moe_engine.models import checkpoint_shape
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import EngineConfig, ModelConfig, QuantConfig

#: hidden and expert width 128, so int4 groups of 128 divide both.
WIDE = dict(hidden_size=128, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def wide_ckpt(tiny_ckpt_root):
    """Qwen3-MoE float32: 3 layers (2 MoE), 8 experts of 128 x 128, hidden 128."""
    return make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root, **WIDE)


def _bf16_expert_bytes(ckpt) -> int:
    shape = checkpoint_shape(ckpt)
    return shape.expert_params() * torch.bfloat16.itemsize


def test_unquantized_bytes_by_kind_match_the_plan(wide_ckpt) -> None:
    llm = LLM(model=str(wide_ckpt), max_model_len=64)
    engine = llm.engine
    info = engine.weight_info()
    shape, h = engine.spec, engine.spec.hidden_size
    experts = info["weight_bytes_experts"]
    assert experts == shape.expert_params() * 4 == engine.plan.weight_bytes_experts
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer_attention = 2 * h * q + 2 * h * kv + 2 * shape.head_dim  # + q/k norms
    assert info["weight_bytes_attention"] == shape.num_layers * per_layer_attention * 4
    assert info["weight_bytes_embeddings"] == 2 * shape.vocab_size * h * 4
    rest = info["weight_bytes_attention"] + info["weight_bytes_embeddings"]
    assert rest + info["weight_bytes_other"] == engine.plan.weight_bytes_other
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert sum(v for k, v in info.items() if k.startswith("weight_bytes_")) == params
    assert (info["expert_weight_format"], info["expert_group_size"]) == ("none", 0)


@pytest.mark.parametrize(
    "method, group_size, budget", [("mxfp4", 128, 0.27), ("int4", 128, 0.28)]
)
def test_grpc_reports_four_bit_expert_bytes_within_budget(wide_ckpt, method, group_size, budget):
    config = EngineConfig(
        model=ModelConfig(model=str(wide_ckpt), max_model_len=64),
        quant=QuantConfig(method=method, group_size=group_size),
    )
    handle = ServerThread(config, ServerOptions(port=0))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            info = pb_grpc.MoeEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    finally:
        handle.close()
    bf16 = _bf16_expert_bytes(wide_ckpt)
    ratio = info.weight_bytes_experts / bf16
    assert 0.25 < ratio <= budget, (method, info.weight_bytes_experts, bf16)
    # 4 bits plus, per 32 (mxfp4) or 128 (int4) values, an 8-bit scale or a bf16 (scale,
    # offset) pair: 4.25 bits either way
    assert info.weight_bytes_experts == bf16 * 4.25 / 16
    assert info.expert_weight_format == method
    assert info.expert_group_size == (32 if method == "mxfp4" else group_size)
    assert not info.expert_checkpoint_format and not info.expert_zero_points
    assert info.weight_bytes_embeddings == 2 * 512 * 128 * 4  # float32, untied, unquantized


@pytest.mark.parametrize("ckpt_name", ["deepseek_v3_ckpt", "deepseek_v2_ckpt"])
def test_deepseek_weight_bytes_match_the_plan(ckpt_name, request) -> None:
    """MLA attention, dense first layer, float32 routers (with V3's correction bias) and shared
    experts: the plan's arithmetic equals the loaded tensors, in float32 and in bfloat16 (where
    the routers stay float32)."""
    from moe_engine.startup.plan import make_plan

    ckpt = request.getfixturevalue(ckpt_name)
    llm = LLM(model=str(ckpt), max_model_len=64)
    engine = llm.engine
    info = engine.weight_info()
    assert info["weight_bytes_experts"] == engine.plan.weight_bytes_experts
    total = sum(v for k, v in info.items() if k.startswith("weight_bytes_"))
    assert total == engine.plan.weight_bytes
    model_cls, spec = type(engine.model), engine.spec
    assert spec.shared_expert_intermediate_size == 32 * (1 if "v3" in ckpt_name else 2)
    bf16 = model_cls(spec, torch.bfloat16, max_position=64).weight_bytes_by_kind()
    plan = make_plan(spec, torch.bfloat16, block_size=16, max_model_len=64, kv_cache_memory=1 << 20)
    assert bf16["experts"] == plan.weight_bytes_experts
    assert sum(bf16.values()) == plan.weight_bytes
    assert spec.float32_params() > 0  # the routers: 2 bytes more each than in bfloat16
