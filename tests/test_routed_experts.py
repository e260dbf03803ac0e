"""Routing replay at ep 1 (issue 45): `--enable-return-routed-experts` / `LLM(...,
enable_return_routed_experts=True)` and `SamplingParams.return_routed_experts` return, for every
token the model ran for a completion ([0, seqlen - 1)), the top-k logical expert ids of every MoE
layer, equal to transformers' router top-k (`routed_experts_helpers`): Qwen3-MoE (softmax
top-k) and DeepSeek-V3 (sigmoid, non-zero correction bias, group-limited top-k), gpt-oss
(sliding-window + full-attention groups: the routing lives in the full group's slots), with
prefix caching (the cached prefix's routing is kept), n-gram and MTP speculation (only accepted
tokens; the MTP layer is not recorded), preemption (recompute rewrites the slots), n = 2, the
decode-graph path and the native decode layer; an engine without the flag refuses the request
naming it.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from fixtures import make_tiny_checkpoint, tiny_config
from routed_experts_helpers import assert_routing_equal
from safetensors.torch import load_file, save_file

from moe_engine import LLM, SamplingParams
from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.kv_cache.routed_experts import RoutedExpertsStore
from moe_engine.routing_capture import RoutedExpertsCapture
from moe_engine.runner.cuda_graphs import EagerReplayCapture
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def _prompts(seed: int = 5) -> list[list[int]]:
    """Prompts that repeat spans (n-gram drafts find matches) and one that does not."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(3, 200, (7,), generator=g).tolist()
    noise = torch.randint(3, 200, (30,), generator=g).tolist()
    return [span * 4, noise[:9] + span + noise[9:20] + span, noise, span[:3] * 5 + noise[:4]]


def _engine(ckpt, *, num_blocks: int = 64, budget: int = 64, caching: bool = False,
            k: int = 0, method: str = "ngram", enabled: bool = True, graph_capture=None,
            max_model_len: int = 128, kernel_backend: str = "auto", max_num_seqs: int = 8,
            ) -> EngineCore:
    return build_engine_core(
        EngineConfig(
            model=ModelConfig(model=str(ckpt), max_model_len=max_model_len),
            cache=CacheConfig(num_blocks_override=num_blocks, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
            speculative=(SpeculativeConfig(method, k, 1, 3, 0) if method == "ngram"
                         else SpeculativeConfig(method, k, disable_by_batch_size=0))
            if k else SpeculativeConfig(),
            enable_return_routed_experts=enabled,
            kernel_backend=kernel_backend,
        ),
        graph_capture=graph_capture,
    )


def _run(engine: EngineCore, prompts, params: SamplingParams, prefix: str = "r"
         ) -> list[list[tuple[list[int], np.ndarray | None]]]:
    """Per prompt, per completion: (output ids, routed experts [T, L, k] int32 or None),
    checking that only the finished output carries them."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    got: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, routed = got.setdefault((out.request_id, out.index), [[], None])
            ids += out.new_token_ids
            assert (out.routed_experts is not None) == (out.finished and (
                params.return_routed_experts)), out
            if out.routed_experts is not None:
                got[out.request_id, out.index][1] = np.frombuffer(
                    out.routed_experts, dtype="<i4").reshape(out.routed_experts_shape)
    return [[tuple(got[f"{prefix}{i}", j]) for j in range(params.n)]
            for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                        return_routed_experts=True)


@pytest.mark.parametrize("name", ["qwen3_ckpt", "deepseek_v3_ckpt"])
@pytest.mark.parametrize("output_kind", ["delta", "final_only"])
def test_llm_routed_experts_equal_transformers(name, output_kind, request) -> None:
    ckpt = request.getfixturevalue(name)
    llm = LLM(str(ckpt), max_model_len=128, num_blocks_override=64, max_num_batched_tokens=24,
              enable_return_routed_experts=True)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True,
                            return_routed_experts=True, output_kind=output_kind)
    prompts = _prompts()
    outs = llm.generate(prompts, params, use_tqdm=False)  # batched, chunked prefill
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        assert_routing_equal(completion.routed_experts, ckpt, prompt, completion.token_ids)
    if name == "deepseek_v3_ckpt" and output_kind == "delta":  # the bias changes the ids
        for _, moe in llm.engine.model.moe_layers():
            moe.gate.e_score_correction_bias.zero_()
        unbiased = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
        first = outs[0].outputs[0]
        n = min(len(unbiased.routed_experts), len(first.routed_experts))
        assert (np.sort(unbiased.routed_experts[:n], -1)
                != np.sort(first.routed_experts[:n], -1)).any(), "the bias changed no routing"
    # not asked for: nothing
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert plain[0].outputs[0].routed_experts is None


def test_refused_without_the_flag_naming_it(qwen3_ckpt) -> None:
    engine = _engine(qwen3_ckpt, enabled=False)
    with pytest.raises(RequestError) as info:
        engine.add_request("a", [5, 6, 7], GREEDY)
    err = info.value
    assert err.code == ErrorCode.INVALID_ARGUMENT and err.field == "return_routed_experts"
    assert "--enable-return-routed-experts" in str(err)
    assert not engine.has_unfinished_requests()
    llm = LLM(str(qwen3_ckpt), max_model_len=128, num_blocks_override=16)
    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name", ["qwen3_ckpt", "deepseek_v3_ckpt"])
def test_prefix_cache_hit_keeps_the_prefix_routing(name, request) -> None:
    ckpt = request.getfixturevalue(name)
    engine = _engine(ckpt, caching=True)
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 400, (50,), generator=g).tolist()  # 3 full blocks of 16
    first = prefix + [7, 8]
    (ids_a, routed_a), = _run(engine, [first], GREEDY, "a")[0]
    assert_routing_equal(routed_a, ckpt, first, ids_a)
    hits = engine.kv.prefix_cache_hits
    second = prefix + [9, 10, 11]
    (ids_b, routed_b), = _run(engine, [second], GREEDY, "b")[0]
    assert engine.kv.prefix_cache_hits - hits >= 48, "the second request hit no cached block"
    assert_routing_equal(routed_b, ckpt, second, ids_b)
    np.testing.assert_array_equal(routed_b[:48], routed_a[:48])


def test_sliding_window_model_keeps_routing_in_the_full_attention_group(gpt_oss_ckpt) -> None:
    """gpt-oss alternates sliding-window (8 tokens) and full-attention layers: the sliding
    group gives early blocks back, so the routing lives in the full group's slots, and requests
    far longer than the window get all of theirs."""
    engine = _engine(gpt_oss_ckpt)
    replay = engine.runner.routing_replay
    kinds = [g.spec.frees_blocks for g in engine.runner.kv_groups]
    assert True in kinds and not kinds[replay.store.group], kinds
    prompts = _prompts()
    for prompt, [(ids, routed)] in zip(prompts, _run(engine, prompts, GREEDY), strict=True):
        assert_routing_equal(routed, gpt_oss_ckpt, prompt, ids)


def test_speculation_returns_only_accepted_tokens(qwen3_ckpt) -> None:
    engine = _engine(qwen3_ckpt, k=3, budget=24)
    prompts = _prompts()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                            return_routed_experts=True)
    for prompt, [(ids, routed)] in zip(prompts, _run(engine, prompts, params), strict=True):
        assert_routing_equal(routed, qwen3_ckpt, prompt, ids)
    stats = engine.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def _with_mtp_layer(ckpt, root):
    """The tiny DeepSeek-V3 (3 layers, layer 0 dense) plus a random MTP layer
    (`model.layers.3.*`, an MoE layer; config num_nextn_predict_layers 1), as
    tests/test_spec_mtp.py builds it; transformers loads the main model and ignores it."""
    from transformers import AutoModelForCausalLM

    path = root / "deepseek_v3-mtp"
    shutil.copytree(ckpt, path)
    weights = load_file(path / "model.safetensors")
    torch.manual_seed(7)
    big = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3", num_hidden_layers=4))
    extra = {k: v.detach().clone() for k, v in big.state_dict().items()
             if k.startswith("model.layers.3.")}
    hidden = big.config.hidden_size
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.layers.3.{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    extra["model.layers.3.eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.2
    extra["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    extra["model.layers.3.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_mtp_layers_are_not_recorded(deepseek_v3_ckpt, tmp_path) -> None:
    """MTP drafts: the MTP layer's MoE block computes no token of the request, so the routed
    experts are the main model's 2 MoE layers, equal to transformers' (accepted tokens only)."""
    ckpt = _with_mtp_layer(deepseek_v3_ckpt, tmp_path)
    engine = _engine(ckpt, k=2, method="mtp")
    assert engine.runner.mtp is not None and engine.runner.routing_replay.num_layers == 2
    prompts = _prompts()[:2]
    for prompt, [(ids, routed)] in zip(prompts, _run(engine, prompts, GREEDY), strict=True):
        assert_routing_equal(routed, ckpt, prompt, ids)
    assert engine.drafter.stats.num_draft_tokens > 0


def test_preemption_rewrites_the_slots(qwen3_ckpt) -> None:
    # 5 blocks of 16 tokens for 4 requests of up to 42 + 12 tokens: preemptions (recompute)
    engine = _engine(qwen3_ckpt, num_blocks=5, budget=16, max_model_len=64)
    prompts = _prompts()
    got = _run(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "no request was preempted: the test shows nothing"
    for prompt, [(ids, routed)] in zip(prompts, got, strict=True):
        assert_routing_equal(routed, qwen3_ckpt, prompt, ids)


def test_parallel_sampling_each_completion_its_own(qwen3_ckpt) -> None:
    engine = _engine(qwen3_ckpt)
    prompt = _prompts()[1]  # 36 tokens: two full prompt blocks shared by the completions
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                            return_routed_experts=True)
    [completions] = _run(engine, [prompt], params)
    assert completions[0][0] != completions[1][0], "both completions sampled the same tokens"
    for ids, routed in completions:
        assert_routing_equal(routed, qwen3_ckpt, prompt, ids)


@pytest.mark.slow  # the Triton interpreter: ~20 s on 2 shared cores
def test_decode_graph_path(qwen3_ckpt) -> None:
    """Decode steps replayed from captured graphs (the CPU stand-in of CUDA graphs) write the
    capture's static buffer; padding rows are not kept."""
    engine = _engine(qwen3_ckpt, graph_capture=EagerReplayCapture(), kernel_backend="triton",
                     max_num_seqs=4, budget=16)
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    prompts = [list(range(5, 12)), list(range(40, 49)), [3, 4, 5]]  # 3 decodes: pad to 4
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                            return_routed_experts=True)
    for prompt, [(ids, routed)] in zip(prompts, _run(engine, prompts, params), strict=True):
        assert_routing_equal(routed, qwen3_ckpt, prompt, ids)
    assert sum(graphs.num_replays.values()) > 0


def test_native_decode_layer_writes_the_capture(tiny_ckpt_root) -> None:
    """A bfloat16 model's decode steps run the native one-call decode layer (native-cpu): the
    routing it returns is what the expert-load recorder counted, token for token."""
    ckpt = make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root, dtype=torch.bfloat16)
    llm = LLM(str(ckpt), max_model_len=128, num_blocks_override=32,
              enable_return_routed_experts=True)
    layers = llm.engine.model.model.layers
    if not any(layer.decode_kernel is not None for layer in layers):
        pytest.skip(f"no native decode layer here: {[x.decode_misfit for x in layers]}")
    [out] = llm.generate([list(range(5, 40))], GREEDY, use_tqdm=False)
    routed = out.outputs[0].routed_experts
    assert routed.shape == (35 + 12 - 1, 2, 2)
    counts = llm.engine.expert_load.snapshot().numpy()
    mine = np.stack([np.bincount(routed[:, r].ravel(), minlength=counts.shape[1])
                     for r in range(routed.shape[1])])
    np.testing.assert_array_equal(mine, counts)


def test_store_slot_mapping_and_gather() -> None:
    store = RoutedExpertsStore(num_slots=8 * 4, num_layers=1, top_k=1, dtype=np.dtype(np.int16),
                               block_size=4, group=0)
    # two requests: positions 2..6 through blocks [3, 5], position 0 through block [7]
    slots = store.slot_mapping([2, 0], [5, 1], [[3, 5], [7]])
    assert slots.tolist() == [14, 15, 20, 21, 22, 28]
    store.write(slots, np.arange(6, dtype=np.int16).reshape(6, 1, 1))
    got = store.gather([3, 5], 7)
    assert got.dtype == np.int32 and got[2:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="9 positions"):
        store.gather([3, 5], 9)


def test_capture_dtype_and_growth() -> None:
    small = RoutedExpertsCapture(2, 3, num_scored_experts=32768, capacity=2)
    assert small.dtype == torch.int16 and small.bytes_per_token == 12
    assert RoutedExpertsCapture(2, 3, 32769, 2).dtype == torch.int32
    small.record(1, torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32))  # grows, k 2 < 3
    assert small.capacity >= 3
    assert small.take(3)[:, 1].tolist() == [[1, 2, -1], [3, 4, -1], [5, 6, -1]]
    assert (small.take(3)[:, 0] == -1).all()


def test_moe_serve_flag_sets_the_config() -> None:
    from moe_engine.cli.serve import build_parser, engine_config_from_args

    for argv, on in (([], False), (["--enable-return-routed-experts"], True)):
        args = build_parser().parse_args(["--model", "m", *argv])
        assert engine_config_from_args(args, "m").enable_return_routed_experts is on


def test_moe_serve_refuses_it_on_a_decode_instance_before_loading(qwen3_ckpt, capsys,
                                                                  monkeypatch) -> None:
    """A decode instance of a prefill/decode split has no record of its prompts' routing:
    moe-serve exits 1 naming both flags before any rank loads (the new-user trial waited ~45 s
    for the same refusal from the engine core)."""
    import time

    from moe_engine.cli import serve

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started before the refusal")

    monkeypatch.setattr(serve, "serve", no_engine)
    started = time.monotonic()
    status = serve.main(["--model", str(qwen3_ckpt), "--port", "0",
                         "--enable-return-routed-experts",
                         "--disaggregation-mode", "decode"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "--enable-return-routed-experts" in err and "--disaggregation-mode decode" in err
    assert "Traceback" not in err and time.monotonic() - started < 30, err
