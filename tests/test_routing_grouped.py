"""Grouped routing (DeepSeek-V3 / GLM-4.5 sigmoid + bias, DeepSeek-V2 softmax) on hand-made rows
for every rule, then on random rows against transformers 5.24's router classes themselves."""

from __future__ import annotations

import pytest
import torch

from moe_engine.models.layers.routers import (
    SigmoidGroupedTopKRouter,
    SoftmaxGroupedTopKRouter,
    SoftmaxTopKRouter,
)
from moe_engine.models.layers.routing import (
    check_group_limits,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
)


def _logits_of(probs: list[list[float]]) -> torch.Tensor:
    """Router logits whose sigmoid is `probs`."""
    p = torch.tensor(probs, dtype=torch.float64)
    return torch.log(p / (1 - p)).float()


def _v3(logits, top_k, bias=None, n_group=1, topk_group=1, norm=False, scale=1.0):
    return sigmoid_grouped_topk(logits, top_k, bias, n_group, topk_group, norm, scale)


def test_correction_bias_changes_the_choice_not_the_weights():
    logits = _logits_of([[0.9, 0.8, 0.3, 0.2]])
    w, ids = _v3(logits, 2)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int32 and w.dtype == torch.float32
    bias = torch.tensor([0.0, 0.0, 0.0, 0.65])  # 0.2 + 0.65 beats 0.8 but not 0.9
    w, ids = _v3(logits, 2, bias)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.2]]))  # the unbiased sigmoids


def test_group_score_is_the_sum_of_the_two_best_biased_scores():
    # group 0 has the best expert (max), group 2 the largest total, group 1 the best top-2 sum
    row = [[0.95, 0.10, 0.10, 0.10, 0.80, 0.75, 0.10, 0.10, 0.50, 0.50, 0.50, 0.50]]
    w, ids = _v3(_logits_of(row), 2, n_group=3, topk_group=1, norm=True, scale=2.5)
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(w, torch.tensor([[0.80, 0.75]]) / 1.55 * 2.5)
    # the bias enters the group score: lifting group 2's experts makes it the chosen group
    bias = torch.tensor([0.0] * 8 + [0.0, 0.0, 0.3, 0.3])
    w, ids = _v3(_logits_of(row), 2, bias, n_group=3, topk_group=1)
    assert ids.tolist() == [[10, 11]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]))


def test_excluded_groups_are_never_picked_even_when_every_biased_score_is_negative():
    row = [[0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.4, 0.6]]  # four groups of two
    bias = torch.tensor([-5.0, -5.0, -3.0, -3.0, -2.0, -2.0, -4.0, -4.0])  # all negative
    # group scores (top-2 sums): g0 -9.0, g1 -5.5, g2 -2.5, g3 -7.0 -> keep g2, g1
    _, ids = _v3(_logits_of(row), 4, bias, n_group=4, topk_group=2)
    assert ids.tolist() == [[4, 5, 3, 2]]  # with a 0.0 mask experts 0, 1, 6, 7 would win


def test_norm_topk_prob_on_and_off_and_the_scaling_factor():
    logits = _logits_of([[0.6, 0.2, 0.9, 0.4]])
    w, ids = _v3(logits, 2, norm=False, scale=1.0)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.6]]))
    w, _ = _v3(logits, 2, norm=True, scale=1.0)
    torch.testing.assert_close(w, torch.tensor([[0.6, 0.4]]))
    w, _ = _v3(logits, 2, norm=True, scale=2.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0]]))
    w, _ = _v3(logits, 2, norm=False, scale=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.25, 1.5]]))


def test_v2_greedy_versus_group_limited_greedy_with_the_group_max():
    probs = torch.tensor([[0.30, 0.02, 0.25, 0.24, 0.05, 0.04, 0.06, 0.04]])
    logits = probs.log()  # softmax(log p) = p
    w, ids = softmax_grouped_topk(logits, 2, "greedy", None, None, 1.0)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(w, probs[:, [0, 2]])
    # groups of two: g0 max 0.30, g1 max 0.25 (top-2 sum 0.49 would pick g1)
    w, ids = softmax_grouped_topk(logits, 2, "group_limited_greedy", 4, 1, 16.0)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, probs[:, [0, 1]] * 16.0)  # scaled, not renormalised
    _, ids = softmax_grouped_topk(logits, 3, "group_limited_greedy", 4, 2, 1.0)
    assert ids.tolist() == [[0, 2, 3]]


def test_ties_go_to_the_lower_expert_and_group_id():
    flat = torch.zeros(3, 16)
    _, ids = _v3(flat, 3, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2]] * 3
    _, ids = softmax_grouped_topk(flat, 5, "group_limited_greedy", 4, 2, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    # groups 1 and 3 tie for the best score; group 1 (lower id) wins, experts tie inside it
    row = _logits_of([[0.1, 0.1, 0.7, 0.7, 0.1, 0.1, 0.7, 0.7]])
    _, ids = _v3(row, 2, n_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="n_routed_experts .* divisible by n_group"):
        check_group_limits(num_experts=10, top_k=2, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="topk_group"):
        check_group_limits(num_experts=16, top_k=2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        check_group_limits(num_experts=16, top_k=9, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="n_group"):
        SigmoidGroupedTopKRouter(8, 12, 2, n_group=5, topk_group=1, norm_topk_prob=True,
                                 routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="topk_method"):
        SoftmaxGroupedTopKRouter(8, 16, 2, "noaux_tc", 4, 2, 1.0)
    with pytest.raises(ValueError, match="n_group and topk_group"):
        SoftmaxGroupedTopKRouter(8, 16, 2, "group_limited_greedy", None, None, 1.0)


def test_router_logits_are_float32_from_a_float32_weight():
    router = SigmoidGroupedTopKRouter(16, 8, 2, 2, 1, True, 1.0)
    assert router.weight.dtype == torch.float32
    assert router.e_score_correction_bias.dtype == torch.float32
    assert "e_score_correction_bias" in router.state_dict()  # persistent: loads by name
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(5, 16)
    w_bf16, ids_bf16 = router(hidden.bfloat16())
    w, ids = router(hidden.bfloat16().float())
    assert torch.equal(ids_bf16, ids) and torch.equal(w_bf16, w)


# --- against transformers' own routers on random rows -----------------------------------------


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in [*module.parameters(), *module.buffers()]:
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.5)


def _compare(ours, theirs, hidden: torch.Tensor) -> None:
    """Same expert sets per token; same weight per expert id (transformers' order is not
    specified: torch.topk with sorted=False)."""
    w, ids = ours(hidden)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    with torch.no_grad():
        _, ref_w, ref_ids = theirs(hidden)
    order, ref_order = ids.long().argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(
        w.gather(1, order), ref_w.float().gather(1, ref_order), rtol=1e-6, atol=1e-7
    )


V3_CASES = [  # (experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    (256, 8, 4, 8, True, 2.5),  # DeepSeek-V3's shape
    (16, 4, 2, 3, False, 1.0),
    (16, 1, 1, 4, True, 1.8),
]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("case", V3_CASES)
def test_sigmoid_router_equals_transformers(family, case):
    experts, n_group, topk_group, top_k, norm, scale = case
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Reference,
        )
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Reference
    config = Config(
        hidden_size=32, n_routed_experts=experts, n_group=n_group, topk_group=topk_group,
        num_experts_per_tok=top_k, norm_topk_prob=norm, routed_scaling_factor=scale,
    )
    theirs = Reference(config)
    _randomise(theirs, seed=experts + top_k)
    ours = SigmoidGroupedTopKRouter(32, experts, top_k, n_group, topk_group, norm, scale)
    ours.load_state_dict(theirs.state_dict())  # the checkpoint names are the same
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    _compare(ours, theirs, hidden)


@pytest.mark.parametrize(
    "method, n_group, topk_group", [("greedy", None, None), ("group_limited_greedy", 4, 2),
                                    ("group_limited_greedy", 8, 3)]
)
def test_v2_router_equals_transformers(method, n_group, topk_group):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=64, num_experts_per_tok=6, topk_method=method,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0,
        norm_topk_prob=True,  # transformers 5.24's V2 router ignores it; so do we
    )
    theirs = DeepseekV2TopkRouter(config)
    _randomise(theirs, seed=7)
    ours = SoftmaxGroupedTopKRouter(32, 64, 6, method, n_group, topk_group, 16.0)
    ours.load_state_dict(theirs.state_dict())
    _compare(ours, theirs, torch.randn(64, 32, generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("norm", [True, False])
def test_qwen2_moe_router_equals_transformers(norm):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = Qwen2MoeConfig(
        hidden_size=32, num_experts=60, num_experts_per_tok=4, norm_topk_prob=norm
    )
    theirs = Qwen2MoeTopKRouter(config)
    _randomise(theirs, seed=3)
    ours = SoftmaxTopKRouter(32, 60, 4, norm)
    ours.load_state_dict(theirs.state_dict())
    _compare(ours, theirs, torch.randn(64, 32, generator=torch.Generator().manual_seed(4)))
