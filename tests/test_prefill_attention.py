"""Native bfloat16 prefill attention (kernels/native/csrc/prefill_attention.cpp) against a float64
reference and the torch path it replaces, on fresh random inputs each run; skipped, with the
reason, on a CPU without AVX512-BF16.

Error bound: the outputs are bfloat16 (half an ulp, 2^-9 relative) of an attention whose
probabilities were rounded once to bfloat16 for the product with the values (2^-9 relative
each), over values of unit scale: 2e-2 absolute and relative, the decode kernel's bf16 bound.
"""

from __future__ import annotations

import pytest
import torch
from test_native_attention_linear import _gen, _paged

from kernels.attention.native_prefill import paged_prefill_attention, prefill_attention_fits
from moe_engine.models.layers.attention import attention_with_sinks

WHY = prefill_attention_fits(64, 8, 2, torch.bfloat16)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native prefill attention: {WHY}")


def _reference(q, k_cache, v_cache, tables, lens, q_lens, scale, window=None, sinks=None):
    """float64, query by query: its visible keys gathered slot by slot, explicit softmax."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out, row0 = torch.empty(q.shape, dtype=torch.float64), 0
    for r, (n, lq) in enumerate(zip(lens, q_lens, strict=True)):
        pos = torch.arange(n)
        slots = tables[r, pos // bs] * bs + pos % bs
        keys = k_cache.reshape(-1, hkv, d)[slots].double().transpose(0, 1)[None]
        values = v_cache.reshape(-1, hkv, d)[slots].double().transpose(0, 1)[None]
        for i in range(lq):
            p = n - lq + i
            visible = pos <= p
            if window is not None:
                visible &= pos > p - window
            s = torch.full((hq, 1), -1e30, dtype=torch.float64)
            if sinks is not None:
                s = sinks.double()[:, None]
            o = attention_with_sinks(q[row0 + i].double()[None, :, None], keys, values,
                                     visible[None, None, None], s, scale)
            out[row0 + i] = o[0, :, 0]
        row0 += lq
    return out


@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (4, 4, 32, 8), (16, 2, 128, 16),
                                                 (8, 8, 256, 32)])
@pytest.mark.parametrize("window,sink", [(None, False), (7, False), (None, True), (40, True)])
def test_prefill_attention_matches_float64(hq, hkv, d, block_size, window, sink):
    """Chunks that start their context (q_len = seq_len) and later chunks (a cached prefix),
    lengths across the 16-query blocks and 64-key chunks, one token, a sliding window that
    starts inside a chunk, sink logits."""
    g = _gen()
    lens = [1, 17, 70, 130, 65, 200]
    q_lens = [1, 17, 70, 3, 64, 81]
    k_cache, v_cache, tables = _paged(g, lens, hkv, d, block_size, torch.bfloat16)
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    sinks = torch.randn(hq, generator=g) if sink else None
    got = paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts,
                                  d**-0.5, sliding_window=window, sinks=sinks)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = _reference(q, k_cache, v_cache, tables, lens, q_lens, d**-0.5, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_prefill_attention_equals_the_torch_path_within_bf16():
    """The native path against what PagedAttention ran before it (`prefill_rows`, one SDPA
    call per request), through the same AttentionBatch."""
    from kernels.attention.torch_rows import prefill_rows
    from moe_engine.models.layers.attention import build_attention_batch

    g = _gen()
    lens, q_lens = [40, 100, 256], [40, 30, 256]
    k_cache, v_cache, tables = _paged(g, lens, 2, 64, 16, torch.bfloat16)
    q = torch.randn(sum(q_lens), 8, 64, generator=g).bfloat16()
    starts = torch.tensor([n - lq for n, lq in zip(lens, q_lens, strict=True)])
    batch = build_attention_batch(0, torch.tensor(q_lens), starts, tables, 16)
    got = paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, 0.125)
    want = prefill_rows(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_prefill_attention_refuses_what_it_cannot_run():
    g = _gen()
    k_cache, v_cache, tables = _paged(g, [20], 2, 64, 16, torch.bfloat16)
    q = torch.randn(20, 8, 64, generator=g).bfloat16()
    starts = torch.tensor([0, 20])
    with pytest.raises(RuntimeError, match="runs bfloat16"):
        paged_prefill_attention(q.float(), k_cache, v_cache, tables, torch.tensor([20]),
                                starts, 0.125)
    with pytest.raises(RuntimeError, match=r"seq_lens must be in \[1, W \* block_size\]"):
        paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([33]), starts, 0.125)
    with pytest.raises(RuntimeError, match="at most 16 query heads"):
        paged_prefill_attention(torch.zeros(20, 64, 64).bfloat16(), k_cache, v_cache, tables,
                                torch.tensor([20]), starts, 0.125)
    assert "needs head_dim % 32" in prefill_attention_fits(80, 8, 2, torch.bfloat16)
