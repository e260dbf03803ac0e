"""The native attention prologue (kernels/dense/ops.py `qk_norm_rope_cache`, csrc/rope_cpu.cpp)
against the torch path it replaces: RMSNorm of q/k per head, rotate-half RoPE, KV-cache write,
bit for bit, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kernels.dense.ops import qk_norm_rope_cache
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import RotaryEmbedding


def _torch_prologue(qkv, hq, hkv, positions, rotary, norms, k_cache, v_cache, slots):
    t = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hkv)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = rotary(positions, q, k)
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache.view(-1, hkv, d).index_copy_(0, slots, new.to(cache.dtype))
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_prologue_is_bit_identical_to_the_torch_path(dtype, qk_norm, tokens):
    from kernels.plan import NATIVE_CPU, KernelPlan

    g = torch.Generator().manual_seed(tokens)
    hq, hkv, d, block, blocks = 6, 2, 32, 4, 16
    rotary = RotaryEmbedding(d, 128, base=10000.0)
    norms = None
    if qk_norm:
        norms = [RMSNorm(d, 1e-6, dtype=dtype) for _ in range(2)]
        for n in norms:
            n.weight.data = torch.randn(d, generator=g).to(dtype)
            n.bind_kernels(KernelPlan.uniform(NATIVE_CPU))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype) * 3
    positions = torch.randint(0, 128, (tokens,), generator=g)
    slots = torch.randperm(blocks * block, generator=g)[:tokens]
    caches = [torch.randn(blocks, block, hkv, d, generator=g).to(dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    want = _torch_prologue(qkv, hq, hkv, positions, rotary, norms, want_k, want_v, slots)
    got = qk_norm_rope_cache(
        qkv, hq, hkv, positions, rotary.cos_cache, rotary.sin_cache,
        norms[0].weight.data if norms else None, norms[1].weight.data if norms else None,
        1e-6, caches[0], caches[1], slots,
    )
    assert torch.equal(got, want)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


def test_prologue_refuses_out_of_range_positions_and_slots_without_writing():
    rotary = RotaryEmbedding(16, 8, base=10000.0)
    qkv = torch.randn(2, 3 * 16)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)

    def call(positions, slots):
        return qk_norm_rope_cache(qkv, 1, 1, torch.tensor(positions), rotary.cos_cache,
                                  rotary.sin_cache, None, None, 1e-6, k_cache, v_cache,
                                  torch.tensor(slots))

    with pytest.raises(RuntimeError, match=r"position outside \[0, 8\)"):
        call([0, 8], [0, 1])
    with pytest.raises(RuntimeError, match=r"slot outside \[0, 8\)"):
        call([0, 1], [0, 8])
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(RuntimeError, match="k_cache must be contiguous"):
        qk_norm_rope_cache(qkv, 1, 1, torch.tensor([0, 1]), rotary.cos_cache, rotary.sin_cache,
                           None, None, 1e-6, k_cache.double(), v_cache, torch.tensor([0, 1]))
