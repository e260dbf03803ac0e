"""Triton paged attention and MLA decode at the served families' real head shapes, on the paths
real traffic takes, against float64 torch (tests/attention_refs.py: cases, references,
tolerances).

What real traffic takes and tests/test_triton_attention.py's tiny shapes do not:

- Flash-decoding splits: a CUDA graph's block tables are ``ceil(max_model_len / block_size)``
  wide (moe_engine/runner/cuda_graphs.py), and `num_kv_splits` picks the split count from that
  width and the (request, kv head) programs, not from the requests' lengths: 16 splits at batch 1
  for every served family, so `merge_kv_splits_kernel` runs on nearly every real decode step,
  with most splits of a short request empty. The tests here size tables that way (the width is
  free: a program reads only its own request's tiles) and check 1, 2, 3 and 16 splits.
- Real head dims and GQA groups: 64 with 8 query heads per kv head (gpt-oss), 128 with 8
  (Qwen3-MoE) and 12 (GLM-4.5, a group that pads to 16 rows), 256 with 8 (Qwen3-Next's full
  attention); one kv head per case keeps the interpreter's time small (a kv head is its own
  program, so more heads add programs, not paths).
- gpt-oss's window of 128 and sinks (in the checkpoint's bfloat16) with splits.
- MLA absorbed decode at DeepSeek-V2-Lite's sizes: 16 heads, kv_lora_rank 512, rope 64,
  softmax scale (qk_nope 128 + rope 64) ** -0.5.

Every case has ragged lengths in one batch (a long request, one shorter than one key tile, a
CUDA-graph padding row of length 0) over random non-contiguous blocks, with NaN in every slot
no request owns.
"""

from __future__ import annotations

import pytest
import torch
from attention_refs import (
    RTOL,
    check_paged,
    gen,
    make_tables,
    mla_reference,
    nan_unowned,
    owned_slots,
    paged_case,
    rel_err,
)

triton = pytest.importorskip("triton")

from kernels.attention.triton_attention import (  # noqa: E402
    MAX_KV_SPLITS,
    mla_decode,
    num_kv_splits,
    tile_config,
)

BLOCK_SIZE = 16  # the engine's default KV block (tokens)
MAX_MODEL_LEN = 32768  # a served context length: graph tables of 2048 blocks


def graph_width(max_model_len: int = MAX_MODEL_LEN, block_size: int = BLOCK_SIZE) -> int:
    """The block-table width a captured decode graph reads (cuda_graphs.py: W)."""
    return -(-max_model_len // block_size)


def ragged_lens(g: torch.Generator, long_lo: int, long_hi: int, tile: int) -> list[int]:
    """[a long request, one shorter than one key tile, a padding row (0)]."""
    long = int(torch.randint(long_lo, long_hi, (1,), generator=g))
    short = int(torch.randint(1, tile, (1,), generator=g))
    return [long, short, 0]


# --- how many splits real decode steps take ----------------------------------------------------


@pytest.mark.parametrize(
    "family, kv_heads",
    [("qwen3-30b-a3b", 4), ("gpt-oss-20b", 8), ("mixtral-8x7b", 8), ("qwen3-next-80b", 2)],
)
def test_graph_sized_tables_split_decode_sixteen_ways_at_batch_one(family, kv_heads) -> None:
    """At max_model_len 32768 (2048 blocks of 16), the graphs' split counts by batch size."""
    keys = graph_width() * BLOCK_SIZE
    assert num_kv_splits(1 * kv_heads, keys) == MAX_KV_SPLITS == 16
    for batch in (2, 4, 8, 16, 32, 64, 128, 256):
        want = max(1, min(16, -(-256 // (batch * kv_heads))))
        assert num_kv_splits(batch * kv_heads, keys) == want, (family, batch)
    # eager steps size tables by the longest request: short contexts take one split
    assert num_kv_splits(kv_heads, 1023) == 1
    assert num_kv_splits(kv_heads, 1024) == 2


def test_mla_graph_tables_split_sixteen_ways() -> None:
    """DeepSeek-V2-Lite: 16 heads are one head tile, so batch 1 is one program per split."""
    assert num_kv_splits(1, graph_width() * BLOCK_SIZE) == 16
    assert num_kv_splits(1, 4096) == 8  # max_model_len 4096: 8 splits of 512 keys
    assert num_kv_splits(16, graph_width() * BLOCK_SIZE) == 16  # batch 16: 16 x 16 programs
    assert num_kv_splits(32, graph_width() * BLOCK_SIZE) == 8


# --- paged decode with splits ------------------------------------------------------------------


@pytest.mark.slow  # about 2-3 s a case under the interpreter
@pytest.mark.parametrize(
    "d, groups, dtype",
    [
        (128, 8, torch.bfloat16),  # Qwen3-MoE
        (128, 12, torch.float32),  # GLM-4.5: 12 query heads per kv head, padded to 16 rows
        (256, 8, torch.bfloat16),  # Qwen3-Next full attention
    ],
)
def test_decode_on_graph_sized_tables_takes_sixteen_splits(d, groups, dtype) -> None:
    g = gen()
    block_n = tile_config(d, BLOCK_SIZE, decode=True, dtype=dtype).block_n
    seq_lens = ragged_lens(g, 900, 1300, block_n)
    case = paged_case(g, [1, 1, 1], seq_lens, hq=groups, hkv=1, d=d, dtype=dtype,
                      width=graph_width())  # fmt: skip
    assert num_kv_splits(3 * 1, graph_width() * BLOCK_SIZE) == 16  # what the launch picks
    got = check_paged(case)
    assert bool((got[2] == 0).all())


@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_decode_split_counts(splits: int) -> None:
    """gpt-oss's head shape (64, 8 query heads per kv head, bf16 sinks) at forced split counts:
    one, two, a non-power of two, the most."""
    g = gen()
    seq_lens = [int(torch.randint(500, 800, (1,), generator=g)), 40, 0, 333]
    case = paged_case(g, [1] * 4, seq_lens, hq=8, hkv=1, d=64, dtype=torch.bfloat16,
                      sinks=True, sinks_dtype=torch.bfloat16, width=graph_width())  # fmt: skip
    got = check_paged(case, kv_splits=splits)
    assert bool((got[2] == 0).all())


# --- sliding window and sinks with splits (gpt-oss) ------------------------------------------


@pytest.mark.parametrize(
    "window, splits, sinks_dtype",
    [
        # gpt-oss: window 128 over 64-key tiles: 3 tiles of the window, 13 empty splits
        (128, 16, torch.bfloat16),
        # a window that is no multiple of the tile: its first key mid-tile, inside split 0
        (300, 3, torch.float32),
        (300, 2, torch.bfloat16),
    ],
)
def test_decode_window_and_sinks_with_splits(window, splits, sinks_dtype) -> None:
    g = gen()
    long = int(torch.randint(700, 1000, (1,), generator=g))
    # longer than the window; exactly the window; one key past it; shorter; padding
    seq_lens = [long, window, window + 1, 50, 0]
    case = paged_case(g, [1] * 5, seq_lens, hq=8, hkv=1, d=64, dtype=torch.bfloat16,
                      sinks=True, sinks_dtype=sinks_dtype, width=graph_width())  # fmt: skip
    got = check_paged(case, window, kv_splits=splits)
    assert bool((got[4] == 0).all())


# --- prefill chunks over cached context ---------------------------------------------------------


@pytest.mark.parametrize(
    "d, groups, dtype, window",
    [
        (128, 8, torch.bfloat16, None),  # Qwen3-MoE
        (256, 8, torch.bfloat16, None),  # Qwen3-Next full attention
        (64, 8, torch.bfloat16, 128),  # gpt-oss sliding layers (bf16 sinks)
        (128, 4, torch.float32, None),  # Mixtral, a float32 checkpoint
    ],
)
def test_prefill_chunks_over_cached_context(d, groups, dtype, window) -> None:
    """Chunks starting mid-block after cached context, a decode row and a fresh prompt, in one
    batch; block boundaries every 16 keys under 32-64-key tiles."""
    g = gen()
    ctx = [int(torch.randint(130, 200, (1,), generator=g)), 37, 0]
    q_lens = [int(torch.randint(9, 24, (1,), generator=g)), 1, 21]
    seq_lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    sinks = window is not None
    case = paged_case(g, q_lens, seq_lens, hq=groups, hkv=1, d=d, dtype=dtype, sinks=sinks,
                      sinks_dtype=torch.bfloat16)  # fmt: skip
    check_paged(case, window)


# --- MLA decode at DeepSeek-V2-Lite's sizes ------------------------------------------------------

HEADS, KV_LORA_RANK, ROPE_DIM, NOPE_DIM = 16, 512, 64, 128
MLA_SCALE = (NOPE_DIM + ROPE_DIM) ** -0.5


@pytest.mark.parametrize(
    "dtype, block_size, splits",
    [
        (torch.bfloat16, 16, None),  # graph-sized tables: 16 splits
        (torch.float32, 64, 3),
        (torch.bfloat16, 64, 2),
    ],
)
def test_mla_decode_deepseek_v2_lite(dtype, block_size, splits) -> None:
    g = gen()
    seq_lens = [int(torch.randint(70, 100, (1,), generator=g)), 0, 11]
    width = graph_width(block_size=block_size)
    tables, num_blocks = make_tables(g, seq_lens, block_size, width=width)
    cache = torch.randn(num_blocks, block_size, KV_LORA_RANK + ROPE_DIM, generator=g).to(dtype)
    cache = nan_unowned(cache, owned_slots(tables, seq_lens, block_size))
    q = torch.randn(len(seq_lens), HEADS, KV_LORA_RANK + ROPE_DIM, generator=g).to(dtype)
    lens = torch.tensor(seq_lens)
    if splits is None:
        assert num_kv_splits(len(seq_lens), width * block_size) == 16
    out = torch.full((len(seq_lens), HEADS, KV_LORA_RANK), float("nan"), dtype=dtype)
    got = mla_decode(q, cache, tables, lens, scale=MLA_SCALE, kv_lora_rank=KV_LORA_RANK,
                     out=out, kv_splits=splits)  # fmt: skip
    want = mla_reference(q, cache, tables, lens, MLA_SCALE, KV_LORA_RANK)
    assert got is out and rel_err(got, want) < RTOL[dtype]
    assert bool((got[1] == 0).all())
