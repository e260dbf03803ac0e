"""The families table and the refusals: README's table is the registry's (`python -m
moe_engine.models.families`), every registered class has a card that agrees with what it
builds, and every Mixture-of-Experts causal LM of transformers 5.24 is either registered or
refused naming what the engine lacks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_engine.errors import StartupError
from moe_engine.models import (
    ARCHITECTURES,
    REFUSED_ARCHITECTURES,
    architecture_class,
    resolve_config_dict,
)
from moe_engine.models.families import BEGIN, END, families_table, main, readme_table

README = Path(__file__).resolve().parents[1] / "README.md"

#: Every `*ForCausalLM` class of transformers 5.24 whose decoder routes tokens to experts
#: (text models of multimodal families included), found by scanning its models/*/modeling_*.py
#: for a causal-LM class beside an experts/router/MoE block class.
TRANSFORMERS_MOE_ARCHITECTURES = (
    "AXK1ForCausalLM", "AXK2ForCausalLM", "AfmoeForCausalLM", "AriaTextForCausalLM",
    "BailingHybridForCausalLM", "BeamForCausalLM", "Cohere2MoeForCausalLM", "DbrxForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM", "DogeForCausalLM", "Dots1ForCausalLM", "Dots3NoteForCausalLM",
    "Ernie4_5_MoeForCausalLM", "ExaoneMoeForCausalLM", "FlexOlmoForCausalLM", "FlintForCausalLM",
    "Gemma4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM",
    "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", "HYV3ForCausalLM",
    "HYV4ForCausalLM", "HunYuanMoEV1ForCausalLM", "Inkling2ForCausalLM",
    "Inkling2LoopForCausalLM", "InklingForCausalLM", "JambaForCausalLM", "JetMoeForCausalLM",
    "KimiLinearForCausalLM", "Kolibri1ForCausalLM", "LagunaForCausalLM", "LaraMiniForCausalLM",
    "Lfm2MoeForCausalLM", "Llama4ForCausalLM", "LongcatFlashForCausalLM", "MellumForCausalLM",
    "MiMoV2FlashForCausalLM", "MiniMaxForCausalLM", "MiniMaxM2ForCausalLM",
    "MiniMaxM3VLForCausalLM", "Mistral4ForCausalLM", "MixtralForCausalLM",
    "NemotronHForCausalLM", "OlmoeForCausalLM", "PhimoeForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen4ExpForCausalLM", "SolarOpenForCausalLM", "ZayaForCausalLM",
)  # fmt: skip


def test_readme_table_is_the_registrys() -> None:
    text = README.read_text()
    assert BEGIN in text and END in text
    assert readme_table(text) == families_table(), (
        "README's families table is stale: paste `python -m moe_engine.models.families`"
    )
    assert main(["--check", str(README)]) == 0


def test_a_stale_table_fails_the_check(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(README.read_text().replace("| Mixtral |", "| Mixtral (old) |"))
    assert main(["--check", str(stale)]) == 1


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_registered_class_has_a_card_that_agrees(arch: str) -> None:
    cls = architecture_class(arch)
    card = cls.__dict__.get("card")  # its own, not inherited from the family it builds on
    assert card is not None, f"{arch} has no card of its own"
    assert card.name and card.examples and card.attention and card.cache
    # a per-request state cannot take rejected drafts back: speculation is refused there
    assert ("state" in card.cache) == (not card.speculation), card
    if "mtp" in card.speculation:  # built from the checkpoint's MTP layers
        assert cls.mtp_layers_field is not None, card
    assert arch not in REFUSED_ARCHITECTURES


def test_every_transformers_moe_architecture_is_served_or_refused_with_a_reason() -> None:
    missing = [a for a in TRANSFORMERS_MOE_ARCHITECTURES
               if a not in ARCHITECTURES and a not in REFUSED_ARCHITECTURES]
    assert not missing, f"neither registered nor refused with a reason: {missing}"
    assert set(ARCHITECTURES) <= set(TRANSFORMERS_MOE_ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHITECTURES))
def test_a_refused_architecture_names_what_it_lacks(arch: str) -> None:
    with pytest.raises(StartupError) as err:
        resolve_config_dict({"architectures": [arch], "model_type": "x"})
    message = str(err.value)
    assert arch in message and "; supported:" not in message
    assert "not supported" in message or "not implemented" in message


def test_an_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(StartupError, match=r"not supported; supported: .*Qwen3MoeForCausalLM"):
        resolve_config_dict({"architectures": ["NoSuchMoeForCausalLM"]})


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"])
@pytest.mark.parametrize("top_k", [0, 9])
def test_experts_per_token_outside_the_experts_is_refused_from_config(kind: str,
                                                                      top_k: int) -> None:
    """A top_k the router cannot pick (0, or more than its 8 experts) is refused when the
    config is read, naming the field, the value and the limit, not at the first request
    (where the router kernel's error ended the server)."""
    from fixtures import tiny_config

    from moe_engine.models import model_shape

    cfg = tiny_config(kind).to_dict()
    cfg["num_experts_per_tok"] = cfg["experts_per_token"] = top_k
    with pytest.raises(ValueError, match=rf"top_k = {top_k} .*num_experts_per_tok.*\[1, 8\]"):
        model_shape(cfg)
