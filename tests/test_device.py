"""--device: resolution and its startup error, the runner's persistent step-input buffers, and
(with a CUDA device) the engine on the GPU against transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
from fixtures import hf_greedy

from moe_engine import LLM, SamplingParams
from moe_engine.cli.serve import main as serve_main
from moe_engine.core.device import engine_device
from moe_engine.errors import StartupError
from moe_engine.request import Request
from moe_engine.runner.step_inputs import StepInputBuffers
from moe_engine.startup.config import DeviceConfig, EngineConfig, ModelConfig

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_exits_1_with_one_line(qwen3_ckpt, capsys) -> None:
    assert serve_main(["--model", str(qwen3_ckpt), "--device", "cuda", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("moe-serve: error: --device cuda:") and "--device cpu" in err


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_offline_api_refuses_cuda_without_cuda(qwen3_ckpt) -> None:
    with pytest.raises(StartupError, match="--device cuda: torch sees no CUDA device"):
        LLM(model=str(qwen3_ckpt), device="cuda", max_model_len=64)


def test_auto_is_cuda_exactly_when_torch_sees_one(qwen3_ckpt) -> None:
    config = EngineConfig(ModelConfig(str(qwen3_ckpt)), device=DeviceConfig("auto"))
    assert engine_device(config).type == ("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda; got 'tpu'"):
        DeviceConfig("tpu")


def test_step_input_buffers_are_filled_in_place() -> None:
    buffers = StepInputBuffers(torch.device("cpu"), pin_memory=False)
    whole = buffers.reserve("input_ids", 64)
    for n in (5, 64, 1, 17):
        host = torch.arange(n, dtype=torch.int64) * 3 + n
        out = buffers.put("input_ids", host)
        assert torch.equal(out, host) and out.data_ptr() == whole.data_ptr()
    a, b, c = buffers.put_many("batch", [torch.arange(3), torch.ones(2, 2, dtype=torch.int64),
                                         torch.tensor([7])])
    assert a.tolist() == [0, 1, 2] and b.tolist() == [[1, 1], [1, 1]] and c.tolist() == [7]
    grown = buffers.put("input_ids", torch.arange(100))  # outgrown: a larger buffer
    assert torch.equal(grown, torch.arange(100))


def test_staged_inputs_give_the_same_tokens_across_step_sizes(qwen3_ckpt) -> None:
    """The runner's device path (persistent buffers, one copy per tensor) on this CPU: steps
    of many sizes (decodes, prefill chunks, both, preemption) give the plain path's tokens."""
    prompts = _prompts(512, [1, 3, 17, 40, 70, 5])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    kwargs = dict(max_model_len=160, max_num_batched_tokens=24, num_blocks_override=10)
    plain = LLM(model=str(qwen3_ckpt), device="cpu", **kwargs)
    want = plain.generate(prompts, params, use_tqdm=False)
    staged = LLM(model=str(qwen3_ckpt), device="cpu", **kwargs)
    buffers = StepInputBuffers(torch.device("cpu"), pin_memory=False)
    staged.engine.runner.input_buffers = buffers
    staged.engine.runner.reserve_inputs(24, 64, 160)
    fixed = buffers._device["input_ids"].data_ptr()
    got = staged.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert {"input_ids", "positions", "slot_mapping.0", "block_tables.0"} <= set(buffers._device)
    assert buffers._device["input_ids"].data_ptr() == fixed  # reserved: never reallocated
    assert staged.engine.get_stats().num_preemptions > 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_greedy_matches_transformers(qwen3_ckpt) -> None:
    prompts = _prompts(512, [1, 7, 17, 40, 129])
    expected = hf_greedy(qwen3_ckpt, prompts, 8)
    llm = LLM(model=str(qwen3_ckpt), device="cuda", max_model_len=320,
              max_num_batched_tokens=32, num_blocks_override=22)
    assert llm.engine.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in llm.engine.model.parameters())
    cache = llm.engine.runner.kv_caches[0]
    assert (cache if isinstance(cache, torch.Tensor) else cache[0]).device.type == "cuda"
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.get_stats().num_preemptions > 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_kv_cache_is_sized_by_gpu_memory_utilization(qwen3_ckpt) -> None:
    llm = LLM(model=str(qwen3_ckpt), device="cuda", max_model_len=256,
              gpu_memory_utilization=0.05)
    plan = llm.engine.plan
    assert plan.kv_cache_source == "gpu_memory_utilization 0.05"
    assert plan.num_blocks >= plan.blocks_per_request(256)
    text = plan.describe()
    assert "activations peak" in text and "concurrent tokens" in text
    budget = 0.05 * torch.cuda.mem_get_info()[1]
    assert plan.kv_cache_memory <= budget
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@needs_cuda
def test_cuda_step_inputs_and_sampling_sync_once(qwen3_ckpt) -> None:
    """The runner's input copies never sync; the sampler reads ids and logprobs back in one
    copy (torch's sync debug mode warns on every synchronizing call)."""
    llm = LLM(model=str(qwen3_ckpt), device="cuda", max_model_len=128, num_blocks_override=16)
    runner = llm.engine.runner
    step = runner.inputs.host_inputs([1, 2, 3, 4], torch.tensor([1, 3]), torch.tensor([5, 0]),
                               [[[1], [2]]])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.inputs.on_device(step, torch.tensor([0, 3]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits = torch.randn(3, 512, device="cuda")
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=0, logprobs=2))
                for i in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = runner.sampler(logits, requests)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert out.token_ids == logits.argmax(-1).tolist()
