"""INT4 experts with 16-bit scales (bfloat16 / float16), kept in that dtype end to end.

The native kernel reads the scales as stored and widens them in registers (csrc/moe_cpu.cpp
`load_scales`), so it is checked against the float64 reference on the same dequantized values
(`kernels.moe.reference.fused_moe_reference`, as tests/test_native_moe_4bit.py does for float32
scales); `quant.int4.quantize_int4(scale_dtype=...)` keeps its error bound for the stored
scale; and a group of 32 costs 4 + 16 / 32 = 4.5 bits per weight, in the plan's arithmetic
(`QuantConfig.bits_per_weight`) and in the bytes the model holds (`weight_bytes_by_kind`).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import make_tiny_checkpoint
from safetensors.torch import load_file

from kernels.moe.native import PackedQuantExperts
from kernels.moe.reference import fused_moe_reference
from kernels.native.library import _build
from moe_engine import LLM, SamplingParams
from moe_engine.models import resolve_quant_config
from moe_engine.startup.config import QuantConfig
from quant.int4 import Int4Weight, dequantize_int4, quantize_int4

SIXTEEN_BIT = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    _build("moe_cpu")  # a build failure is a test failure


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _experts(g, e, h, inter, group, symmetric, scale_dtype):
    """(packed experts, float64 dequantized w13 and w2) with scales stored in `scale_dtype`."""
    lists, deq = [], []
    for w in (torch.randn(e, 2 * inter, h, generator=g) / h**0.5,
              torch.randn(e, h, inter, generator=g) / inter**0.5):
        packed, scales, zeros = quantize_int4(w, group, symmetric, scale_dtype=scale_dtype)
        assert scales.dtype == scale_dtype
        lists.append([Int4Weight(packed[i], scales[i], None if zeros is None else zeros[i])
                      for i in range(e)])
        deq.append(dequantize_int4(packed, scales, zeros, dtype=torch.float64))
    return PackedQuantExperts.from_int4(*lists), *deq


@pytest.mark.parametrize("scale_dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("t", "group"), [(1, 32), (2, 32), (5, 64), (40, 128), (9, 8)])
def test_kernel_with_16bit_scales_matches_float64_reference(scale_dtype, symmetric, t, group):
    """Rows 1-2 (block-scaled), 3-6 (weight-scaled), > 6 (tile dequantized); groups of 8 with
    H = 40, I = 24 also exercise padded tiles."""
    g = _gen()
    h, inter, e, k = (40, 24, 5, 2) if group == 8 else (256, 128, 6, 2)
    packed, d13, d2 = _experts(g, e, h, inter, group, symmetric, scale_dtype)
    assert packed.w13_scales.dtype == scale_dtype and packed.w2_scales.dtype == scale_dtype
    hidden = torch.randn(t, h, generator=g)
    topk_weights, topk_ids = torch.softmax(torch.randn(t, e, generator=g), -1).topk(k, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    got = packed(hidden, topk_weights, topk_ids)
    want = fused_moe_reference(hidden.double(), d13, d2, topk_weights, topk_ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scale_dtype", SIXTEEN_BIT)
def test_packing_keeps_16bit_scales_and_round_trips(scale_dtype):
    g = _gen()
    packed, *_ = _experts(g, 3, 64, 32, 32, True, scale_dtype)
    w13, w2 = packed.to_int4()
    assert {w.scales.dtype for w in (*w13, *w2)} == {scale_dtype}
    again = PackedQuantExperts.from_int4(w13, w2)
    assert torch.equal(again.w13_scales, packed.w13_scales)
    # codes 4 bits + one 16-bit scale per 32 values: 4.5 bits per weight
    weights = 3 * (2 * 32 * 64 + 64 * 32)
    assert packed.nbytes == weights * 4.5 / 8


@pytest.mark.parametrize("scale_dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_error_bound_holds_for_the_stored_scale(scale_dtype, symmetric):
    g = _gen()
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 256)
    packed, scales, zeros = quantize_int4(w, 32, symmetric, scale_dtype=scale_dtype)
    deq = dequantize_int4(packed, scales, zeros, dtype=torch.float32)
    err = (w - deq).abs().reshape(64, 8, 32).amax(-1)
    assert bool((err <= scales.float() * (0.5 + 1e-6)).all())


def test_16bit_scale_refusals():
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_int4(torch.randn(4, 32), 32, scale_dtype=torch.float64)
    with pytest.raises(ValueError, match="overflows torch.float16"):
        quantize_int4(torch.full((2, 32), 1e6), 32, scale_dtype=torch.float16)


def test_bits_per_weight_counts_the_scale_dtype_and_zero_points():
    assert QuantConfig("int4", 32, scale_dtype="bfloat16").bits_per_weight == 4.5
    assert QuantConfig("int4", 128, scale_dtype="float16").bits_per_weight == 4.125
    assert QuantConfig("int4", 32).bits_per_weight == 5.0  # float32 scales
    asym = QuantConfig("int4", 32, symmetric=False, scale_dtype="bfloat16")
    assert asym.bits_per_weight == 4 + (16 + 8) / 32  # a uint8 zero point per group too
    with pytest.raises(ValueError, match="scale_dtype 'int8'"):
        QuantConfig("int4", 32, scale_dtype="int8")
    hf = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
          "vocab_size": 512, "intermediate_size": 96, "num_experts_per_tok": 2}
    resolved = resolve_quant_config(QuantConfig("int4", 32), hf, weight_dtype=torch.bfloat16)
    assert resolved.scale_dtype == "bfloat16" and resolved.bits_per_weight == 4.5
    resolved = resolve_quant_config(QuantConfig("int4", 32), hf, weight_dtype=torch.float32)
    assert resolved.scale_dtype == "float32"


@pytest.fixture(scope="module")
def bf16_ckpt(tiny_ckpt_root):
    return make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root, dtype=torch.bfloat16)


def _int4_reference_copy(ckpt, root):
    """The bfloat16 checkpoint as float32 with every routed expert replaced by its int4
    (group 32, bfloat16 scales) quantize -> dequantize, exactly (float32 holds each value)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = root / f"{ckpt.name}-int4-bf16-scales-deq"
    shutil.copytree(ckpt, out)
    tensors = {n: w.float() for n, w in load_file(out / "model.safetensors").items()}
    for name, w in tensors.items():
        if ".experts." in name:
            packed, scales, _ = quantize_int4(w, 32, True, scale_dtype=torch.bfloat16)
            tensors[name] = dequantize_int4(packed, scales, None, dtype=torch.float32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_bf16_checkpoint_int4_experts_keep_bf16_scales(bf16_ckpt, tmp_path, monkeypatch):
    """Load-time int4 of a bfloat16 checkpoint: scales in bfloat16, 4.5 bits per weight at
    group 32 in the plan and in the model's bytes; last logits within 1e-4 (relative norm) of
    transformers on the same int4 values, greedy first tokens equal. The engine computes in
    float32 here, as on a CPU without native bfloat16 (forced, so that the comparison measures
    the stored values rather than bfloat16 arithmetic)."""
    from fixtures import hf_last_logits

    monkeypatch.setattr("moe_engine.startup.env.native_bf16_matmul", lambda: False)
    llm = LLM(model=str(bf16_ckpt), max_model_len=128, quantization="int4", quant_group_size=32)
    engine = llm.engine
    spec = engine.spec
    weights = len(spec.moe_layers) * spec.num_experts * 3 * spec.hidden_size * (
        spec.moe_intermediate_size)
    assert engine.config.quant.scale_dtype == "bfloat16"
    assert engine.plan.weight_bytes_experts == weights * 4.5 / 8
    assert engine.model.weight_bytes_by_kind()["experts"] == weights * 4.5 / 8
    moe = next(m for m in engine.model.modules() if getattr(m, "quantized", None))
    assert moe.quantized.canonical().w13_scales.dtype == torch.bfloat16
    ref_ckpt = _int4_reference_copy(bf16_ckpt, tmp_path)
    captured: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    g = torch.Generator().manual_seed(11)
    for n in (1, 8, 30, 70):
        prompt = torch.randint(3, 512, (n,), generator=g).tolist()
        captured.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ours, ref = captured[0][0], hf_last_logits(ref_ckpt, prompt)
        assert (ours - ref).norm() / ref.norm() < 1e-4
        assert int(ours.argmax()) == int(ref.argmax())


def test_compressed_tensors_group32_bf16_scales_served_as_stored(
    bf16_ckpt, tiny_ckpt_root, monkeypatch
):
    """A compressed-tensors pack-quantized checkpoint with group 32 and bfloat16 scales, as
    Kimi-K2-Thinking ships (written by the compressed-tensors library from a bfloat16
    checkpoint): the scales stay bfloat16 in the native layout, the expert weights equal the
    library's decompression bit for bit, 4.5 bits per weight in the plan and in the model's
    bytes; last logits within 1% of transformers on the library-decompressed (bfloat16)
    weights, engine in float32 (forced, as above)."""
    from fixtures import hf_last_logits
    from test_compressed_tensors import make_compressed_checkpoint

    targets = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    ct, deq = make_compressed_checkpoint(bf16_ckpt, tiny_ckpt_root, True, targets, ["lm_head"])
    monkeypatch.setattr("moe_engine.startup.env.native_bf16_matmul", lambda: False)
    llm = LLM(model=str(ct), max_model_len=128)
    engine = llm.engine
    quant = engine.config.quant
    assert (quant.method, quant.group_size, quant.scale_dtype) == ("int4", 32, "bfloat16")
    spec = engine.spec
    weights = len(spec.moe_layers) * spec.num_experts * 3 * spec.hidden_size * (
        spec.moe_intermediate_size)
    assert quant.bits_per_weight == 4.5
    assert engine.plan.weight_bytes_experts == weights * 4.5 / 8
    assert engine.model.weight_bytes_by_kind()["experts"] == weights * 4.5 / 8
    library = load_file(deq / "model.safetensors")
    for index in sorted(spec.moe_layers):
        canonical = engine.model.model.layers[index].mlp.quantized.canonical()
        assert canonical.w13_scales.dtype == torch.bfloat16
        w13, w2 = canonical.per_expert()
        for e in range(spec.num_experts):
            gate, up = dequantize_int4(*w13[e], dtype=torch.bfloat16).chunk(2)
            down = dequantize_int4(*w2[e], dtype=torch.bfloat16)
            for proj, ours in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                name = f"model.layers.{index}.mlp.experts.{e}.{proj}.weight"
                assert library[name].dtype == torch.bfloat16
                assert torch.equal(ours, library[name]), name
    captured: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    g = torch.Generator().manual_seed(12)
    for n in (1, 8, 30, 70):
        prompt = torch.randint(3, 512, (n,), generator=g).tolist()
        captured.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ours, ref = captured[0][0], hf_last_logits(deq, prompt)
        assert (ours - ref).norm() / ref.norm() < 1e-2
