"""`--quantized-layers all`: the dense projections 4-bit too (moe_engine/models/dense_quant.py,
kernels/dense/native_linear_q4.py), against transformers serving the same checkpoint with those
layers
and the experts replaced by their quantize -> dequantize (the 4-bit kernels decode exactly
those values, so the only difference left is float32 summation order)."""

from __future__ import annotations

import pytest
import torch
from fixtures import dequantized_experts_copy, hf_greedy, hf_last_logits, perturbed_checkpoint

from kernels.dense.linear import NATIVE_MAX_ROWS
from kernels.plan import NATIVE_CPU, KernelPlan
from moe_engine import LLM, SamplingParams
from moe_engine.errors import StartupError
from moe_engine.models.dense_quant import dense_layers
from moe_engine.models.layers.linear import Linear

GROUP = 32


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 9, 40, 120, 300)]


def _llm(ckpt, method: str) -> LLM:
    return LLM(model=str(ckpt), max_model_len=512, quantization=method, quant_group_size=GROUP,
               quantized_layers="all")


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
@pytest.mark.parametrize("ckpt_name", ["qwen3_ckpt", "mixtral_ckpt"])
def test_greedy_ids_and_logits_equal_transformers_on_the_dequantized_layers(
    ckpt_name, method, request, tmp_path
):
    ckpt = request.getfixturevalue(ckpt_name)
    ref = dequantized_experts_copy(ckpt, tmp_path, method, GROUP, dense=True)
    prompts = _prompts()
    llm = _llm(ckpt, method)
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got, first_logits = [], []
    for prompt in prompts:
        captured.clear()
        got.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        first_logits.append(captured[0][0])
    assert got == hf_greedy(ref, prompts, 8)
    for prompt, logits in zip(prompts, first_logits, strict=True):
        want = hf_last_logits(ref, prompt)
        assert (logits - want).norm() / want.norm() < 1e-4
    # batched decode steps give the same tokens as one request at a time
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == got
    _assert_layers_quantized(llm)


def _assert_layers_quantized(llm: LLM) -> None:
    model = llm.engine.model
    layers = dict(dense_layers(model))
    assert "lm_head" in layers and any(n.endswith("self_attn.qkv_proj") for n in layers)
    for name, layer in layers.items():
        assert layer.quant_scheme is not None and layer.kernel.q4, name
        fp32_bytes = layer.weight.numel() * 4
        assert layer.q4_packed().nbytes <= 0.2 * fp32_bytes, name  # 4 bits + a scale per 32
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert routers and all(r.quant_scheme is None for r in routers)


def test_a_weight_update_requantizes_the_dense_layers(qwen3_ckpt, tmp_path):
    """update_weights_from_disk: the 4-bit copies are made again from the new weights."""
    new = perturbed_checkpoint(qwen3_ckpt, tmp_path)
    ref = dequantized_experts_copy(new, tmp_path, "int4", GROUP, dense=True)
    prompts = _prompts()[:3]
    llm = _llm(qwen3_ckpt, "int4")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.update_weights_from_disk(str(new), "v2")
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == hf_greedy(ref, prompts, 6)
    assert after != before


def test_long_batches_run_torch_over_the_same_4bit_values():
    """Beyond NATIVE_MAX_ROWS rows a quantized layer runs torch's GEMM over the dequantized
    4-bit values, not the checkpoint's: the same rows give the same outputs either way."""
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    layer = Linear(64, 48, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=g) / 8)
        layer.bias.copy_(torch.randn(48, generator=g))
    layer.quantize("int4", GROUP, torch.float32)
    layer.bind_kernels(KernelPlan.uniform(NATIVE_CPU))
    x = torch.randn(NATIVE_MAX_ROWS + 3, 64, generator=g)
    long = layer(x)
    short = torch.cat([layer(x[i : i + 8]) for i in range(0, len(x), 8)])
    torch.testing.assert_close(long, short, rtol=1e-5, atol=1e-5)
    full = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert (long - full).abs().max() > 1e-3  # the 4-bit values, not the checkpoint's


def test_flag_errors_name_the_flag(qwen3_ckpt):
    with pytest.raises((ValueError, StartupError), match="--quantized-layers all.*none"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, quantized_layers="all")
    with pytest.raises((ValueError, StartupError), match="--quantization auto"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, quantization="auto",
            quantized_layers="all")
    with pytest.raises((ValueError, StartupError), match="quantized_layers must be one of"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, quantization="int4",
            quantized_layers="attention")


def test_weight_bytes_count_the_4bit_copies_beside_the_weights(qwen3_ckpt):
    """The dense layers keep their weight (for weight updates) and hold a 4-bit copy: the
    reported bytes (ModelInfo's weight_bytes_*) grow by exactly the copies."""
    experts_only = LLM(model=str(qwen3_ckpt), max_model_len=64, quantization="int4",
                       quant_group_size=GROUP).engine.model.weight_bytes_by_kind()
    model = _llm(qwen3_ckpt, "int4").engine.model
    copies = {"attention": 0, "embeddings": 0, "other": 0}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quant_scheme is not None:
            kind = "attention" if ".self_attn." in name else (
                "embeddings" if name == "lm_head" else "other")
            copies[kind] += module.q4_packed().nbytes
    assert copies["attention"] > 0 and copies["embeddings"] > 0
    got = model.weight_bytes_by_kind()
    assert got["experts"] == experts_only["experts"]
    for kind, extra in copies.items():
        assert got[kind] == experts_only[kind] + extra, kind


def test_the_startup_plan_budgets_the_4bit_copies(qwen3_ckpt):
    """The plan (made from config.json before loading) counts the copies, never fewer bytes
    than the loaded model holds, so the KV budget does not take their memory."""
    engines = {layers: LLM(model=str(qwen3_ckpt), max_model_len=64, quantization="int4",
                           quant_group_size=GROUP, quantized_layers=layers).engine
               for layers in ("experts", "all")}
    held = {k: sum(v for kind, v in e.model.weight_bytes_by_kind().items() if kind != "experts")
            for k, e in engines.items()}
    planned = {k: e.plan.weight_bytes_other for k, e in engines.items()}
    assert planned["all"] - planned["experts"] >= held["all"] - held["experts"] > 0
    assert planned["all"] - planned["experts"] <= 1.2 * (held["all"] - held["experts"])
