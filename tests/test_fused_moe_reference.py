"""The CPU expert path against a float64 per-token loop, on fresh random inputs."""

from __future__ import annotations

import torch

from kernels.moe.reference import fused_moe_reference


def naive_moe(hidden, w13, w2, topk_weights, topk_ids):
    out = torch.zeros_like(hidden)
    inter = w2.shape[-1]
    for t in range(hidden.shape[0]):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
            out[t] += topk_weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_matches_float64_loop_including_skipped_slots():
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    t, h, inter, e, k = 13, 24, 10, 6, 3
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * inter, h, generator=g, dtype=torch.float64)
    w2 = torch.randn(e, h, inter, generator=g, dtype=torch.float64)
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    topk_ids[0, 1] = -1  # a slot whose expert lives on another rank
    topk_weights = torch.rand(t, k, generator=g, dtype=torch.float32)
    got = fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
    want = naive_moe(hidden, w13, w2, topk_weights.double(), topk_ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert fused_moe_reference(hidden[:0], w13, w2, topk_weights[:0], topk_ids[:0]).shape == (0, h)


def test_cpu_path_matches_reference_balanced_skewed_and_remote_slots():
    from kernels.moe.torch_cpu import fused_moe_cpu

    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    t, h, inter, e, k = 37, 16, 8, 8, 2
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * inter, h, generator=g, dtype=torch.float64)
    w2 = torch.randn(e, h, inter, generator=g, dtype=torch.float64)
    weights = torch.rand(t, k, generator=g, dtype=torch.float32)
    balanced = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    skewed = balanced.clone()
    skewed[:, 0] = 3  # every token to expert 3: padding would be wasteful, the loop runs
    remote = balanced.clone()
    remote[::3, 1] = -1  # slots on other ranks
    for ids in (balanced, skewed, remote):
        want = naive_moe(hidden, w13, w2, weights.double(), ids)
        got = fused_moe_cpu(hidden, w13, w2, weights, ids)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    all_remote = torch.full_like(balanced, -1)
    assert fused_moe_cpu(hidden, w13, w2, weights, all_remote).abs().max() == 0
