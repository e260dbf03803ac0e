"""The model is built on the meta device and its weights stream onto the engine's device
(`moe_engine.models.materialize`, `loader.load_model`): no parameter storage before loading,
float experts allocated only when their tensors arrive and quantized layer by layer, computed
buffers (rotary caches) made again exactly, and nothing left on meta without an error.

Greedy tokens through this path against transformers: tests/test_hf_oracle.py and the other
end-to-end tests (every engine build takes it)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.models import build as build_mod
from moe_engine.models import resolve_quant_config
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.rotary import RotaryEmbedding, YarnScaling
from moe_engine.models.materialize import materialize, meta_tensors, on_meta
from moe_engine.startup.config import EngineConfig, ModelConfig
from moe_engine.startup.quant_config import QuantConfig


def _config(ckpt, method: str = "none") -> EngineConfig:
    config = EngineConfig(
        ModelConfig(str(ckpt), max_model_len=64), quant=QuantConfig(method=method, group_size=32)
    )
    quant = resolve_quant_config(config.quant, config.model.hf_config(), torch.float32)
    return EngineConfig(config.model, quant=quant, kernel_backend="torch")


def _float_stacks(model) -> int:
    """MoE blocks holding float expert stacks with storage (not meta, not dropped)."""
    return sum(
        1
        for _, moe in model.moe_layers()
        if getattr(moe, "w13", None) is not None and not moe.w13.is_meta
    )


def test_built_on_meta_then_loaded_with_experts_allocated_as_they_arrive(
    qwen3_ckpt, monkeypatch
) -> None:
    """At the materialize hook every parameter and buffer is on meta (no storage at all);
    after it, every parameter has storage on the device except the float expert stacks, which
    the loader allocates when their first tensor arrives; after loading nothing is meta."""
    seen: dict[str, object] = {}
    real_materialize = build_mod.materialize

    def spy_materialize(model, device):
        tensors = [*model.parameters(), *model.buffers()]
        seen["all_meta"] = bool(tensors) and all(t.is_meta for t in tensors)
        real_materialize(model, device)
        seen["after"] = meta_tensors(model)

    monkeypatch.setattr(build_mod, "materialize", spy_materialize)
    built = build_mod.build_model(_config(qwen3_ckpt))
    assert seen["all_meta"]
    assert seen["after"] and all(n.endswith((".w13", ".w2")) for n in seen["after"])
    assert meta_tensors(built.model) == []
    rotary = built.model.model.layers[0].self_attn.rotary
    host = RotaryEmbedding(rotary.head_dim, 64, rotary.base)
    assert torch.equal(rotary.cos_cache, host.cos_cache)


def test_quantization_happens_layer_by_layer(qwen3_ckpt, monkeypatch) -> None:
    """With --quantization int4 each MoE block is quantized as soon as its float experts are
    in, so at most one block holds float stacks at a time (the device peak: the quantized
    model plus one layer of float experts)."""
    held: list[int] = []
    real = build_mod.quantize_complete_layer

    def spy(moe: FusedMoE, config: EngineConfig) -> None:
        held.append(_float_stacks(model_ref[0]))
        real(moe, config)

    model_ref: list = []
    real_materialize = build_mod.materialize

    def keep(model, device):
        model_ref.append(model)
        real_materialize(model, device)

    monkeypatch.setattr(build_mod, "materialize", keep)
    monkeypatch.setattr(build_mod, "quantize_complete_layer", spy)
    built = build_mod.build_model(_config(qwen3_ckpt, "int4"))
    moe_layers = built.model.moe_layers()
    assert len(held) == len(moe_layers) == 2
    assert max(held) == 1
    assert all(moe.quantized is not None for _, moe in moe_layers)
    assert meta_tensors(built.model) == []


@pytest.mark.parametrize("method", ["none", "int4"])
def test_a_missing_expert_is_named_not_left_on_meta(qwen3_ckpt, tmp_path, method) -> None:
    """A checkpoint without one expert tensor: loading fails naming it (its layer's float
    stacks were never complete, so they are neither quantized nor left silently)."""
    dropped = "model.layers.2.mlp.experts.5.down_proj.weight"
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StartupError, match=dropped.replace(".", r"\.")):
        build_mod.build_model(_config(broken, method))


@pytest.mark.parametrize(
    "yarn", [None, YarnScaling(factor=4.0, original_max_position_embeddings=32)]
)
def test_rotary_caches_are_computed_again_exactly(yarn) -> None:
    with on_meta():
        rotary = RotaryEmbedding(16, 128, 10000.0, yarn=yarn)
    assert rotary.cos_cache.is_meta
    materialize(rotary, torch.device("cpu"))
    host = RotaryEmbedding(16, 128, 10000.0, yarn=yarn)
    assert torch.equal(rotary.cos_cache, host.cos_cache)
    assert torch.equal(rotary.sin_cache, host.sin_cache)


def test_tied_parameters_stay_one_tensor() -> None:
    with on_meta():
        model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    model["head"].weight = model["embed"].weight
    materialize(model, torch.device("cpu"))
    assert model["head"].weight is model["embed"].weight
    assert not model["head"].weight.is_meta


def test_a_computed_buffer_without_a_way_to_compute_it_is_refused() -> None:
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with on_meta():
        module = Cached()
    with pytest.raises(StartupError, match=r"Cached .*\['table'\].*materialize_buffers"):
        materialize(module, torch.device("cpu"))


def test_building_on_meta_imports_no_symbolic_machinery(qwen3_ckpt) -> None:
    """Arithmetic on meta tensors imports torch's symbolic shapes and sympy (~150 MB
    resident): building and materializing must not do any (a fresh process, so the test
    session's own imports do not hide it)."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from moe_engine.models.build import build_on_meta, read_architecture
from moe_engine.models.materialize import materialize
_, _, cls, spec = read_architecture({str(qwen3_ckpt)!r})
before = "sympy" in sys.modules
materialize(build_on_meta(cls, spec, torch.float32, 64, None), torch.device("cpu"))
print(before, "sympy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout
