"""CPU prefill attention one request at a time (kernels/attention/torch_rows.py)
against a float64 reference and against the batched, masked path it replaces, for a batch that
mixes fresh prompts (causal over their own chunk) and later chunks / prefix hits (keys cached
before the chunk), with GQA, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.torch_rows import prefill_rows
from moe_engine.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    _gather_blocks,
    build_attention_batch,
)


def _batch(g, q_lens, starts, hkv, d, block_size, dtype):
    """A paged cache holding every request's keys (cached prefix and this chunk), its block
    tables (shuffled blocks, null block 0 unused) and the chunk's queries."""
    seq_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
    nbs = [-(-n // block_size) for n in seq_lens]
    total = sum(nbs)
    k_cache = torch.randn(total + 1, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(total + 1, block_size, hkv, d, generator=g).to(dtype)
    ids = (torch.randperm(total, generator=g) + 1).tolist()
    tables = torch.zeros(len(q_lens), max(nbs), dtype=torch.int64)
    for row, nb in enumerate(nbs):
        tables[row, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
    batch = build_attention_batch(0, torch.tensor(q_lens), torch.tensor(starts), tables,
                                  block_size)
    return k_cache, v_cache, batch, seq_lens


def _reference(q, k_cache, v_cache, batch, seq_lens, q_lens, scale, heads):
    """float64, request by request: keys gathered slot by slot, explicit causal softmax."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out, t = [], 0
    for row, (n, lq) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pos = torch.arange(n)
        slots = batch.block_tables[row, pos // bs] * bs + pos % bs
        keys = k_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(heads // hkv, 1)
        values = v_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(heads // hkv, 1)
        rq = q[t : t + lq].double()  # [lq, H, D]
        scores = torch.einsum("qhd,khd->hqk", rq, keys) * scale
        q_pos = torch.arange(n - lq, n)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        t += lq
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_float64_and_the_batched_path(dtype):
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    heads, hkv, d, block_size = 8, 2, 32, 16
    q_lens, starts = [37, 1 + 16, 5, 64, 2], [0, 0, 40, 16, 7]  # fresh, fresh, later chunks
    k_cache, v_cache, batch, seq_lens = _batch(g, q_lens, starts, hkv, d, block_size, dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    got = prefill_rows(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                       batch.query_start_loc, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, k_cache, v_cache, batch, seq_lens, q_lens, scale, heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # the batched path: padded queries, gathered keys, one mask
    b = len(q_lens)
    keys, values = (_gather_blocks(c, batch.block_ids, b) for c in (k_cache, v_cache))
    q_pad = q.new_zeros(b, batch.max_q, heads, d)
    q_pad[batch.tok_b, batch.tok_q] = q
    o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values,
                                       attn_mask=batch.mask, scale=scale, enable_gqa=True)
    batched = o.transpose(1, 2)[batch.tok_b, batch.tok_q]
    torch.testing.assert_close(got.double(), batched.double(), rtol=tol, atol=tol)


def test_paged_attention_takes_rows_on_cpu_only_without_window_or_sinks(monkeypatch):
    """The torch prefill path of `PagedAttention` goes through prefill_rows for full attention
    without sinks; a sliding window or sink logits keep the batched path."""
    import moe_engine.models.layers.attention as attention

    g = torch.Generator().manual_seed(0)
    heads, hkv, d, block_size = 4, 2, 16, 8
    q_lens, starts = [9, 3], [0, 5]
    k_cache, v_cache, batch, _ = _batch(g, q_lens, starts, hkv, d, block_size, torch.float32)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), batches=[batch])
    calls = []
    monkeypatch.setattr(attention, "prefill_rows",
                        lambda *a: calls.append(1) or prefill_rows(*a))
    for window, sinks, want_calls in ((None, None, 1), (4, None, 0), (None, torch.zeros(heads), 0)):
        calls.clear()
        layer = PagedAttention(heads, hkv, d, d**-0.5, sliding_window=window)
        layer(q, None, None, (k_cache, v_cache), meta, sinks)
        assert len(calls) == want_calls, (window, sinks)
