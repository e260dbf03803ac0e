"""FP8 block-quantized checkpoints (`quant.fp8`): DeepSeek-V3 / Qwen3-FP8 layout, served
dequantized, against transformers 5.24's own FP8 dequantization of the same checkpoint.

The oracle is `AutoModelForCausalLM.from_pretrained(..., quantization_config=
FineGrainedFP8Config(dequantize=True))`, which runs on a CPU: transformers' FP8 quantizer only
checks that `accelerate` is importable (it is not installed here, and the dequantize path never
uses it), so the fixtures patch that one check.

The tiny checkpoint's dims (64, 32, 96) are all multiples of 32, so it is written with
`weight_block_size [32, 32]`: transformers' load-time dequantization (`Fp8Dequantize`) infers
the block from the scale grid (rows // grid rows), which is only right when no edge block is
partial. Partial edge blocks and the [128, 128] arithmetic are tested on standalone tensors
against a float64 reference and transformers' `_dequantize_fp8_weight` (which handles them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import greedy_generate
from safetensors.torch import load_file, save_file

from moe_engine import LLM, SamplingParams
from moe_engine.errors import StartupError
from moe_engine.models import resolve_quant_config
from moe_engine.models.loader import cast_floating, iterate_weights
from moe_engine.startup.config import QuantConfig
from quant.fp8 import (
    FP8_DTYPE,
    Fp8BlockConfig,
    dequantize_fp8_block,
    dequantize_fp8_weights,
    parse_fp8_config,
    quantize_fp8_block,
)

BLOCK = (32, 32)


def _fp8_config(block=BLOCK, **extra) -> dict:
    """quantization_config as the hub ships it (Qwen3-30B-A3B-FP8 / DeepSeek-V3 fields)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
        **extra,
    }


def _quantizable(name: str, w: torch.Tensor) -> bool:
    """The Linear weights an FP8 release quantizes: not embeddings, lm_head or router gates."""
    return (
        name.endswith(".weight") and w.dim() == 2 and "embed_tokens" not in name
        and not name.startswith("lm_head") and ".mlp.gate." not in name
    )


def make_fp8_checkpoint(ckpt: Path, out: Path, *, fused_experts: bool = False) -> Path:
    """A copy of a float32 Qwen3-MoE checkpoint with its Linear weights e4m3 in 32 x 32
    blocks (`X.weight` float8_e4m3fn + `X.weight_scale_inv` float32) and config.json's
    quantization_config; with `fused_experts`, the experts are stored as transformers' fused
    `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] with `<name>_scale_inv`.
    """
    if (out / "config.json").is_file():
        return out
    shutil.copytree(ckpt, out)
    tensors = load_file(out / "model.safetensors")
    stored: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int, str], torch.Tensor] = {}
    for name, w in tensors.items():
        if fused_experts and ".mlp.experts." in name:
            prefix, _, rest = name.partition(".experts.")
            expert, proj, _ = rest.split(".")
            experts[prefix, int(expert), proj] = w
        elif _quantizable(name, w):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_block(w, BLOCK)
        else:
            stored[name] = w
    for prefix in sorted({p for p, _, _ in experts}):
        count = 1 + max(e for p, e, _ in experts if p == prefix)
        gate_up = torch.stack([
            torch.cat([experts[prefix, e, "gate_proj"], experts[prefix, e, "up_proj"]])
            for e in range(count)
        ])
        down = torch.stack([experts[prefix, e, "down_proj"] for e in range(count)])
        for proj, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            name = f"{prefix}.experts.{proj}"
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_block(w, BLOCK)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _fp8_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def fp8_ckpt(qwen3_ckpt: Path, tmp_path_factory) -> Path:
    return make_fp8_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("fp8") / "qwen3-fp8")


@pytest.fixture(scope="module")
def hf_fp8_model(fp8_ckpt: Path):
    """transformers' own FP8 loading of the checkpoint, dequantized (float32)."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
        model = AutoModelForCausalLM.from_pretrained(
            fp8_ckpt, dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK),
        )
    return model.eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 7, 33, 90)]


def _reference_dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """float64, one block at a time (the format's definition, no broadcasting tricks)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    b0, b1 = block
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            rows, cols = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            out[..., rows, cols] = q[..., rows, cols].double() * s[..., i, j, None, None].double()
    return out


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_128_blocks_with_partial_edges_equal_the_reference(scale_dtype) -> None:
    """[128, 128] blocks on [300, 200]: scale grid [3, 2], the last row and column blocks
    partial; float32 results are the correctly rounded float64 products, equal to
    transformers' `_dequantize_fp8_weight`, and within e4m3's precision of the original."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)
    q, s = quantize_fp8_block(w, (128, 128))
    assert q.dtype == FP8_DTYPE and s.shape == (3, 2) and s.dtype == torch.float32
    s = s.to(scale_dtype)
    ours = dequantize_fp8_block("w", q, s, (128, 128), torch.float32)
    assert torch.equal(ours, _reference_dequant(q, s, (128, 128)).float())
    assert torch.equal(ours, _dequantize_fp8_weight(q, s, [128, 128], torch.float32))
    if scale_dtype == torch.float32:  # e4m3: 3 mantissa bits, relative error <= 2^-4
        amax = _reference_dequant(torch.ones_like(w), s * 448, (128, 128))
        assert bool(((w - ours).abs() <= amax / 16).all())
    bf16 = dequantize_fp8_block("w", q, s, (128, 128), torch.bfloat16)
    assert torch.equal(bf16, ours.bfloat16())  # one rounding, from the float32 product


def test_stacked_experts_and_non_square_blocks() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 40, 24, generator=g)
    q, s = quantize_fp8_block(w, (16, 32))
    assert s.shape == (3, 3, 1)
    ours = dequantize_fp8_block("x", q, s, (16, 32), torch.float32)
    assert torch.equal(ours, _reference_dequant(q, s, (16, 32)).float())


def test_stream_pairs_weights_and_scales_in_any_order() -> None:
    g = torch.Generator().manual_seed(5)
    a, sa = quantize_fp8_block(torch.randn(8, 8, generator=g), (4, 4))
    b, sb = quantize_fp8_block(torch.randn(2, 8, 8, generator=g), (4, 4))
    norm = torch.ones(8)
    stream = [
        ("m.a.weight_scale_inv", sa), ("norm.weight", norm), ("m.experts.gate_up_proj", b),
        ("m.a.weight", a), ("m.experts.gate_up_proj_scale_inv", sb),
    ]
    out = dict(dequantize_fp8_weights(stream, Fp8BlockConfig((4, 4)), torch.float32))
    assert list(out) == ["norm.weight", "m.a.weight", "m.experts.gate_up_proj"]
    assert out["norm.weight"] is norm
    assert torch.equal(out["m.a.weight"], _reference_dequant(a, sa, (4, 4)).float())
    assert torch.equal(out["m.experts.gate_up_proj"], _reference_dequant(b, sb, (4, 4)).float())


def test_engine_weights_equal_transformers_fp8_dequantization(
    fp8_ckpt, hf_fp8_model, tmp_path
) -> None:
    """Every tensor the loader yields equals transformers' dequantized parameter bit for bit,
    and every parameter of the engine's model equals the engine loading transformers'
    dequantized model saved back as float32."""
    stream = dequantize_fp8_weights(
        iterate_weights(fp8_ckpt, None, progress=False),
        parse_fp8_config(json.loads((fp8_ckpt / "config.json").read_text())),
        torch.float32,
    )
    hf = hf_fp8_model.state_dict()
    quantized = 0
    for name, tensor in cast_floating(stream, torch.float32):
        prefix, experts, rest = name.partition(".experts.")
        if experts:  # transformers fuses experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            expert, proj, _ = rest.split(".")
            if proj == "down_proj":
                want = hf[f"{prefix}.experts.down_proj"][int(expert)]
            else:
                gate, up = hf[f"{prefix}.experts.gate_up_proj"][int(expert)].chunk(2)
                want = gate if proj == "gate_proj" else up
        else:
            want = hf[name]
        assert torch.equal(tensor, want), name
        quantized += _quantizable(name, tensor)
    assert quantized == 3 * 4 + 2 * 8 * 3 + 3  # q/k/v/o x 3 layers, 2 MoE layers x 8 x 3, dense
    hf_fp8_model.save_pretrained(tmp_path / "hf-dequantized")
    ours = LLM(model=str(fp8_ckpt), max_model_len=128).engine.model.state_dict()
    theirs = LLM(model=str(tmp_path / "hf-dequantized"), max_model_len=128).engine.model
    theirs = theirs.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_greedy_ids_equal_transformers_on_its_fp8_dequantization(fp8_ckpt, hf_fp8_model, caplog):
    prompts = _prompts()
    expected = greedy_generate(hf_fp8_model, prompts, 8)
    with caplog.at_level("INFO", logger="moe_engine.models.build"):
        llm = LLM(model=str(fp8_ckpt), max_model_len=256)
    assert "FP8 block-quantized checkpoint (e4m3" in caplog.text  # the startup log says so
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_fused_expert_layout_loads(fp8_ckpt, qwen3_ckpt, tmp_path) -> None:
    """transformers' fused layout (`experts.gate_up_proj` + `gate_up_proj_scale_inv`): the
    engine's experts are exactly those tensors dequantized."""
    fused = make_fp8_checkpoint(qwen3_ckpt, tmp_path / "fused", fused_experts=True)
    stored = load_file(fused / "model.safetensors")
    model = LLM(model=str(fused), max_model_len=128).engine.model
    params = dict(model.named_parameters())
    checked = 0
    for name, tensor in stored.items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            want = _reference_dequant(tensor, stored[name + "_scale_inv"], BLOCK).float()
            layer = name.split(".experts.")[0]
            ours = params[f"{layer}.{'w13' if name.endswith('gate_up_proj') else 'w2'}"]
            assert torch.equal(ours, want), name
            checked += 1
    assert checked == 4  # 2 MoE layers x (gate_up, down)


def _requantized(hf_model, method: str):
    """A copy of transformers' model with its experts quantized to 4 bits and back (what the
    engine's load-time quantization of the dequantized experts computes with)."""
    import copy

    from quant.int4 import dequantize_int4, quantize_int4
    from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                if method == "int4":
                    packed, scales, _ = quantize_int4(param, 32, symmetric=True)
                    param.copy_(dequantize_int4(packed, scales, None, dtype=torch.float32))
                else:
                    param.copy_(dequantize_mxfp4(*quantize_mxfp4(param), dtype=torch.float32))
    return model


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
def test_requantized_experts_serve_like_transformers(fp8_ckpt, hf_fp8_model, method):
    """--quantization int4|mxfp4 re-quantizes the dequantized experts to 4 bits at load time.
    Against transformers' FP8 dequantization with the same 4-bit rounding of its experts:
    first greedy tokens equal on every prompt, last logits within 2% (int4's CPU path takes
    bfloat16 activations). (Against the FP8 dequantization alone the tiny model's first tokens
    differ often: its 0.5-scale random weights make 4-bit rounding move the logits a lot.)"""
    prompts = _prompts()
    reference = _requantized(hf_fp8_model, method)
    llm = LLM(model=str(fp8_ckpt), max_model_len=256, quantization=method, quant_group_size=32)
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    for prompt in prompts:
        captured.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ours = captured[0][0]
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            ref = reference(ids).logits[0, -1]
        assert int(ours.argmax()) == int(ref.argmax())
        assert (ours - ref).norm() / ref.norm() < 2e-2
    moe = next(m for m in llm.engine.model.modules() if getattr(m, "quantized", None))
    assert moe.quantized.method == method and not hasattr(moe, "w13")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fmt", "e5m2", "fmt 'e5m2'"),
        ("activation_scheme", "static", "activation_scheme 'static'"),
        ("weight_block_size", [128], r"weight_block_size \[128\]"),
        ("weight_block_size", None, "weight_block_size None"),
        ("weight_block_size", [128, 1.5], "must be two positive ints"),
        ("scale_fmt", "e4m3", "scale_fmt 'e4m3'"),
        ("expert_dtype", "fp4", "expert_dtype 'fp4'"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(field, value, match) -> None:
    hf = {"quantization_config": _fp8_config(**{field: value})}
    with pytest.raises(ValueError, match=match):
        parse_fp8_config(hf)
    with pytest.raises(ValueError, match=match):
        resolve_quant_config(QuantConfig(), hf)


def test_config_parsing() -> None:
    cfg = parse_fp8_config({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "DYNAMIC", "ignored_layers": ["lm_head"]}})
    assert cfg == Fp8BlockConfig((128, 128), "float", ("lm_head",))
    assert parse_fp8_config({"quantization_config": {"quant_method": "mxfp4"}}) is None
    hf = {"quantization_config": _fp8_config(), "hidden_size": 64}
    assert resolve_quant_config(QuantConfig("auto"), hf) == QuantConfig("none")


def test_bad_tensors_are_refused_naming_them() -> None:
    cfg = Fp8BlockConfig((4, 4))
    q, s = quantize_fp8_block(torch.randn(8, 12), (4, 4))

    def run(stream):
        return list(dequantize_fp8_weights(stream, cfg, torch.float32))

    with pytest.raises(ValueError, match="'m.weight' lacks 'm.weight_scale_inv'"):
        run([("m.weight", q)])
    with pytest.raises(ValueError, match="'m.weight_scale_inv'.*no float8_e4m3fn 'm.weight'"):
        run([("m.weight_scale_inv", s), ("m.weight", q.float())])
    with pytest.raises(ValueError, match=r"m.weight_scale_inv has shape \(2, 2\).*\(2, 3\)"):
        run([("m.weight", q), ("m.weight_scale_inv", s[:, :2])])
    with pytest.raises(ValueError, match="m.weight is torch.float8_e5m2"):
        run([("m.weight", q.float().to(torch.float8_e5m2))])
    with pytest.raises(ValueError, match="m.input_scale: static activation scales"):
        run([("m.input_scale", torch.ones(()))])
    with pytest.raises(ValueError, match="'m.weight' is torch.float8_e4m3fn"):
        list(cast_floating([("m.weight", q)], torch.float32))


def test_checkpoint_refusals_are_startup_errors(fp8_ckpt, tmp_path) -> None:
    """Before loading weights: an unsupported config, or a 4-bit group that does not divide
    the experts (naming the flag); while loading: float8 tensors without an fp8 config."""
    static = tmp_path / "static"
    shutil.copytree(fp8_ckpt, static)
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match="activation_scheme 'static'"):
        LLM(model=str(static), max_model_len=64)
    with pytest.raises(StartupError, match="--quant-group-size 64"):
        LLM(model=str(fp8_ckpt), max_model_len=64, quantization="int4", quant_group_size=64)
    del config["quantization_config"]
    (static / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match="is torch.float8_e4m3fn: FP8 weights"):
        LLM(model=str(static), max_model_len=64)


def test_transformers_written_fp8_checkpoint_loads(fp8_ckpt, tmp_path) -> None:
    """The layout transformers 5.24 itself writes for an FP8 model (`save_pretrained` of the
    checkpoint loaded pre-quantized, FP8Linear / FP8Experts holding the e4m3 tensors): per-
    expert `experts.E.gate_proj.weight` + `weight_scale_inv` (its conversion mapping splits
    the fused `gate_up_proj_scale_inv` back), and a quantization_config with transformers'
    extra fields (dequantize, scale_fmt, expert_dtype, modules_to_convert: None). Loading it
    pre-quantized on a CPU needs its GPU check skipped; nothing runs an FP8 kernel."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
        mp.setattr(fp8_quantizer.FineGrainedFP8HfQuantizer, "validate_environment",
                   lambda self, *args, **kwargs: None)
        model = AutoModelForCausalLM.from_pretrained(
            fp8_ckpt, dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=False, weight_block_size=BLOCK),
        )
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    model.save_pretrained(tmp_path / "written")
    written = load_file(tmp_path / "written" / "model.safetensors")
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert written[name].dtype == FP8_DTYPE and name + "_scale_inv" in written
    config = json.loads((tmp_path / "written" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    ours = LLM(model=str(tmp_path / "written"), max_model_len=64).engine.model.state_dict()
    want = LLM(model=str(fp8_ckpt), max_model_len=64).engine.model.state_dict()
    assert all(torch.equal(ours[n], want[n]) for n in want)


def test_experts_of_other_ranks_are_skipped_with_their_scales(fp8_ckpt) -> None:
    """Under expert parallelism the loader never reads another rank's experts
    (`wants_weight`): their scales are skipped with them, so nothing is left unpaired."""
    config = parse_fp8_config(json.loads((fp8_ckpt / "config.json").read_text()))
    stream = iterate_weights(
        fp8_ckpt, None, progress=False, wants=lambda n: ".experts.3." not in n
    )
    names = [n for n, _ in dequantize_fp8_weights(stream, config, torch.float32)]
    assert not any(".experts.3." in n for n in names)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in names


def test_ue8m0_scales_as_bytes_or_floats() -> None:
    """scale_fmt "ue8m0" (DeepSeek-V3.1): power-of-two scales, stored as float32 or as E8M0
    bytes (2 ** (byte - 127)); bytes under scale_fmt "float" are refused."""
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(8, 8, generator=g) * 50).to(FP8_DTYPE)
    exponents = torch.randint(120, 135, (2, 2), generator=g)
    as_float = torch.exp2(exponents.float() - 127)
    want = _reference_dequant(q, as_float, (4, 4)).float()
    as_bytes = exponents.to(torch.uint8)
    assert torch.equal(dequantize_fp8_block("w", q, as_bytes, (4, 4), torch.float32, "ue8m0"), want)
    assert torch.equal(dequantize_fp8_block("w", q, as_float, (4, 4), torch.float32, "ue8m0"), want)
    with pytest.raises(ValueError, match="w_scale_inv has dtype torch.uint8"):
        dequantize_fp8_block("w", q, as_bytes, (4, 4), torch.float32)
