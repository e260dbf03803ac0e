"""bench/real_scale.py's parts: the random checkpoint maker (shapes, dtypes, the MXFP4 layout,
shards and index, loadable by the engine and by transformers with the same greedy ids), the
bytes-per-token arithmetic against the issue's figures, the report; and, where
bench/setup_llamacpp.sh's build exists, llama.cpp's converter on a made checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bench_loader import BENCH, load_bench

LLAMACPP_ROOT = BENCH / ".venvs" / "llamacpp"


@pytest.fixture(scope="module")
def rc() -> ModuleType:
    load_bench("throughput")  # puts bench/ on sys.path
    import real_checkpoint

    return real_checkpoint


@pytest.fixture(scope="module")
def rb(rc: ModuleType) -> ModuleType:
    import real_bytes

    return real_bytes


def _shrunk(rc: ModuleType, stem: str) -> dict:
    """The shipped config with every dimension small (2 layers, 512 ids): same keys, same
    architecture, seconds to write and load."""
    config = rc.shipped_config(stem, layers=2, vocab=512)
    config.update(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    if stem == "gpt-oss-20b":
        config.update(intermediate_size=64, num_local_experts=4, experts_per_token=2,
                      num_experts_per_tok=2, sliding_window=8)
    else:
        config.update(moe_intermediate_size=32, intermediate_size=96, num_experts=8,
                      num_experts_per_tok=2)
    return config


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.fixture(scope="module")
def gpt_oss_dir(rc: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("real_gpt_oss")
    rc.write_checkpoint(_shrunk(rc, "gpt-oss-20b"), dest, seed=0, shard_bytes=60_000,
                        log=lambda _: None)
    return dest


def test_gpt_oss_layout_shards_and_index(rc: ModuleType, gpt_oss_dir: Path) -> None:
    """MXFP4 experts as uint8 blocks [E, 2I, H/32, 16] / scales [E, 2I, H/32] (scale bytes in
    119..121), everything else bf16, several shards, the index naming every tensor's shard."""
    from safetensors import safe_open

    index = json.loads((gpt_oss_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in gpt_oss_dir.glob("*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    tensors = {}
    for name in shards:
        header = _header(gpt_oss_dir / name)
        assert sorted(header) == sorted(k for k, v in index["weight_map"].items() if v == name)
        with safe_open(str(gpt_oss_dir / name), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    x = "model.layers.1.mlp.experts."
    assert tensors[x + "gate_up_proj_blocks"].shape == (4, 128, 2, 16)
    assert tensors[x + "gate_up_proj_scales"].shape == (4, 128, 2)
    assert tensors[x + "down_proj_blocks"].shape == (4, 64, 2, 16)
    assert tensors[x + "down_proj_bias"].shape == (4, 64)
    scales = torch.cat([t.flatten() for k, t in tensors.items() if k.endswith("_scales")])
    assert scales.min() == 119 and scales.max() == 121
    blocks = tensors[x + "down_proj_blocks"]
    assert blocks.dtype == torch.uint8 and len(blocks.unique()) > 200  # uniform bytes
    others = [k for k in tensors if not k.endswith(("_blocks", "_scales"))]
    assert all(tensors[k].dtype == torch.bfloat16 for k in others)
    assert tensors["model.layers.0.self_attn.sinks"].shape == (4,)
    std = tensors["lm_head.weight"].float().std().item()
    assert 0.018 < std < 0.022
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


def test_values_do_not_depend_on_sharding(rc: ModuleType, gpt_oss_dir: Path,
                                          tmp_path: Path) -> None:
    from safetensors import safe_open

    rc.write_checkpoint(_shrunk(rc, "gpt-oss-20b"), tmp_path, seed=0, log=lambda _: None)
    (one,) = tmp_path.glob("*.safetensors")
    index = json.loads((gpt_oss_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.q_proj.weight"
    with safe_open(str(one), "pt") as a, \
            safe_open(str(gpt_oss_dir / index["weight_map"][name]), "pt") as b:
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))


@pytest.mark.parametrize("stem", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_engine_loads_it_and_agrees_with_transformers(rc: ModuleType, stem: str,
                                                      tmp_path: Path) -> None:
    """The made checkpoint loads in moe-engine and in transformers, float32, same greedy ids
    (bench/real_agreement.py, which bench/real_scale.py runs on the 2-layer cut)."""
    import real_agreement

    rc.write_checkpoint(_shrunk(rc, stem), tmp_path, seed=0, log=lambda _: None)
    res = real_agreement.agreement(tmp_path, n=2, prompt_len=12, output_len=8)
    assert res["identical"] == 2, res


@pytest.mark.slow  # writes 0.8 GB and loads it (~30-60 s on 2 busy cores)
def test_real_dims_two_layer_cut_serves_finite_logprobs(rc: ModuleType, tmp_path: Path) -> None:
    """gpt-oss-20b's real dimensions cut to 2 layers and 512 ids: the engine loads it as
    shipped (MXFP4 experts) and its greedy logprobs stay finite (the scales keep activations
    in range); made once, found again by its config hash."""
    import math

    from moe_engine import LLM
    from moe_engine.sampling_params import SamplingParams

    ckpt = rc.ensure_checkpoint(tmp_path, "gpt-oss-20b", 2, 512, log=lambda _: None,
                               keep_free=2 * 10**9)
    assert rc.ensure_checkpoint(tmp_path, "gpt-oss-20b", 2, 512) == ckpt
    assert len(list(tmp_path.iterdir())) == 1
    llm = LLM(model=str(ckpt), max_model_len=64, kv_cache_memory=2**26)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, ignore_eos=True,
                            logprobs=1)
    out = llm.generate([[5, 17, 300, 42] * 4], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values())


def test_cache_key_and_cuts(rc: ModuleType) -> None:
    full = rc.shipped_config("gpt-oss-20b")
    cut = rc.shipped_config("gpt-oss-20b", layers=2, vocab=8192)
    assert cut["layer_types"] == ["sliding_attention", "full_attention"]
    assert (cut["eos_token_id"], cut["pad_token_id"]) == (8191, 8189)
    a = rc.checkpoint_dir(Path("/w"), "gpt-oss-20b", cut, 0)
    assert a.name.startswith("gpt-oss-20b-L2-V8192-") and a != rc.checkpoint_dir(
        Path("/w"), "gpt-oss-20b", cut, 1)
    assert rc.checkpoint_dir(Path("/w"), "gpt-oss-20b", full, 0).name.startswith(
        "gpt-oss-20b-L24-V201088-")
    with pytest.raises(ValueError):
        rc.shipped_config("qwen3-30b-a3b", layers=49)


def test_full_size_bytes_match_the_issue(rc: ModuleType, rb: ModuleType) -> None:
    """gpt-oss-20b: 12.8 GiB in 3 shards of <= 4.5 GiB; a batch-1 token reads 3.7 GB (experts
    1.27, attention 1.27, LM head 1.16), computed here from the config by hand."""
    config = rc.shipped_config("gpt-oss-20b")
    specs = rc.tensor_specs(config)
    assert round(sum(s.nbytes for s in specs) / 2**30, 1) == 12.8
    shards = rc.plan_shards(specs, rc.DEFAULT_SHARD_BYTES)
    assert len(shards) == 3 and all(sum(s.nbytes for s in g) <= 4.5 * 2**30 for g in shards)
    got = rb.bytes_per_token({s.name: s.nbytes for s in specs}, rb.hf_part, 4, 32, 201088)
    h, i, layers, v = 2880, 2880, 24, 201088
    per_expert = (2 * i * h + h * i) * 17 // 32 + (2 * i + h) * 2  # MXFP4 + bf16 biases
    assert got["experts"] == layers * 4 * per_expert
    q, kv = 64 * 64, 8 * 64
    attn = ((q + 2 * kv) * h + h * q + q + 2 * kv + h + 64) * 2  # weights, biases, sinks
    assert got["attention"] == layers * attn
    assert got["lm_head"] == v * h * 2 and got["embedding"] == h * 2
    assert [round(got[k] / 1e9, 2) for k in ("experts", "attention", "lm_head")] == [
        1.27, 1.27, 1.16]
    assert round(got["total"] / 1e9, 1) == 3.7
    four_bit = rb.served_bytes_per_token(got, 4.25, None, 4.25)
    assert four_bit["experts"] == got["experts"] and round(four_bit["total"] / 1e9, 1) == 1.9


def test_part_names(rb: ModuleType) -> None:
    assert [rb.hf_part(n) for n in (
        "model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.router.bias", "lm_head.weight",
        "model.embed_tokens.weight", "model.norm.weight")] == [
        "experts", "attention", "router", "router", "lm_head", "embedding", "other"]
    assert [rb.gguf_part(n) for n in (
        "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_exps.bias", "blk.1.attn_q.weight",
        "blk.1.attn_sinks.weight", "blk.0.ffn_gate_inp.weight", "output.weight",
        "token_embd.weight", "output_norm.weight")] == [
        "experts", "experts", "attention", "attention", "router", "lm_head", "embedding",
        "other"]


def test_report_figures(rc: ModuleType) -> None:
    import real_report

    rows = {"moe-engine": {"load_s": 30.0, "batch1": {"output_tokens_per_s": 10.0},
                           "batched": {"output_tokens_per_s": 30.0}},
            "llama.cpp-bf16": {"batch1": {"output_tokens_per_s": 8.0},
                               "batched": {"output_tokens_per_s": 12.0}},
            "llama.cpp-mxfp4_moe": {"batch1": {"output_tokens_per_s": 9.0},
                                    "batched": {"output_tokens_per_s": 20.0}}}
    result = {"rows": rows, "stream_read": [{"median_gbps": 40.0}, {"median_gbps": 30.0}],
              "bytes_per_token": {"moe-engine": {"total": 3.5e9}}}
    real_report.add_figures(result)
    assert rows["moe-engine"]["batch1"]["vs_llamacpp"] == 1.11
    assert rows["moe-engine"]["batched"]["vs_llamacpp"] == 1.5
    assert rows["moe-engine"]["read_gbps"] == 35.0 and rows["moe-engine"]["read_vs_stream"] == 1.0
    assert "read_gbps" not in rows["llama.cpp-bf16"]
    rows["moe-engine-all"] = {"error": "SystemExit: moe-serve exited with status 1"}
    result.update(checkpoint="/w/ckpt", date="d", runs=1, warmup=0, resident="one",
                  command="c", batch1={"requests": 8, "output_len": 64},
                  batched={"requests": 16, "output_len": 128},
                  load_average={"start": (1.0, 1.0, 1.0), "end": (2.0, 2.0, 2.0)},
                  logprob_gap={"moe-engine vs llama.cpp-bf16": {
                      "max_abs": 0.1, "mean_abs": 0.01, "argmax_agree": "4/4"}},
                  agreement={"checkpoint": "/w/cut", "identical": 4, "prompts": 4,
                             "output_len": 32, "matching_prefix_fraction": 1.0})
    result["stream_read"] = [{"median_gbps": 40.0, "best_gbps": 50.0, "gib": 4.0, "threads": 2}]
    text = real_report.render(result)
    assert "| moe-engine | 30.0 |" in text and "| 10.00 | 1.11x | 30.00 | 1.50x |" in text
    assert "| moe-engine-all | failed: SystemExit" in text and "4/4 identical" in text


needs_llamacpp = pytest.mark.skipif(
    not (LLAMACPP_ROOT / "venv" / "bin" / "python").is_file(),
    reason="no llama.cpp build: run bench/setup_llamacpp.sh")


@pytest.fixture(scope="module")
def tiny_gguf(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shrunk gpt-oss checkpoint through llama.cpp's converter (bf16, experts MXFP4)."""
    import llamacpp_gguf

    out = tmp_path_factory.mktemp("real_gguf")
    return llamacpp_gguf.ensure_ggufs(gpt_oss_dir, LLAMACPP_ROOT, ["bf16"], "bf16", out)["bf16"]


@pytest.mark.slow  # llama.cpp's converter on the shrunk checkpoint (~20 s on 2 busy cores)
@needs_llamacpp
def test_llamacpp_converts_the_mxfp4_experts_as_they_are(rb: ModuleType, gpt_oss_dir: Path,
                                                        tiny_gguf: Path) -> None:
    """llama.cpp's converter keeps the MXFP4 experts (17 bytes per 32 weights, the checkpoint's
    bytes) and pads the throwaway tokenizer to the config's vocabulary."""
    import sys

    import llamacpp_gguf

    gguf_py = llamacpp_gguf.llama_cpp_src(LLAMACPP_ROOT) / "gguf-py"
    sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader

    t = {x.name: x for x in GGUFReader(str(tiny_gguf)).tensors}
    assert t["blk.0.ffn_down_exps.weight"].tensor_type.name == "MXFP4"
    assert int(t["blk.0.ffn_down_exps.weight"].n_bytes) == 4 * 64 * 64 * 17 // 32
    assert int(t["token_embd.weight"].shape[-1]) == 512
    got = rb.gguf_bytes_per_token(tiny_gguf, gguf_py)
    ours = rb.checkpoint_bytes_per_token(gpt_oss_dir)
    assert got["lm_head"] == ours["lm_head"]  # bf16 both


@pytest.mark.slow
@needs_llamacpp
def test_runner_batch1_length_and_first_token_logprobs(gpt_oss_dir: Path, tiny_gguf: Path,
                                                      tmp_path: Path) -> None:
    """bench/llamacpp_runner.py's batch-1 `output_len` and `logprobs` command: the log-softmax
    at given ids matches transformers' float32 one on the same weights."""
    import os

    import llamacpp_peer
    import peer_runner
    import real_agreement
    import workload
    from transformers import AutoModelForCausalLM, Mxfp4Config

    prompts = real_agreement.prompts_for(512, 2, 12)
    requests = [workload.BenchRequest(p, 6) for p in prompts]
    path = workload.write_requests_file(requests)
    flags, env = llamacpp_peer.parse_config(llamacpp_peer.DEFAULT_CONFIG + ",threads=1", "bf16")
    lib = LLAMACPP_ROOT / "build" / "bin"
    launch = peer_runner.PeerLaunch(
        "llama.cpp-bf16", [str(LLAMACPP_ROOT / "venv" / "bin" / "python"),
                           str(BENCH / "llamacpp_runner.py"), "--model", str(tiny_gguf),
                           "--requests", str(path), "--lib-dir", str(lib), *flags],
        peer_runner.peer_environ(LLAMA_CPP_LIB_PATH=str(lib), **env), "bf16")
    runner = peer_runner.PeerRunner(launch, requests)
    try:
        assert runner.run("batch1", output_len=3).output_tokens == 2 * 3
        assert runner.run("batch1").output_tokens == 2 * 6
        ids = [[0, 7, 300], [5, 511]]
        got = runner.request({"cmd": "logprobs", "prompts": prompts, "token_ids": ids},
                             "logprobs")
    finally:
        runner.close()
        os.unlink(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(gpt_oss_dir), dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.inference_mode():
        for p, t, lps, top in zip(prompts, ids, got["logprobs"], got["argmax"], strict=True):
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0, -1].double(), -1)
            assert top == int(ref.argmax())
            assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref[t], atol=0.05)
