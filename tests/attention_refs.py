"""Shared pieces of the Triton attention tests (tests/test_triton_attention*.py): fresh random
paged caches with non-contiguous blocks, NaN in every slot no request owns (a kernel that reads
one fails), and the float64 references the kernels are compared with.

Each `gen()` prints its seed (pytest shows it on failure). Inputs are rounded to the tested dtype
first and the references see the same rounded values. Tolerances (relative Frobenius error of
the output against the float64 reference): float32 < 1e-5; bfloat16 and float16 < 1e-2.
"""

from __future__ import annotations

import torch
import triton

from kernels.attention.triton_attention import invoke_paged_attention, paged_attention

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def gen() -> torch.Generator:
    seed = torch.seed() % (2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def make_tables(g, seq_lens, block_size, index_dtype=torch.int64, spare_blocks=3, width=None):
    """Random distinct blocks per request (block 0 is the null block, padding)."""
    need = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = width or max(max(need), 1) + 1  # at least one padding column
    tables = torch.zeros(len(seq_lens), width, dtype=index_dtype)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=index_dtype)
    return tables, num_blocks


def owned_slots(tables, seq_lens, block_size) -> list[torch.Tensor]:
    """Per request, the flat cache slots of its keys 0 .. seq_len - 1."""
    out = []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        out.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    return out


def nan_unowned(cache, slots) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[2:])
    owned = torch.zeros(flat.shape[0], dtype=torch.bool)
    for s in slots:
        owned[s] = True
    flat[~owned] = float("nan")
    return cache


def paged_case(g, q_lens, seq_lens, *, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32,
               index_dtype=torch.int64, sinks=False, width=None,
               sinks_dtype=torch.float32):  # fmt: skip
    tables, num_blocks = make_tables(g, seq_lens, block_size, index_dtype, width=width)
    slots = owned_slots(tables, seq_lens, block_size)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=index_dtype)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return {
        "q": torch.randn(sum(q_lens), hq, d, generator=g).to(dtype),
        "k_cache": nan_unowned(k, slots),
        "v_cache": nan_unowned(v, slots),
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=index_dtype),
        "query_start_loc": qsl,
        "scale": d**-0.5,
        "max_query_len": max(q_lens),
        "sinks": torch.randn(hq, generator=g).to(sinks_dtype) if sinks else None,
    }


def paged_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale,
                    max_query_len, sliding_window=None, sinks=None) -> torch.Tensor:  # fmt: skip
    """float64 attention, request by request, gathered slot by slot from the block table."""
    num_tokens, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float64)
    slots = owned_slots(block_tables, seq_lens.tolist(), block_size)
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if hi == lo or n == 0:
            continue
        keys, values = (
            c.view(-1, hkv, d)[slots[b]].double().repeat_interleave(hq // hkv, dim=1)
            for c in (k_cache, v_cache)
        )
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), keys) * scale
        q_pos = n - (hi - lo) + torch.arange(hi - lo)
        k_pos = torch.arange(n)
        visible = k_pos[None] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.double()[:, None, None].expand(hq, hi - lo, 1)
            scores = torch.cat([scores, sink_col], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :n]
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def check_paged(case: dict, window: int | None = None, **launch) -> torch.Tensor:
    dtype = case["q"].dtype
    out = torch.full_like(case["q"], float("nan"))
    if launch:
        got = invoke_paged_attention(**case, sliding_window=window, out=out, **launch)
    else:
        got = paged_attention(**case, sliding_window=window, out=out)
    assert got is out and got.dtype == dtype and got.shape == case["q"].shape
    want = paged_reference(**case, sliding_window=window)
    assert rel_err(got, want) < RTOL[dtype]
    return got


def mla_reference(q, latent_cache, block_tables, seq_lens, scale, rank) -> torch.Tensor:
    """float64 absorbed MLA decode: softmax(q . latent * scale) @ latent[:, :rank]."""
    b, heads, _ = q.shape
    out = torch.zeros(b, heads, rank, dtype=torch.float64)
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    block_size = latent_cache.shape[1]
    for row, slots in enumerate(owned_slots(block_tables, seq_lens.tolist(), block_size)):
        if slots.numel():
            latent = flat[slots].double()
            probs = torch.softmax(q[row].double() @ latent.T * scale, dim=-1)
            out[row] = probs @ latent[:, :rank]
    return out
