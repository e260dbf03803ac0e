"""The skewed-router fixture (tests/skewed_checkpoint.py) is what the EPLB tests need: two of
eight experts take most (token, expert) pairs in every MoE layer, so the contiguous placement
overloads rank 0 at ep 2 and ep 4; greedy text still depends on the prompt; and the engine
serves it token-exact with transformers (float, and MXFP4 / int4 experts against the
dequantized checkpoint)."""

from __future__ import annotations

import pytest
import torch
from fixtures import dequantized_experts_copy, hf_greedy
from skewed_checkpoint import contiguous_rank_shares, make_skewed_checkpoint, routing_counts

from moe_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory):
    return make_skewed_checkpoint(tmp_path_factory.mktemp("skewed"))


def _random_prompts(seed: int, count: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 64, (count,), generator=g).tolist()
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


def test_two_hot_experts_take_most_pairs_and_overload_rank_0(skewed_ckpt):
    counts = routing_counts(skewed_ckpt, _random_prompts(seed=31))
    assert counts.shape == (3, 8)
    for layer in counts:  # every MoE layer is skewed toward experts 0 and 1
        assert layer[:2].sum() > 0.5 * layer.sum(), layer.tolist()
        assert set(layer.topk(2).indices.tolist()) == {0, 1}
        assert (layer > 0).sum() >= 6  # the others still see traffic
    ep2, ep4 = contiguous_rank_shares(counts, 2), contiguous_rank_shares(counts, 4)
    assert ep2[0] > 0.65 and ep4[0] > 0.5, (ep2.tolist(), ep4.tolist())
    # balancedness (mean / max rank load) of the contiguous placement
    assert ep2.mean() / ep2.max() < 0.8 and ep4.mean() / ep4.max() < 0.5


def test_unskewed_twin_is_balanced(tmp_path):
    """The same build with strength 0 and no offset routes near-uniformly: the skew comes
    from the edits, not from the seed."""
    flat = make_skewed_checkpoint(tmp_path, offset=0.0, strength=0.0)
    counts = routing_counts(flat, _random_prompts(seed=31))
    assert contiguous_rank_shares(counts, 2)[0] < 0.6


def test_greedy_text_depends_on_the_prompt_and_the_engine_matches(skewed_ckpt):
    prompts = _random_prompts(seed=5, count=4)
    expected = hf_greedy(skewed_ckpt, prompts, 10)
    assert len({tuple(e) for e in expected}) == len(prompts)
    assert all(len(set(e)) > 3 for e in expected)  # not one token repeated
    llm = LLM(model=str(skewed_ckpt), max_model_len=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("method", ["mxfp4", "int4"])
def test_four_bit_experts_serve_it(skewed_ckpt, tmp_path, method):
    """4-bit experts (group 32): greedy ids equal transformers on the dequantized copy."""
    prompts = _random_prompts(seed=6, count=4)
    expected = hf_greedy(dequantized_experts_copy(skewed_ckpt, tmp_path, method, 32), prompts, 8)
    llm = LLM(model=str(skewed_ckpt), max_model_len=256, quantization=method,
              quant_group_size=32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.model_info().expert_weight_format == method
