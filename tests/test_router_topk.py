"""The routers' native stable top-k (kernels/cpu_ops.py `stable_topk`, csrc/ops_cpu.cpp) against
`routing.sort_topk` (a stable descending torch sort), bit for bit, on fresh random scores: ties
(exact repeats, +-0), NaN, k = N, and the row counts of decode and prefill; and FusedMoE taking
it when the registry chose native-cpu for "router_topk"."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops import stable_topk
from kernels.native import NativeUnavailable, load_native
from moe_engine.models.layers.routing import softmax_topk, sort_topk

try:
    load_native("ops_cpu")
    _why = None
except NativeUnavailable as exc:  # no compiler: the torch path is all there is
    _why = str(exc)
pytestmark = pytest.mark.skipif(_why is not None, reason=f"native ops unavailable: {_why}")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _same(scores: torch.Tensor, k: int, renormalize: bool = False) -> None:
    values, ids = stable_topk(scores, k, renormalize)
    want_values, want_ids = sort_topk(scores, k, renormalize)
    assert ids.dtype == torch.int32 and values.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    assert torch.equal(values.view(torch.int32), want_values.contiguous().view(torch.int32))


@pytest.mark.parametrize("t,n,k", [(1, 32, 4), (7, 8, 2), (64, 32, 4), (2048, 32, 8),
                                   (3, 256, 8), (5, 5, 5), (300, 128, 1)])
def test_matches_a_stable_descending_sort(t, n, k):
    g = _gen()
    probs = torch.softmax(torch.randn(t, n, generator=g) * 3, -1)
    _same(probs, k)
    _same(probs, k, renormalize=True)
    # ties everywhere: few distinct values, signed zeros
    tied = torch.randint(-2, 3, (t, n), generator=g).float() * 0.5
    tied[tied == 0] = torch.where(torch.rand(int((tied == 0).sum()), generator=g) < 0.5,
                                  -0.0, 0.0)
    _same(tied, k)


def test_nan_ranks_above_every_number_as_in_torch_sort():
    g = _gen()
    scores = torch.randn(16, 32, generator=g)
    scores[torch.rand(16, 32, generator=g) < 0.2] = float("nan")
    scores[3] = float("nan")
    _same(scores, 6)


@pytest.mark.parametrize("k", [1, 2, 4, 6, 8, 9, 16])
def test_renormalized_values_equal_the_sort_paths(k):
    g = _gen()
    _same(torch.rand(4000, 64, generator=g) ** 4, k, renormalize=True)


def test_softmax_topk_is_bit_identical_with_either_selection():
    g = _gen()
    logits = torch.randn(513, 32, generator=g).bfloat16()
    for renormalize in (False, True):
        a = softmax_topk(logits, 4, renormalize)
        b = softmax_topk(logits, 4, renormalize, stable_topk)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_refuses_what_it_cannot_select():
    with pytest.raises(RuntimeError, match="float32"):
        stable_topk(torch.zeros(2, 4, dtype=torch.bfloat16), 2)
    with pytest.raises(RuntimeError, match=r"k = 5 must be in \[1, N = 4\]"):
        stable_topk(torch.zeros(2, 4), 5)
    with pytest.raises(RuntimeError, match="k = 0"):
        stable_topk(torch.zeros(2, 4), 0)


def test_fused_moe_binds_the_registry_choice(monkeypatch):
    from kernels.registry import KernelPlan
    from moe_engine.models.layers.moe import FusedMoE

    moe = FusedMoE(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                   renormalize=True, dtype=torch.float32)
    calls = []
    monkeypatch.setattr("moe_engine.models.layers.moe.stable_topk",
                        lambda s, k, r: calls.append(k) or sort_topk(s, k, r))
    moe.bind_kernels(KernelPlan.uniform("torch"))
    moe._route(torch.randn(3, 32))
    assert calls == []
    moe.bind_kernels(KernelPlan.uniform("native-cpu"))
    moe._route(torch.randn(3, 32))
    assert calls == [2]
