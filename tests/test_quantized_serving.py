"""`--quantization int4|mxfp4`: the engine on 4-bit experts equals `transformers` serving the
same weights dequantized (so the only difference is the quantization, which is exact to undo)."""

from __future__ import annotations

import shutil

import pytest
import torch
from fixtures import hf_greedy
from safetensors.torch import load_file, save_file

from moe_engine import LLM, SamplingParams
from moe_engine.errors import StartupError
from quant.int4 import dequantize_int4, quantize_int4
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _dequantized_copy(ckpt, root, method: str, group_size: int):
    """The checkpoint with every routed expert tensor replaced by its quantize->dequantize."""
    out = root / f"{ckpt.name}-{method}-deq"
    shutil.copytree(ckpt, out)
    tensors = load_file(out / "model.safetensors")
    for name, w in tensors.items():
        if ".experts." not in name:
            continue
        if method == "int4":
            packed, scales, _ = quantize_int4(w, group_size, symmetric=True)
            tensors[name] = dequantize_int4(packed, scales, None, dtype=w.dtype)
        else:
            tensors[name] = dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
def test_quantized_experts_match_transformers_on_dequantized_weights(
    qwen3_ckpt, tmp_path, method
):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 9, 40, 120)]
    expected = hf_greedy(_dequantized_copy(qwen3_ckpt, tmp_path, method, 32), prompts, 8)
    llm = LLM(model=str(qwen3_ckpt), max_model_len=256, quantization=method, quant_group_size=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    moe = next(m for m in llm.engine.model.modules() if hasattr(m, "quantized") and m.quantized)
    assert not hasattr(moe, "w13")  # the float copy is gone
    spec = llm.engine.spec
    fp32_bytes = 3 * spec.num_experts * spec.hidden_size * spec.moe_intermediate_size * 4
    assert moe.quantized.nbytes <= 0.17 * fp32_bytes  # 4 bits + scales, against 32 bits


def test_group_size_that_does_not_divide_is_a_startup_error(qwen3_ckpt):
    # the tiny experts have moe_intermediate_size 32: w2 groups along 32, so 64 cannot divide it
    with pytest.raises(StartupError, match="64") as err:
        LLM(model=str(qwen3_ckpt), max_model_len=64, quantization="int4", quant_group_size=64)
    assert "32" in str(err.value)
