"""The model layer's contract: the registry (one line per architecture, modules imported by
path), config reading per architecture file, `moe_layers()`, and the shared weight loader
applying each architecture's declarative `weight_mapping`."""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import Qwen3MoeConfig

from moe_engine.errors import StartupError
from moe_engine.models import (
    ARCHITECTURES,
    MoeCausalLM,
    architecture_class,
    model_shape,
    resolve_config_dict,
)
from moe_engine.models.layers.moe import FusedMoE

TINY = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, intermediate_size=48, mlp_only_layers=[1],
    max_position_embeddings=128,
)


def _qwen3() -> MoeCausalLM:
    cls = architecture_class("Qwen3MoeForCausalLM")
    return cls(cls.arch_spec(Qwen3MoeConfig(**TINY)), torch.float32)


def test_every_registered_architecture_is_a_class_of_its_name() -> None:
    for name in ARCHITECTURES:
        cls = architecture_class(name)
        assert issubclass(cls, MoeCausalLM) and cls.__name__ == name
        assert cls.model_types, name  # configs without "architectures" find it by model_type


def test_a_config_without_architectures_is_resolved_by_model_type() -> None:
    name, cls = resolve_config_dict({"model_type": "mixtral"})
    assert name == "MixtralForCausalLM" and cls is architecture_class(name)
    shape = model_shape({**TINY, "model_type": "qwen3_moe"})
    assert shape.architecture == "Qwen3MoeForCausalLM" and shape.moe_layers == (0, 2, 3)
    assert shape.intermediate_size == 48 and shape.qk_norm
    with pytest.raises(StartupError, match="LlamaForCausalLM.*supported: .*Mixtral"):
        model_shape({**TINY, "architectures": ["LlamaForCausalLM"]})


def test_checkpoint_expert_names_and_widths_come_from_the_architecture() -> None:
    mixtral, qwen3 = (architecture_class(n) for n in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"))
    assert mixtral.checkpoint_expert_name(3, 0, "gate") == (
        "model.layers.3.block_sparse_moe.experts.0.w1"
    )
    assert mixtral.checkpoint_expert_name(0, 5, "up").endswith(".block_sparse_moe.experts.5.w3")
    assert qwen3.checkpoint_expert_name(2, 0, "down") == "model.layers.2.mlp.experts.0.down_proj"
    assert mixtral.experts_width_field({}) == "intermediate_size"
    assert qwen3.experts_width_field(TINY) == "moe_intermediate_size"


def test_moe_layers_are_the_spec_layers_in_order() -> None:
    model = _qwen3()
    layers = model.moe_layers()
    assert [i for i, _ in layers] == [0, 2, 3] == list(model.spec.moe_layers)
    assert all(isinstance(m, FusedMoE) and m is model.model.layers[i].mlp for i, m in layers)


def test_stacked_projections_fill_their_rows_and_unknown_names_are_refused() -> None:
    model = _qwen3()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 32, generator=g) for n in (32, 16, 16))
    prefix = "model.layers.2.self_attn"
    loaded = model.load_weights(
        [(f"{prefix}.{x}_proj.weight", t) for x, t in zip("kqv", (k, q, v), strict=True)]
        + [("model.layers.2.mlp.experts.3.up_proj.weight", torch.ones(16, 32))]
    )
    assert loaded == {f"{prefix}.qkv_proj.weight.{x}" for x in "qkv"} | {
        "model.layers.2.mlp.experts.3.up"
    }
    assert torch.equal(model.model.layers[2].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(model.model.layers[2].mlp.w13[3, 16:], torch.ones(16, 32))
    assert f"{prefix}.qkv_proj.weight.k" in model.expected_weight_names()
    with pytest.raises(ValueError, match="gate_up_bias: this MoE layer has no expert biases"):
        model.load_weights([("model.layers.0.mlp.experts.gate_up_proj_bias", torch.ones(4, 32))])
    with pytest.raises(ValueError, match="'model.layers.1.mlp.nope.weight' has no place"):
        model.load_weights([("model.layers.1.mlp.nope.weight", torch.ones(1))])


def test_a_new_architecture_is_one_file_and_one_registry_line(tmp_path, monkeypatch) -> None:
    """A file subclassing `MoeCausalLM` with its own config reading, modules and names, and
    one registry entry: planned, built and loaded with no other change."""
    (tmp_path / "tiny_arch.py").write_text(textwrap.dedent('''
        from moe_engine.models.base import MoeCausalLM
        from moe_engine.models.config_fields import every_layer_moe, moe_shape_fields
        from moe_engine.models.layers.self_attention import Attention
        from moe_engine.models.weight_mapping import ExpertMapping, WeightMapping

        class TinyForCausalLM(MoeCausalLM):
            model_types = ("tiny",)
            weight_mapping = WeightMapping(
                renames=((".moe.", ".mlp."),), experts=ExpertMapping(gate="a", up="b", down="c")
            )

            @classmethod
            def shape_fields(cls, cfg):
                return moe_shape_fields(cfg, architecture=cls.__name__,
                                        experts_width_field="expert_width",
                                        moe_layers=every_layer_moe(cfg), attention_bias=True)

            def build_attention(self, spec, index, dtype, rotary):
                return Attention(spec, dtype, rotary, o_bias=False)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ARCHITECTURES, "TinyForCausalLM", "tiny_arch")
    cfg = {**TINY, "model_type": "tiny", "expert_width": 8, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0}
    shape = model_shape(cfg)
    assert shape.moe_layers == (0, 1, 2, 3) and shape.moe_intermediate_size == 8
    cls = architecture_class("TinyForCausalLM")
    assert cls.checkpoint_expert_name(1, 0, "gate") == "model.layers.1.moe.experts.0.a"

    class Cfg:
        rms_norm_eps, rope_theta, architectures = 1e-6, 10000.0, ["TinyForCausalLM"]

        def to_dict(self):
            return cfg

    model = cls(cls.arch_spec(Cfg()), torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    got = model.load_weights([("model.layers.1.moe.experts.2.c.weight", torch.ones(32, 8))])
    assert got == {"model.layers.1.mlp.experts.2.down"}
    assert torch.equal(model.model.layers[1].mlp.w2[2], torch.ones(32, 8))
