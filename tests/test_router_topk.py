"""The native softmax-then-top-k routing (kernels/dense/ops.py `router_softmax_topk`,
csrc/ops_cpu.cpp) against a float64 softmax and a stable descending sort, on fresh random
logits: the selection (ties, NaN, k = E, decode and prefill row counts), the weights to a
relative 2e-6 (16 float32 epsilons: float32 sums of up to 256 terms), the refusals; and
FusedMoE taking it when the registry chose native-cpu for "router_topk"."""

from __future__ import annotations

import pytest
import torch

from kernels.dense.ops import router_softmax_topk
from kernels.native.library import NativeUnavailable, load_native
from moe_engine.models.layers.routing import softmax_topk

try:
    load_native("ops_cpu")
    _why = None
except NativeUnavailable as exc:  # no compiler: the torch path is all there is
    _why = str(exc)
pytestmark = pytest.mark.skipif(_why is not None, reason=f"native ops unavailable: {_why}")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _reference(logits: torch.Tensor, k: int, renormalize: bool):
    """float64 softmax, stable descending sort, float64 renormalisation."""
    probs = torch.softmax(logits.double(), -1)
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, ids = values[:, :k], ids[:, :k]
    if renormalize:
        values = values / values.sum(-1, keepdim=True)
    return values, ids, probs


def _check(logits: torch.Tensor, k: int, renormalize: bool) -> None:
    weights, ids = router_softmax_topk(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    want_w, want_ids, probs = _reference(logits, k, renormalize)
    # the selection may differ from float64's only where float32 rounding made a tie
    differ = (ids.long() != want_ids).any(-1)
    for row in differ.nonzero().flatten().tolist():
        got = probs[row, ids[row].long()].float()
        assert torch.equal(got, probs[row, want_ids[row]].float()), f"row {row}: {ids[row]}"
    ok = ~differ
    tol = 16 * torch.finfo(torch.float32).eps * want_w[ok].abs() + 1e-45
    assert ((weights[ok].double() - want_w[ok]).abs() <= tol).all()
    # descending, and the lower id first among equal weights
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    tie = weights[:, :-1] == weights[:, 1:]
    assert (ids[:, :-1][tie] < ids[:, 1:][tie]).all()


@pytest.mark.parametrize("t,e,k", [(1, 32, 4), (7, 8, 2), (64, 32, 4), (2048, 32, 8),
                                   (3, 256, 8), (5, 5, 5), (300, 128, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_softmax_and_a_stable_sort(t, e, k, dtype):
    g = _gen()
    logits = (torch.randn(t, e, generator=g) * 3).to(dtype)
    for renormalize in (False, True):
        _check(logits, k, renormalize)
    tied = (torch.randint(-2, 3, (t, e), generator=g).float() * 0.5).to(dtype)
    _check(tied, k, True)  # few distinct values: ties everywhere


def test_within_torch_softmax_topk_on_router_sized_inputs():
    """The engine's two routing paths (this kernel, torch's softmax and sort) pick the same
    experts on random router logits and agree on the weights to float32 rounding."""
    g = _gen()
    logits = torch.randn(4096, 32, generator=g).bfloat16()
    a_w, a_ids = router_softmax_topk(logits, 4, True)
    b_w, b_ids = softmax_topk(logits, 4, True)
    assert torch.equal(a_ids, b_ids)
    torch.testing.assert_close(a_w, b_w, rtol=2e-6, atol=0)


def test_nan_logits_make_nan_weights_and_the_first_ids():
    logits = torch.randn(4, 16)
    logits[1, 3] = float("nan")
    weights, ids = router_softmax_topk(logits, 4, True)
    assert weights[1].isnan().all() and ids[1].tolist() == [0, 1, 2, 3]
    assert not weights[[0, 2, 3]].isnan().any()


def test_refuses_what_it_cannot_route():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        router_softmax_topk(torch.zeros(2, 4, dtype=torch.float16), 2, True)
    with pytest.raises(RuntimeError, match=r"k = 5 must be in \[1, E = 4\]"):
        router_softmax_topk(torch.zeros(2, 4), 5, True)
    with pytest.raises(RuntimeError, match="k = 0"):
        router_softmax_topk(torch.zeros(2, 4), 0, False)
    with pytest.raises(RuntimeError, match=r"logits must be \[T, E\]"):
        router_softmax_topk(torch.zeros(4), 2, False)


def test_fused_moe_binds_the_registry_choice(monkeypatch):
    from kernels.plan import KernelPlan
    from moe_engine.models.layers.moe import FusedMoE

    moe = FusedMoE(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                   renormalize=True, dtype=torch.float32)
    calls = []
    monkeypatch.setattr("kernels.dense.ops.router_softmax_topk",
                        lambda s, k, r: calls.append(k) or softmax_topk(s, k, r))
    moe.bind_kernels(KernelPlan.uniform("torch"))
    moe._route(torch.randn(3, 32))
    assert calls == []
    moe.bind_kernels(KernelPlan.uniform("native-cpu"))
    moe._route(torch.randn(3, 32))
    assert calls == [2]
