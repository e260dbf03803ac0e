"""DeepSeek-V3 and DeepSeek-V2 (`models/deepseek_v3.py`, `models/deepseek_v2.py`) against
transformers 5.24 on the tiny float32 checkpoints (tests/fixtures.py "deepseek_v3": q LoRA,
interleaved rope, YaRN + mscale_all_dim, 16 experts in 4 groups top-4 by sigmoid with a drawn
correction bias, 1 shared expert, layer 0 dense; "deepseek_v2": direct q_proj, softmax
group-limited greedy, 2 shared experts).

Greedy ids equal and last-position logits within 1e-4 relative (L2 norm of the difference over
the norm of transformers' logits), through the offline LLM API with chunked prefill and
preemption, through gRPC, with `--ep-size 2` and `4`; prefix-cache hits on latent blocks;
absorbed and expanded MLA decode agree; the multi-token-prediction layer is skipped; config
refusals exit `moe-serve` 1 naming the field before any weight is read; the startup plan's
figures for the published DeepSeek-V3 and Kimi-K2 configs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from fixtures import hf_greedy, hf_last_logits
from grpc_helpers import ServerThread, greedy_streams, stats

from moe_engine import LLM, SamplingParams
from moe_engine.cli.serve import main as serve_main
from moe_engine.models import model_shape, resolve_architecture
from moe_engine.models.hf_config import load_hf_config
from moe_engine.models.layers.mla import MLAAttention
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from moe_engine.startup.plan import make_plan

CONFIGS = Path(__file__).parent / "data" / "configs"
ARCHS = ["deepseek_v3_ckpt", "deepseek_v2_ckpt"]
PROMPT_LENS = [1, 2, 7, 16, 17, 40, 129, 300]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _prompts(seed: int, lens: list[int] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_greedy_matches_transformers_with_chunking_and_preemption(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = _prompts(seed=len(ckpt_name))
    expected = hf_greedy(ckpt, prompts, MAX_NEW)
    # 32-token chunks; 22 blocks of 16 tokens cannot hold all 8 requests (~590 tokens)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=32, num_blocks_override=22, max_model_len=320)
    assert type(llm.engine.model).__name__ == json.loads((ckpt / "config.json").read_text())[
        "architectures"][0]
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.get_stats()
    assert s.num_preemptions > 0
    assert s.kv_blocks_free == s.kv_blocks_total


@pytest.fixture(scope="module", params=ARCHS)
def cached_llm(request):
    """(checkpoint, an LLM with prefix caching, 48-token chunks and 64 KV blocks)."""
    ckpt = request.getfixturevalue(request.param)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=48, max_model_len=512,
              num_blocks_override=64, enable_prefix_caching=True)
    return ckpt, llm


def test_last_position_logits_within_1e4_relative(cached_llm):
    ckpt, llm = cached_llm
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    try:
        for prompt in _prompts(3, [16, 17, 100]):
            captured.clear()
            llm.generate([prompt + [5]], SamplingParams(max_tokens=1, temperature=0))
            ours, ref = captured[0][0], hf_last_logits(ckpt, prompt + [5])
            rel = float((ours - ref).norm() / ref.norm())
            assert rel < 1e-4, f"relative error {rel:.2e}, prompt of {len(prompt) + 1} tokens"
    finally:
        llm.engine.model.compute_logits = compute


def test_prefix_cache_hits_on_latent_blocks(cached_llm):
    ckpt, llm = cached_llm
    prompt = _prompts(21, [70])[0]  # 4 full blocks of 16, over two chunks of 48
    hits = llm.engine.get_stats().prefix_cache_hits
    first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    again = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.get_stats().prefix_cache_hits - hits >= 64
    assert first == again == hf_greedy(ckpt, [prompt], MAX_NEW)[0]


def test_absorbed_and_expanded_decode_give_the_same_ids(cached_llm):
    _, llm = cached_llm
    layers = [m for m in llm.engine.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == 3 and all(m.absorb for m in layers)
    prompts = _prompts(5, [9, 33, 60])
    absorbed = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    try:
        for m in layers:
            m.absorb = False
        expanded = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        for m in layers:
            m.absorb = True
    assert absorbed == expanded


@pytest.mark.parametrize("ckpt_name", ARCHS)
def test_mtp_layer_tensors_are_skipped_unread(ckpt_name, request, tmp_path):
    """Hub checkpoints ship the multi-token-prediction layer as model.layers.{L}.*
    (num_nextn_predict_layers); it is skipped unread."""
    from safetensors.torch import load_file, save_file

    ckpt = request.getfixturevalue(ckpt_name)
    mtp = tmp_path / "mtp"
    shutil.copytree(ckpt, mtp)
    tensors = load_file(mtp / "model.safetensors")
    for name in ("eh_proj.weight", "enorm.weight", "shared_head.head.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight"):
        tensors[f"model.layers.3.{name}"] = torch.ones(4, 4)
    save_file(tensors, mtp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mtp / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (mtp / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(9, [12, 30])
    want = hf_greedy(ckpt, prompts, MAX_NEW)
    got = LLM(model=str(mtp), max_model_len=128).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want


# -- gRPC and expert parallelism --------------------------------------------------------------

GRPC_LENS = [1, 3, 16, 31, 64, 100, 200]
GRPC_NEW = [8, 12, 6, 10, 9, 5, 7]


def _config(ckpt, ep_size: int = 1, num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=320),
        cache=CacheConfig(num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=60.0),
    )


def _streams(handle: ServerThread, prompts: list[list[int]]):
    """Concurrent greedy streams -> (ids per prompt, ServerStats, ExpertLoad)."""
    with grpc.insecure_channel(handle.address) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        got = greedy_streams(stub, prompts, GRPC_NEW)
        return got, stats(stub), stub.GetExpertLoad(pb.GetExpertLoadRequest())


@pytest.mark.parametrize(
    ("ckpt_name", "ep_size"),
    [
        ("deepseek_v3_ckpt", 1),
        ("deepseek_v2_ckpt", 1),
        ("deepseek_v3_ckpt", 2),
        ("deepseek_v2_ckpt", 2),
        pytest.param("deepseek_v3_ckpt", 4, marks=pytest.mark.slow),
        pytest.param("deepseek_v2_ckpt", 4, marks=pytest.mark.slow),
    ],
)
def test_grpc_streams_match_transformers(ckpt_name, ep_size, request):
    """ep 1: 22 KV blocks (too few for all streams at once) and 32-token chunks; ep 2 / 4:
    experts split over ranks. Routed token-expert pairs are tokens x top_k summed over ranks:
    shared experts run once per token on its own rank and are never counted as routed."""
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = _prompts(7, GRPC_LENS)
    expected = [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, GRPC_NEW, strict=True)]
    config = _config(ckpt, ep_size, num_blocks=22 if ep_size == 1 else 64)
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        got, s, load = _streams(handle, prompts)
    finally:
        handle.close()
    assert got == expected
    assert s.kv_blocks_free == s.kv_blocks_total
    # tokens run through the model; a preempted request's are run again when it resumes
    total_tokens = sum(GRPC_LENS) + sum(GRPC_NEW) - len(GRPC_NEW)
    if ep_size > 1:
        assert s.num_preemptions == 0  # 64 blocks per rank hold every stream
    assert [layer.layer for layer in load.layers] == [1, 2]  # layer 0 is dense
    for layer in load.layers:
        assert len(layer.tokens_per_expert) == 16
        routed = sum(layer.tokens_per_expert)
        assert routed == 4 * total_tokens if s.num_preemptions == 0 else routed > 4 * total_tokens
        if ep_size > 1:
            assert len(layer.tokens_per_rank) == ep_size
            assert sum(layer.tokens_per_rank) == 4 * total_tokens


# -- config refusals, before any weight is read -----------------------------------------------

V3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
V2 = {  # DeepSeek-V2-Lite's config.json fields (huggingface.co/deepseek-ai/DeepSeek-V2-Lite)
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax",
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 102400, "max_position_embeddings": 163840, "rope_theta": 10000,
    "torch_dtype": "bfloat16",
}
V32 = {**V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
       "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}


def _without(cfg: dict, key: str) -> dict:
    return {k: v for k, v in cfg.items() if k != key}


REFUSALS = {
    "v3.2 indexer narrower than its rope": ({**V32, "index_head_dim": 32},
                                            r"index_head_dim 32 must be >= qk_rope_head_dim 64"),
    "index_topk on V3": ({**V3, "index_topk": 2048}, r"index_topk=2048.*not supported"),
    "experts not divisible": ({**V3, "n_routed_experts": 250},
                              r"n_routed_experts \(250\) must be divisible by n_group \(8\)"),
    "topk_group above n_group": ({**V3, "topk_group": 9}, r"topk_group \(9\) must be in"),
    "top_k above the kept groups": ({**V3, "topk_group": 1, "num_experts_per_tok": 40},
                                    r"num_experts_per_tok \(40\) must be in \[1, topk_group"),
    "V3 topk_method": ({**V3, "topk_method": "group_limited_greedy"},
                       r"topk_method 'group_limited_greedy' is not supported"),
    "V3 scoring_func": ({**V3, "scoring_func": "softmax"},
                        r"scoring_func 'softmax' is not supported"),
    "kv_lora_rank missing": (_without(V3, "kv_lora_rank"), r"kv_lora_rank is None"),
    "q_lora_rank missing": (_without(V3, "q_lora_rank"), r"missing required field 'q_lora_rank'"),
    "V2 topk_method": ({**V2, "topk_method": "noaux_tc"}, r"topk_method must be one of"),
    "V2 norm_topk_prob": ({**V2, "norm_topk_prob": True}, r"norm_topk_prob true is not"),
    "hidden_act": ({**V3, "hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
}


def _serve_config_only(tmp_path: Path, cfg: dict, capsys) -> tuple[int, str]:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = serve_main(["--model", str(tmp_path), "--port", "0"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_configs_exit_1_naming_the_field(case, tmp_path, capsys):
    cfg, message = REFUSALS[case]
    code, err = _serve_config_only(tmp_path, cfg, capsys)
    assert code == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("cfg", [V3, V2, V32], ids=["v3", "v2-lite", "v3.2"])
def test_published_configs_pass_the_config_checks(cfg, tmp_path, capsys):
    """The unmodified configs get past every config check: the first failure is the missing
    weights."""
    code, err = _serve_config_only(tmp_path, cfg, capsys)
    assert code == 1 and "safetensors" in err, err


# -- the startup plan of the published configs ------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-v3.json", "kimi-k2-instruct.json"])
def test_plan_reports_the_mla_latent_bytes_of_the_published_configs(name):
    cfg = json.loads((CONFIGS / name).read_text())
    shape = model_shape(cfg)
    plan = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=4096,
                     kv_cache_memory=1 << 30)
    assert plan.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert "(MLA latent 576 x 61 layers)" in plan.describe()
    first_dense = cfg["first_k_dense_replace"]
    assert shape.moe_layers == tuple(range(first_dense, 61))
    assert shape.shared_expert_intermediate_size == 2048
    assert plan.weight_bytes_experts == (61 - first_dense) * cfg["n_routed_experts"] * (
        3 * 7168 * 2048 * 2)


def test_kimi_k2_config_is_read_without_remote_code(tmp_path):
    """model_type "kimi_k2" is unknown to transformers and its auto_map names remote code:
    the config is read as DeepseekV3Config, never running that code."""
    from transformers import DeepseekV3Config

    shutil.copy(CONFIGS / "kimi-k2-instruct.json", tmp_path / "config.json")
    hf_config = load_hf_config(tmp_path)
    assert type(hf_config) is DeepseekV3Config
    arch, cls = resolve_architecture(hf_config)
    spec = cls.arch_spec(hf_config)
    assert arch == "DeepseekV3ForCausalLM" and spec.num_experts == 384
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (1, 1, 2.827)
    assert spec.rope_theta == 50000.0 and spec.yarn.factor == 32.0
    assert spec.yarn.mscale_all_dim == 1.0
    v3 = tmp_path / "v3"
    v3.mkdir()
    shutil.copy(CONFIGS / "deepseek-v3.json", v3 / "config.json")
    v3_spec = cls.arch_spec(load_hf_config(v3))
    assert v3_spec.moe_layers[0] == 3
    assert v3_spec.rope_interleave and v3_spec.yarn.factor == 40.0


@pytest.mark.parametrize("ckpt_name", ["deepseek_v3_ckpt", "glm4_moe_ckpt"])
def test_bfloat16_keeps_the_router_and_correction_bias_float32(ckpt_name, request):
    """As transformers' `_keep_in_fp32_modules_strict` (DeepSeek-V3 and GLM-4.5): with --dtype
    bfloat16 the float32 correction bias and router weight load unrounded (a rounded bias can
    change which experts are chosen); the other weights are rounded to bfloat16."""
    from safetensors.torch import load_file

    ckpt = request.getfixturevalue(ckpt_name)
    stored = load_file(ckpt / "model.safetensors")
    llm = LLM(model=str(ckpt), dtype="bfloat16", max_model_len=64)
    params = {**dict(llm.engine.model.named_parameters()), **dict(llm.engine.model.named_buffers())}
    for name in ("model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.2.mlp.gate.weight"):
        assert params[name].dtype == torch.float32 and torch.equal(params[name], stored[name])
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(params[o_proj].float(), stored[o_proj].bfloat16().float())
    assert not torch.equal(stored[o_proj].bfloat16().float(), stored[o_proj])


def test_a_kimi_k2_style_checkpoint_is_served_without_its_remote_code(deepseek_v3_ckpt, tmp_path):
    """The tiny V3 checkpoint relabelled as Kimi-K2 ships it (model_type "kimi_k2", auto_map
    to a configuration module of its own): served as DeepseekV3ForCausalLM, token for token
    the same, and the module never runs."""
    kimi = tmp_path / "kimi"
    shutil.copytree(deepseek_v3_ckpt, kimi)
    marker = tmp_path / "remote-code-ran"
    (kimi / "configuration_deepseek.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    cfg = json.loads((kimi / "config.json").read_text())
    cfg.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    })
    (kimi / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(13, [5, 40])
    got = LLM(model=str(kimi), max_model_len=128).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(deepseek_v3_ckpt, prompts, MAX_NEW)
    assert not marker.exists()



def test_fp8_block_checkpoint_equals_transformers_dequantization(deepseek_v3_ckpt, tmp_path):
    """DeepSeek-V3 as shipped: every Linear (MLA projections, dense MLP, routed and shared
    experts) e4m3 in blocks with weight_scale_inv, routers and norms unquantized: greedy ids
    equal transformers' own FP8 dequantization of the same checkpoint. 8 x 8 blocks divide
    every dimension here: transformers 5.24's `Fp8Dequantize` derives the block from
    rows // scale rows, which is wrong for partial edge blocks (and refuses DeepSeek-V3's
    kv_a_proj_with_mqa, 576 rows = 4.5 blocks of 128); the engine's partial edges are checked
    against a reference in test_fp8_checkpoint.py."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from fixtures import greedy_generate
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from quant.fp8 import quantize_fp8_block

    fp8, block = tmp_path / "v3-fp8", (8, 8)
    shutil.copytree(deepseek_v3_ckpt, fp8)
    stored = {}
    for name, w in load_file(fp8 / "model.safetensors").items():
        if w.dim() == 2 and "embed_tokens" not in name and not name.startswith("lm_head") and (
            ".mlp.gate." not in name
        ):
            stored[name], stored[f"{name}_scale_inv"] = quantize_fp8_block(w, block)
        else:
            stored[name] = w
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                  "dynamic", "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert sum(n.endswith("_scale_inv") for n in stored) == 3 * 5 + 3 + 2 * (16 + 1) * 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
        hf = AutoModelForCausalLM.from_pretrained(
            fp8, dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=block),
        ).eval()
    prompts = _prompts(17, [6, 45])
    got = LLM(model=str(fp8), max_model_len=128).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == greedy_generate(hf, prompts, MAX_NEW)


@pytest.mark.parametrize(("field", "value"), [("n_group", "4"), ("kv_lora_rank", None)])
def test_a_mistyped_config_field_is_one_line_naming_it(tmp_path, capsys, field, value):
    """transformers' strict config validation fails as one line naming the field and value,
    not a traceback, and moe-serve exits 1 before any weight is looked for."""
    import json

    from moe_engine.cli.serve import main

    cfg = json.loads((Path(__file__).parent / "data/configs/deepseek-v3.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["--model", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert f"field '{field}'" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
