"""The triton backend's small ops (kernels/dense/triton_norm.py, triton_rope.py) under Triton's
interpreter, against float64 references and the layers' torch path on fresh random inputs:
RMSNorm (Qwen3's and gpt-oss's rounding, strided 3-d views, odd widths), the fused residual add
+ RMSNorm, the attention prologue (q/k norm, rope "rotate half" / interleaved / partial, the
KV-cache write with -1 padding slots) and the MLA prologue. The rope and the cache writes are
bit-identical to the torch ops; the norms agree to rounding (their row sums differ in order).
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention.triton_mla_prologue import mla_rope_cache
from kernels.dense.triton_norm import fused_add_rms_norm, rms_norm
from kernels.dense.triton_rope import qk_norm_rope_cache
from moe_engine.models.layers.norm import RMSNorm
from moe_engine.models.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize(
    "dtype,weight_in_float32,block_rows",
    [(torch.float32, False, None), (torch.bfloat16, False, 1), (torch.bfloat16, True, None),
     (torch.float32, True, 4)],
)  # fmt: skip
def test_rms_norm_matches_float64_and_the_torch_module(dtype, weight_in_float32, block_rows):
    """block_rows 1 is the GPU's grid (one row a program), None the interpreter's (one)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 37, generator=g).to(dtype)[:, 1:]  # strided rows, odd width
    norm = RMSNorm(37, 1e-5, dtype=dtype, weight_in_float32=weight_in_float32)
    norm.weight.data = (1 + 0.3 * torch.randn(37, generator=g)).to(dtype)
    got = rms_norm(x, norm.weight, 1e-5, weight_in_float32, block_rows=block_rows)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    _close(got, _ref_norm(x, norm.weight, 1e-5), dtype)
    torch_path = norm(x)  # no kernel bound: the torch ops
    ulps = (got.float() - torch_path.float()).abs() / torch_path.float().abs().clamp_min(1e-3)
    assert ulps.max() <= (2e-6 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype,block_rows", [(torch.float32, None), (torch.bfloat16, 1)])
def test_fused_add_rms_norm_writes_the_exact_sum_and_its_norm(dtype, block_rows):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(6, 45, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(45, generator=g)).to(dtype)
    before = residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, block_rows=block_rows)
    assert torch.equal(new_residual, x + residual) and torch.equal(residual, before)
    _close(out, _ref_norm(new_residual, w, 1e-6), dtype)


def _torch_prologue(qkv, hq, hkv, positions, rotary, norms, eps, caches, slots):
    """The layer's module path (`Attention.forward` without a prologue kernel)."""
    t, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if norms is not None:
        modules = []
        for w in norms:
            m = RMSNorm(d, eps, dtype=qkv.dtype)
            m.weight.data = w
            modules.append(m)
        q, k = modules[0](q), modules[1](k)
    q, k = rotary(positions, q, k)
    keep = slots >= 0
    for cache, new in zip(caches, (k, v), strict=True):
        cache.view(-1, hkv, d).index_copy_(0, slots[keep], new[keep])
    return q


@pytest.mark.parametrize(
    "dtype,rope,qk_norm,block_rows",
    [(torch.bfloat16, "neox", False, None), (torch.float32, "neox", True, 4),
     (torch.bfloat16, "neox", True, None), (torch.bfloat16, "interleaved", False, 8),
     (torch.float32, "partial", True, None)],
)  # fmt: skip
def test_qk_norm_rope_cache_matches_the_module_path(dtype, rope, qk_norm, block_rows):
    """block_rows splits the flattened (token, head) rows over programs mid-token, as a GPU
    does (None: one program, the interpreter's)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, t, eps = 6, 2, 24, 5, 1e-6
    rotary = {"neox": RotaryEmbedding(d, 64, 1e4),
              "interleaved": RotaryEmbedding(d, 64, 1e4, interleaved=True),
              "partial": PartialRotaryEmbedding(d, 12, 64, 1e4)}[rope]  # fmt: skip
    tables = rotary.rope if rope == "partial" else rotary
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 17, 3, 63, 40])
    slots = torch.tensor([5, -1, 30, 2, 17])
    norms = None
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    caches = [torch.randn(4, 8, hkv, d, generator=g).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    want = _torch_prologue(qkv, hq, hkv, positions, rotary, norms, eps, want_caches, slots)
    got = qk_norm_rope_cache(qkv, hq, hkv, positions, tables.cos_cache, tables.sin_cache,
                             *(norms or (None, None)), eps, *caches, slots,
                             interleaved=rope == "interleaved", block_rows=block_rows)  # fmt: skip
    if qk_norm:  # the norms' sums differ in order: rounding apart
        for a, b in ((got, want), *zip(caches, want_caches, strict=True)):
            _close(a, b.double(), dtype)
        assert torch.equal(caches[1], want_caches[1])  # v is copied
    else:
        assert torch.equal(got, want)
        for a, b in zip(caches, want_caches, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,blocks", [(torch.float32, None), (torch.bfloat16, (2, 1))])
def test_mla_rope_cache_matches_the_module_path(dtype, blocks):
    g = torch.Generator().manual_seed(4)
    t, n, rank, rope, eps = 4, 3, 40, 8, 1e-6
    rotary = RotaryEmbedding(rope, 32, 1e4, interleaved=True)
    kv_a = torch.randn(t, rank + rope, generator=g).to(dtype)
    q = torch.randn(t, n, 16 + rope, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(rank, generator=g)).to(dtype)
    positions = torch.tensor([1, 31, 0, 9])
    slots = torch.tensor([3, 12, -1, 0])
    cache = torch.randn(3, 8, rank + rope, generator=g).to(dtype)
    want_cache = cache.clone()
    norm = RMSNorm(rank, eps, dtype=dtype)
    norm.weight.data = w
    c_kv, k_pe = kv_a.split([rank, rope], dim=-1)
    q_pe, k_pe = rotary(positions, q[..., 16:], k_pe.unsqueeze(1))
    latent = torch.cat([norm(c_kv), k_pe.squeeze(1)], dim=-1)
    want_cache.view(-1, rank + rope).index_copy_(0, slots[slots >= 0], latent[slots >= 0])
    got = mla_rope_cache(kv_a, q[..., 16:], positions, rotary.cos_cache, rotary.sin_cache, w,
                         eps, cache, slots, interleaved=True, blocks=blocks)  # fmt: skip
    assert torch.equal(got, q_pe)
    assert torch.equal(cache[..., rank:], want_cache[..., rank:])  # roped k_pe, exactly
    _close(cache[..., :rank], want_cache[..., :rank].double(), dtype)


def test_split_kv_scratch_needs_no_fill(monkeypatch):
    """Split-KV decode (paged and MLA) writes every split of every row it owns, so its scratch
    is left uninitialised (no fill launches): NaN-filled scratch gives the same outputs."""
    from kernels.attention import triton_attention as ta

    g = torch.Generator().manual_seed(6)
    tables = torch.randperm(8, generator=g)[:8].view(2, 4)
    lens, starts = torch.tensor([40, 3]), torch.arange(3)
    q, cache = torch.randn(2, 4, 16, generator=g), torch.randn(8, 16, 2, 16, generator=g)
    qm, latent = torch.randn(2, 4, 40, generator=g), torch.randn(8, 16, 40, generator=g)

    def run():
        paged = ta.invoke_paged_attention(q, cache, cache, tables, lens, starts, scale=0.25,
                                          max_query_len=1, kv_splits=4)  # fmt: skip
        mla = ta.mla_decode(qm, latent, tables, lens, scale=0.2, kv_lora_rank=32, kv_splits=4)
        return paged, mla

    want = run()
    scratch = ta._split_scratch  # the allocation under test

    def poisoned(*args):
        return tuple(x.fill_(float("nan")) for x in scratch(*args))

    monkeypatch.setattr(ta, "_split_scratch", poisoned)
    for got, ref in zip(run(), want, strict=True):
        assert torch.equal(got, ref)
