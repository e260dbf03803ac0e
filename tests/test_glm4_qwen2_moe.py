"""GLM-4.5 (`Glm4MoeForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`) against transformers
5.24 on tiny float32 random checkpoints (tests/fixtures.py kinds "glm4_moe", "qwen2_moe").

- offline `LLM`: greedy ids equal `transformers.generate` with a 32-token budget (prompts up
  to 300 tokens, so chunked prefill) and a 22-block pool (preemption); last-position logits
  within 1e-4 relative (L2 norm of the difference over the reference's); a prefix-cache hit
  gives the same ids; weight bytes by kind equal the startup plan's;
- gRPC: concurrent greedy streams equal transformers, at --ep-size 1, 2 and 4 (ranks started
  by the elastic launcher, gloo); GLM's expert trace carries its group layout and
  `moe-skew report` shows the per-group load;
- the rotary, loader and plan pieces the two need: partial rotary against transformers'
  `apply_rotary_pos_emb`, MTP layers (`model.layers.{num_hidden_layers}.*`) skipped unread,
  float32 routers in the plan's bytes, GLM-4.5's published config;
- refusals: `moe-serve` exits 1 naming the field, from config.json alone (no weights there).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from fixtures import hf_greedy, hf_last_logits, make_tiny_checkpoint, tiny_config
from grpc_helpers import ServerThread, greedy_streams, stats

from moe_engine import LLM, SamplingParams
from moe_engine.models import architecture_class, model_shape
from moe_engine.models.base import _weight_kind
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.skew.trace import read_trace
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from moe_engine.startup.plan import make_plan

ARCHS = ["glm4_moe_ckpt", "qwen2_moe_ckpt"]
ARCH_OF = {"glm4_moe": "Glm4MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
PROMPT_LENS = [1, 2, 7, 16, 17, 40, 129, 300]
MAX_NEW = 10
#: Relative L2 error allowed between the engine's and transformers' last-position logits.
LOGITS_RTOL = 1e-4
GRPC_LENS = [3, 17, 40, 64, 100]
GRPC_NEW = [8, 6, 10, 5, 9]


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


_LLMS: dict[str, LLM] = {}


def _small_pool_llm(ckpt: Path) -> LLM:
    """One `LLM` per checkpoint for the module: a 32-token budget (prompts over 32 tokens are
    chunked) and 22 blocks of 16 tokens (the 8 prompts, ~550 tokens + 80 generated, cannot all
    be cached at once, so some are preempted)."""
    if str(ckpt) not in _LLMS:
        _LLMS[str(ckpt)] = LLM(
            model=str(ckpt), max_num_batched_tokens=32, num_blocks_override=22, max_model_len=320
        )
    return _LLMS[str(ckpt)]


# -- offline LLM -------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_greedy_matches_transformers_with_chunking_and_preemption(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = _prompts(PROMPT_LENS, seed=len(ckpt_name))
    expected = hf_greedy(ckpt, prompts, MAX_NEW)
    llm = _small_pool_llm(ckpt)
    before = llm.engine.get_stats().num_preemptions
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.get_stats()
    assert s.num_preemptions > before
    assert s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_last_position_logits_within_tolerance(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    llm = _small_pool_llm(ckpt)
    captured: list[torch.Tensor] = []
    model = llm.engine.model
    compute = model.compute_logits
    model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    try:
        for prompt in _prompts([16, 40, 129], seed=3):  # 40 and 129: chunked prefills
            captured.clear()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
            ours, ref = captured[-1][0], hf_last_logits(ckpt, prompt)
            rel = ((ours - ref).norm() / ref.norm()).item()
            assert rel < LOGITS_RTOL, f"relative error {rel:.2e}, prompt of {len(prompt)} tokens"
    finally:
        del model.compute_logits


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_prefix_cache_hit_gives_the_same_tokens(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    prompt = _prompts([40], seed=21)[0]
    expected = hf_greedy(ckpt, [prompt], 6)[0]
    llm = LLM(model=str(ckpt), max_model_len=128, num_blocks_override=32,
              enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert llm.engine.get_stats().prefix_cache_hits == 0
    second = llm.generate([prompt], sp)[0].outputs[0].token_ids
    # 40 prompt tokens: two full blocks of 16 come from the cache (the last token never does)
    assert llm.engine.get_stats().prefix_cache_hits == 32
    assert first == second == expected


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_weight_bytes_by_kind_equal_the_plan(ckpt_name, request):
    """Loaded tensors (parameters and persistent buffers) against the startup arithmetic:
    routed experts alone, everything else (shared experts are "other", replicated) together."""
    ckpt = request.getfixturevalue(ckpt_name)
    engine = _small_pool_llm(ckpt).engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert info["weight_bytes_experts"] == engine.plan.weight_bytes_experts
    assert info["weight_bytes_experts"] == engine.spec.expert_params() * 4
    rest = sum(v for k, v in info.items() if k != "weight_bytes_experts")
    assert rest == engine.plan.weight_bytes_other
    model = engine.model
    shared = [(n, p) for n, p in model.named_parameters() if ".shared_experts." in n]
    assert shared and {_weight_kind(n) for n, _ in shared} == {"other"}
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                  if n.endswith("e_score_correction_bias"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(info.values()) == params + buffers


@pytest.mark.parametrize("kind", ["glm4_moe", "qwen2_moe"])
def test_bfloat16_plan_counts_float32_routers(kind):
    """In bf16, GLM's router weight and correction bias stay float32 (transformers'
    `_keep_in_fp32_modules_strict`) and Qwen2-MoE's router is bf16; the plan's bytes equal the
    built model's either way (no weights needed: sizes only)."""
    hf_config = tiny_config(kind)
    cls = architecture_class(ARCH_OF[kind])
    spec = cls.arch_spec(hf_config)
    model = cls(spec, torch.bfloat16)
    gate = model.moe_layers()[0][1].gate
    assert gate.weight.dtype == (torch.float32 if kind == "glm4_moe" else torch.bfloat16)
    plan = make_plan(spec, torch.bfloat16, block_size=16, max_model_len=64,
                     kv_cache_memory=1 << 20)
    by_kind = model.weight_bytes_by_kind()
    assert by_kind["experts"] == plan.weight_bytes_experts
    assert sum(by_kind.values()) - by_kind["experts"] == plan.weight_bytes_other


def test_qwen2_moe_sliding_window_layers_match_transformers(tiny_ckpt_root):
    """use_sliding_window: layers i < max_window_layers with i even slide (here layer 0, window
    8), the others are full; greedy ids over prompts longer than the window equal
    transformers', with a sliding and a full KV group."""
    ckpt = make_tiny_checkpoint(
        "qwen2_moe", tiny_ckpt_root, use_sliding_window=True, sliding_window=8,
        max_window_layers=2,
    )
    prompts = _prompts([5, 30, 70], seed=8)
    expected = hf_greedy(ckpt, prompts, 8)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=32, max_model_len=128,
              num_blocks_override=40)
    assert [(k, w) for k, w, _ in llm.engine.model.kv_cache_groups()] == [
        ("full_attention", None), ("sliding_attention", 8)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


# -- pieces: rotary, loader, config reading ---------------------------------------------------


def test_partial_rotary_matches_transformers():
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from moe_engine.models.layers.rotary import PartialRotaryEmbedding

    config = tiny_config("glm4_moe")  # head_dim 16, partial_rotary_factor 0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 16, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 300, 511, 1023])
    cos, sin = Glm4MoeRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.double(), sin.double()
    )
    rope = PartialRotaryEmbedding(16, 8, 1024, 10000.0)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(got_q[..., 8:], q[..., 8:])  # the unrotated half passes through
    with pytest.raises(ValueError, match="rotary_dim 7"):
        PartialRotaryEmbedding(16, 7, 8, 10000.0)


def test_mtp_layers_beyond_num_hidden_layers_are_skipped_unread(glm4_moe_ckpt, tmp_path):
    """GLM-4.5 / DeepSeek-V3 checkpoints ship their MTP layer as model.layers.{L}.*; the
    loader never reads it (wants_weight is False) and the model is the same."""
    from safetensors.torch import load_file, save_file

    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(glm4_moe_ckpt, with_mtp)
    tensors = load_file(with_mtp / "model.safetensors")
    mtp = {n.replace("model.layers.2.", "model.layers.3."): t.clone()
           for n, t in tensors.items() if n.startswith("model.layers.2.")}
    mtp.update({
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.hnorm.weight": torch.ones(64),
        "model.layers.3.shared_head.head.weight": torch.randn(512, 64),
    })
    save_file({**tensors, **mtp}, with_mtp / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts([5, 33], seed=4)
    llm = LLM(model=str(with_mtp), max_model_len=64, num_blocks_override=16)
    model = llm.engine.model
    assert not any(model.wants_weight(n) for n in mtp)
    assert model.wants_weight("model.layers.2.mlp.experts.3.up_proj.weight")
    assert model.load_weights(mtp.items()) == set()  # skipped when handed over too
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(glm4_moe_ckpt, prompts, 5)


def test_config_reading_of_both_architectures():
    glm = model_shape(tiny_config("glm4_moe").to_dict())
    assert glm.moe_layers == (1, 2) and glm.intermediate_size == 96
    assert glm.attention_bias and glm.o_proj_bias is False and glm.qk_norm
    assert glm.shared_expert_intermediate_size == 32 and not glm.shared_expert_gate
    assert glm.router_float32 and glm.router_correction_bias and glm.num_experts == 16
    qwen = model_shape(tiny_config("qwen2_moe").to_dict())
    assert qwen.moe_layers == (0, 2) and qwen.attention_bias and qwen.o_proj_bias is False
    assert qwen.shared_expert_intermediate_size == 48 and qwen.shared_expert_gate
    assert not qwen.norm_topk_prob and not qwen.router_float32
    assert qwen.layer_types == ()
    spec = architecture_class("Glm4MoeForCausalLM").arch_spec(tiny_config("glm4_moe"))
    assert (spec.rotary_dim, spec.n_group, spec.topk_group) == (8, 2, 1)
    assert spec.routed_scaling_factor == 1.5
    qwen_cls = architecture_class("Qwen2MoeForCausalLM")
    for name in ("model.layers.0.mlp.shared_expert.up_proj.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight"):
        mapped = qwen_cls.weight_mapping.model_name(name)
        assert ".mlp.shared_experts." in mapped
        assert qwen_cls.weight_mapping.checkpoint_name(mapped) == name


def test_published_glm45_config_plan():
    """GLM-4.5's published config.json (tests/data/configs): 92 layers, the first 3 dense,
    GQA 96 / 8 heads of 128 with q/k/v biases only, one shared expert of 1536; KV bytes per
    token at bf16 = 92 x 2 x 8 x 128 x 2."""
    cfg = json.loads((Path(__file__).parent / "data/configs/glm-4.5.json").read_text())
    shape = model_shape(cfg)
    assert shape.moe_layers == tuple(range(3, 92)) and shape.num_experts == 160
    assert shape.shared_expert_intermediate_size == 1536 and shape.o_proj_bias is False
    plan = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=4096,
                     kv_cache_memory=1 << 30)
    assert plan.kv_bytes_per_token == 92 * 2 * 8 * 128 * 2 == 376_832
    from transformers import AutoConfig

    spec = architecture_class("Glm4MoeForCausalLM").arch_spec(AutoConfig.for_model(**cfg))
    assert (spec.rotary_dim, spec.n_group, spec.topk_group) == (64, 1, 1)  # 128 x 0.5
    assert spec.routed_scaling_factor == 2.5 and spec.rope_theta == 1e6


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("glm4_moe", dict(n_routed_experts=12, n_group=5),
         r"n_routed_experts \(12\) must be divisible by n_group \(5\)"),
        ("glm4_moe", dict(topk_group=3), r"topk_group \(3\) must be in \[1, n_group = 2\]"),
        ("glm4_moe", dict(num_experts_per_tok=9),
         r"num_experts_per_tok \(9\) must be in \[1, topk_group \* experts per group"),
        ("glm4_moe", dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
        ("qwen2_moe", dict(hidden_act="relu"), r"hidden_act 'relu' is not supported"),
        ("qwen2_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}),
         r"rope_type 'linear' is not supported"),
    ],
)
def test_moe_serve_refuses_from_config_json_alone(kind, overrides, message, tmp_path, capsys):
    """The directory holds config.json only: the refusal comes before any weight is looked
    for (a missing safetensors file would be the error otherwise)."""
    import re

    from moe_engine.cli.serve import main

    tiny_config(kind, architectures=[ARCH_OF[kind]], **overrides).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert main(["--model", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "safetensors" not in err


# -- gRPC ------------------------------------------------------------------------------------


def _grpc_config(ckpt: Path, ep_size: int = 1, trace: Path | None = None) -> EngineConfig:
    """A 32-token budget (chunked prefill), 40 blocks per rank (preemption is the offline
    tests' job), 8 sequences; `ep_size` ranks."""
    return EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=256),
        cache=CacheConfig(num_blocks_override=40),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=30.0),
        expert_trace=str(trace) if trace is not None else None,
    )


def _serve_and_stream(config: EngineConfig, prompts: list[list[int]]):
    """Start a server, stream every prompt concurrently (greedy), stop it; the ids and stats."""
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            got = greedy_streams(stub, prompts, GRPC_NEW)
            s = stats(stub)
    finally:
        handle.close()
    return got, s


def _expected(ckpt: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = _prompts(GRPC_LENS, seed=7)
    return prompts, [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, GRPC_NEW, strict=True)]


def _check_group_trace(trace_path: Path, top_k: int, capsys) -> None:
    """The trace names GLM's 2 expert groups; `moe-skew report` shows the per-group table,
    each layer's group pairs summing to its routed pairs."""
    from moe_engine.cli.skew import main as skew_main

    trace = read_trace(trace_path)
    assert trace.meta["n_group"] == 2
    assert trace.counts.sum() == 2 * top_k * trace.num_tokens.sum()  # 2 MoE layers
    capsys.readouterr()
    assert skew_main(["report", str(trace_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    total = trace.counts.sum(axis=0)  # [L, E]
    for i, layer in enumerate(report["layers"]):
        assert layer["groups"]["pairs"] == [int(total[i, :8].sum()), int(total[i, 8:].sum())]
    assert skew_main(["report", str(trace_path)]) == 0
    text = capsys.readouterr().out
    assert "per expert group" in text and "2 groups of 8 experts" in text


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_grpc_greedy_streams_match_transformers(ckpt_name, request, tmp_path, capsys):
    ckpt = request.getfixturevalue(ckpt_name)
    prompts, expected = _expected(ckpt)
    trace = tmp_path / "trace.npz" if ckpt_name == "glm4_moe_ckpt" else None
    got, s = _serve_and_stream(_grpc_config(ckpt, trace=trace), prompts)
    assert got == expected
    assert s.kv_blocks_free == s.kv_blocks_total
    if trace is not None:
        _check_group_trace(trace, top_k=4, capsys=capsys)


@pytest.mark.parametrize(
    ("ckpt_name", "ep_size"),
    [
        ("glm4_moe_ckpt", 2),
        ("qwen2_moe_ckpt", 2),
        pytest.param("glm4_moe_ckpt", 4, marks=pytest.mark.slow),
        pytest.param("qwen2_moe_ckpt", 4, marks=pytest.mark.slow),
    ],
)
def test_ep_greedy_streams_match_transformers(ckpt_name, ep_size, request, tmp_path, capsys):
    """Experts split over ep_size ranks (16 GLM experts, 8 Qwen2-MoE: 2 to 8 per rank), shared
    experts run on each token's own rank; GLM's ep-2 trace (rank 0's, summed) keeps n_group."""
    ckpt = request.getfixturevalue(ckpt_name)
    prompts, expected = _expected(ckpt)
    trace = tmp_path / "trace.npz" if (ckpt_name, ep_size) == ("glm4_moe_ckpt", 2) else None
    got, s = _serve_and_stream(_grpc_config(ckpt, ep_size, trace), prompts)
    assert got == expected
    assert s.ep_size == ep_size and s.kv_blocks_free == s.kv_blocks_total == 40 * ep_size
    if trace is not None:
        _check_group_trace(trace, top_k=4, capsys=capsys)
