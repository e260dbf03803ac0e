"""Routing edge cases: softmax over all experts, top-k, renormalised or not; deterministic ties."""

from __future__ import annotations

import torch

from moe_engine.models.layers.moe import softmax_topk


def test_norm_topk_prob_true_and_false_on_a_hand_made_row():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits[0], dim=0)  # softmax over all four experts first
    w, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w[0], probs[[1, 2]])
    w, ids = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w[0], probs[[1, 2]] / probs[[1, 2]].sum())
    assert abs(float(w.sum()) - 1.0) < 1e-6


def test_identical_logits_pick_the_lowest_ids_and_k_distinct_experts():
    logits = torch.zeros(3, 8, dtype=torch.bfloat16)
    w, ids = softmax_topk(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(w, torch.full((3, 4), 0.25))


def test_partial_ties_break_toward_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    _, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
