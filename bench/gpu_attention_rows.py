"""The attention rows of `bench/gpu_kernels.py`: paged decode (one split, flash-decoding splits,
gpt-oss sinks with and without the sliding window), a prefill chunk over cached context, and
MLA absorbed decode at DeepSeek-V2-Lite's widths; each call timed and checked against the
float64 reference of `bench/gpu_reference.py`.

Bytes per call (for GB/s): the K and V rows each query may see (its sliding window only, when
there is one) in the cache dtype, once per request; MLA: the latent rows (rank + rope) per
request. A prefill row also gives TFLOP/s (2 matmuls of 2 * q * k * D flops over the visible
(query, key) pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gpu_reference import mla_decode_ref, paged_attention_ref, rel_error

#: Relative Frobenius error bounds against float64 (tests/test_triton_attention.py's).
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


@dataclass(frozen=True)
class AttentionCase:
    """`batch` requests of `context` keys each, the last `query_len` of which are queries (1:
    decode). `splits` None: the launcher's own `num_kv_splits`."""

    name: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    query_len: int = 1
    window: int | None = None
    sinks: bool = False
    splits: int | None = None


@dataclass(frozen=True)
class MlaCase:
    """MLA decode: `batch` requests of `context` latents, `heads` heads, rank + rope widths."""

    name: str
    batch: int
    context: int
    heads: int
    rank: int
    rope: int
    block_size: int = 16
    splits: int | None = None


ATTENTION = (
    AttentionCase("qwen3-30b-a3b decode", 64, 4096, 32, 4, 128),
    AttentionCase("qwen3-30b-a3b decode, batch 1 (split)", 1, 32768, 32, 4, 128),
    AttentionCase("gpt-oss-20b decode, sinks (split)", 4, 8192, 64, 8, 64, sinks=True),
    AttentionCase("gpt-oss-20b decode, sinks + window 128 (split)", 4, 8192, 64, 8, 64,
                  window=128, sinks=True),
    AttentionCase("qwen3-30b-a3b prefill chunk 512 over 2048", 4, 2560, 32, 4, 128,
                  query_len=512),
)
MLA = (
    MlaCase("deepseek-v2-lite mla decode", 8, 4096, 16, 512, 64),
    MlaCase("deepseek-v2-lite mla decode, batch 1 (split)", 1, 16384, 16, 512, 64),
)
#: --dry-run: tiny shapes the interpreter runs in seconds; splits forced > 1 where the real
#: shape splits, so the merge kernel runs here too.
DRY_ATTENTION = (
    AttentionCase("qwen3-30b-a3b decode", 2, 48, 4, 2, 16),
    AttentionCase("qwen3-30b-a3b decode, batch 1 (split)", 1, 80, 4, 2, 16, splits=3),
    AttentionCase("gpt-oss-20b decode, sinks (split)", 2, 64, 4, 2, 16, sinks=True, splits=2),
    AttentionCase("gpt-oss-20b decode, sinks + window 128 (split)", 2, 64, 4, 2, 16, window=8,
                  sinks=True, splits=3),
    AttentionCase("qwen3-30b-a3b prefill chunk 512 over 2048", 2, 40, 4, 2, 16, query_len=8),
)
DRY_MLA = (
    MlaCase("deepseek-v2-lite mla decode", 2, 40, 4, 32, 16),
    MlaCase("deepseek-v2-lite mla decode, batch 1 (split)", 1, 64, 4, 32, 16, splits=2),
)


def _tables(batch: int, context: int, block_size: int, device, g) -> tuple[torch.Tensor, int]:
    """Shuffled block tables [batch, blocks per request] int32 and the number of blocks."""
    per = -(-context // block_size)
    perm = torch.randperm(batch * per, generator=g, device=device) + 1  # block 0: the null block
    return perm.view(batch, per).to(torch.int32), batch * per + 1


def _visible_pairs(case: AttentionCase) -> int:
    """(query, key) pairs each request's queries see: causal, within the window."""
    total = 0
    for i in range(case.query_len):
        pos = case.context - case.query_len + i
        total += min(pos + 1, case.window or pos + 1)
    return total


def attention_row(case: AttentionCase, timer, copy_gbs: float, g, dtype) -> dict:
    """One timed and checked call of the paged attention launcher (`invoke_paged_attention`)."""
    from kernels.attention.triton_attention import invoke_paged_attention, num_kv_splits

    dev = timer.device
    tables, blocks = _tables(case.batch, case.context, case.block_size, dev, g)
    shape = (blocks, case.block_size, case.kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=dev).to(dtype)
    q = torch.randn(case.batch * case.query_len, case.q_heads, case.head_dim, generator=g,
                    device=dev).to(dtype)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=dev)
    starts = torch.arange(case.batch + 1, dtype=torch.int32, device=dev) * case.query_len
    sinks = torch.randn(case.q_heads, generator=g, device=dev) if case.sinks else None
    scale = case.head_dim**-0.5
    args = (q, k_cache, v_cache, tables, seq_lens, starts)
    kwargs = {"scale": scale, "max_query_len": case.query_len,
              "sliding_window": case.window, "sinks": sinks, "kv_splits": case.splits}
    splits = case.splits or (num_kv_splits(case.batch * case.kv_heads, tables.shape[1]
                                           * case.block_size) if case.query_len == 1 else 1)
    keys = min(case.context, case.window or case.context)
    nbytes = 2 * case.batch * keys * case.kv_heads * case.head_dim * dtype.itemsize
    row = {"kind": "prefill" if case.query_len > 1 else "decode", "name": case.name,
           "shape": f"{case.batch} x {case.context} keys, q_len {case.query_len}, "
                    f"{case.q_heads}/{case.kv_heads} x {case.head_dim}",
           "splits": splits, "bytes": nbytes, "tol": TOL[dtype]}
    want = paged_attention_ref(*args, scale=scale, sliding_window=case.window, sinks=sinks)
    row = _measure(row, lambda: invoke_paged_attention(*args, **kwargs), want, timer, copy_gbs)
    if case.query_len > 1 and "ms" in row:
        flops = 4 * case.batch * case.q_heads * case.head_dim * _visible_pairs(case)
        row["tflops"] = flops / (row["ms"] / 1e3) / 1e12
    return row


def mla_row(case: MlaCase, timer, copy_gbs: float, g, dtype) -> dict:
    """One timed and checked call of `mla_decode`."""
    from kernels.attention.triton_attention import mla_decode, num_kv_splits

    dev = timer.device
    tables, blocks = _tables(case.batch, case.context, case.block_size, dev, g)
    width = case.rank + case.rope
    latent = torch.randn(blocks, case.block_size, width, generator=g, device=dev).to(dtype)
    q = torch.randn(case.batch, case.heads, width, generator=g, device=dev).to(dtype)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=dev)
    scale = (128 + case.rope) ** -0.5  # DeepSeek's qk_nope 128 + rope head width
    splits = case.splits or num_kv_splits(case.batch, tables.shape[1] * case.block_size)
    row = {"kind": "mla", "name": case.name,
           "shape": f"{case.batch} x {case.context} latents, {case.heads} heads, "
                    f"rank {case.rank} + rope {case.rope}",
           "splits": splits, "bytes": case.batch * case.context * width * dtype.itemsize,
           "tol": TOL[dtype]}
    want = mla_decode_ref(q, latent, tables, seq_lens, scale=scale, kv_lora_rank=case.rank)
    return _measure(row, lambda: mla_decode(q, latent, tables, seq_lens, scale=scale,
                                            kv_lora_rank=case.rank, kv_splits=case.splits),
                    want, timer, copy_gbs)


def _measure(row: dict, call, want: torch.Tensor, timer, copy_gbs: float) -> dict:
    """`row` with the error against `want`, `ok`, and the median time and bandwidth; a call
    that raises gives `error`."""
    try:
        got = call()
        row["err"] = rel_error(got, want)
        row["ok"] = row["err"] < row["tol"]
        ms = timer.median_ms(call)
    except Exception as exc:  # one broken kernel must not hide the other rows
        return row | {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    gbs = row["bytes"] / (ms / 1e3) / 1e9
    return row | {"ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs}
