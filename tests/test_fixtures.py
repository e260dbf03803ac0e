"""The tiny checkpoints are what the oracle tests assume: real layouts, non-degenerate greedy."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fixtures import hf_greedy, hf_last_logits

from moe_engine.models import checkpoint_shape


def prompts(n: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randint(3, vocab - 1) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_layouts(qwen3_ckpt: Path, qwen3_sharded_ckpt: Path, qwen3_nonorm_ckpt: Path,
                 mixtral_ckpt: Path) -> None:
    assert (qwen3_ckpt / "model.safetensors").is_file()
    index = json.loads((qwen3_sharded_ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    q = checkpoint_shape(qwen3_ckpt)
    assert q.moe_layers == (0, 2) and q.norm_topk_prob
    n = checkpoint_shape(qwen3_nonorm_ckpt)
    assert n.moe_layers == (1, 3) and not n.norm_topk_prob
    m = checkpoint_shape(mixtral_ckpt)
    assert m.architecture == "MixtralForCausalLM" and m.moe_layers == (0, 1)


def test_greedy_is_not_degenerate(qwen3_ckpt: Path, mixtral_ckpt: Path) -> None:
    for ckpt in (qwen3_ckpt, mixtral_ckpt):
        outs = hf_greedy(ckpt, prompts(6), 24)
        assert len({tuple(o) for o in outs}) == 6  # continuations differ across prompts
        for out in outs:
            assert len(out) == 24 and len(set(out)) >= 8  # not one token repeated


def test_last_logits_match_generate(qwen3_ckpt: Path) -> None:
    prompt = prompts(1)[0]
    logits = hf_last_logits(qwen3_ckpt, prompt)
    assert logits.shape == (512,)
    assert int(logits.argmax()) == hf_greedy(qwen3_ckpt, [prompt], 1)[0][0]
