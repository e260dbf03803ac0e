"""The built-in demo checkpoint: created once, atomically, with a working tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_engine.models import model_shape
from moe_engine.startup import demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(demo.ensure_demo_checkpoint(str(tmp_path_factory.mktemp("cache"))))


def test_files_and_config(demo_dir: Path) -> None:
    assert demo_dir.name == demo.DEMO_NAME
    names = {p.name for p in demo_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["eos_token_id"] == demo.EOS_ID and cfg["bos_token_id"] == demo.BOS_ID
    shape = model_shape(cfg)
    params = shape.expert_params() + shape.other_params()
    assert 10e6 < params < 30e6
    assert shape.num_experts == 16 and shape.top_k == 4 and shape.vocab_size == demo.VOCAB_SIZE


def test_tokenizer_round_trip(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert len(tok) == demo.VOCAB_SIZE
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (2, 1, 0)
    text = "def main():\n    return 'héllo, wörld ☃'\n"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # no BOS added
    code = "import os\n\ndef function(self, value):\n    return self.value\n"
    assert len(tok(code).input_ids) < len(code) / 3  # trained merges, not bytes
    assert tok.decode(ids) == text
    assert all(0 <= i < demo.VOCAB_SIZE for i in ids)
    assert tok.chat_template == demo.CHAT_TEMPLATE  # since demo-v2


def test_reused_not_rewritten(demo_dir: Path) -> None:
    weights = demo_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert demo.ensure_demo_checkpoint(str(demo_dir.parent)) == str(demo_dir)
    assert weights.stat().st_mtime_ns == before


def test_weights_are_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    demo.write_model(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (
        demo_dir / "model.safetensors"
    ).read_bytes()


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "c"))
    assert demo.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOE_ENGINE_CACHE")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "moe-engine"


def test_text_prompts_stop_strings_and_seeds_end_to_end(demo_dir: Path) -> None:
    """Text in, text out through the tokenizer; a stop string cuts the text; seeds repeat."""
    from moe_engine import LLM, SamplingParams

    llm = LLM(model=str(demo_dir), max_model_len=256, num_blocks_override=64)
    [greedy_out] = llm.generate("def main():", SamplingParams(max_tokens=24, temperature=0))
    greedy = greedy_out.outputs[0]
    tok = llm.engine.tokenizer
    assert greedy.text == tok.decode(greedy.token_ids, skip_special_tokens=True)
    assert len(greedy.text) > 0
    # Use a piece of the greedy text as a stop string: the same run must stop right before it.
    starts = [i for i in range(1, len(greedy.text) - 2) if not greedy.text[i].isspace()]
    assert starts, f"greedy text too short for the test: {greedy.text!r}"
    stop = greedy.text[starts[len(starts) // 2] :][:3]
    params = SamplingParams(max_tokens=24, temperature=0, stop=[stop])
    cut = llm.generate(["def main():"], params)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert cut.text == greedy.text[: greedy.text.index(stop)]
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=123)
    a, b = (llm.generate(["import os"], sp)[0].outputs[0].token_ids for _ in range(2))
    assert a == b
    [reply] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    assert reply.prompt == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    assert reply.prompt_token_ids[0] == demo.BOS_ID and len(reply.outputs[0].token_ids) >= 1


def test_unknown_architecture_lists_supported() -> None:
    from moe_engine.errors import StartupError
    from moe_engine.models import resolve_architecture

    class Cfg:
        architectures = ["LlamaForCausalLM"]

    with pytest.raises(StartupError) as err:
        resolve_architecture(Cfg())
    assert "LlamaForCausalLM" in str(err.value)
    assert "MixtralForCausalLM" in str(err.value) and "Qwen3MoeForCausalLM" in str(err.value)
