"""Triton paged attention and MLA decode (`kernels.attention.triton_attention`) against float64
torch.

The kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set below before the first
`triton` import) on tiny fresh random inputs (tests/attention_refs.py: the cases, references
and tolerances). Cache slots no request owns (the null block 0, the tail of each request's last
block, unused blocks) hold NaN: a kernel that reads one fails. The served families' real head
dims and split counts are in tests/test_triton_attention_real_shapes.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from attention_refs import (  # noqa: E402
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

from kernels.attention.triton_attention import (  # noqa: E402
    mla_decode,
    num_kv_splits,
    paged_attention,
    tile_config,
)

# --- decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, window, sinks",
    [
        (torch.float32, None, False),
        (torch.float32, 7, True),
        (torch.bfloat16, None, True),
        (torch.bfloat16, 20, False),
        (torch.float16, None, False),
    ],
)
def test_decode_matches_reference(dtype, window, sinks) -> None:
    g = gen()
    seq_lens = torch.randint(1, 60, (3,), generator=g).tolist()
    case = paged_case(g, [1, 1, 1], seq_lens, hq=8, hkv=2, dtype=dtype, sinks=sinks)
    check_paged(case, window)


@pytest.mark.parametrize("splits", [2, 3])
def test_decode_split_kv_matches_reference(splits: int) -> None:
    g = gen()
    case = paged_case(g, [1, 1, 1], [70, 0, 33], hq=4, hkv=4, block_size=32, sinks=True)
    got = check_paged(case, 40, kv_splits=splits)
    assert bool((got[1] == 0).all())  # seq_len 0: zeros, sinks or not


def test_decode_splits_chosen_from_table_width() -> None:
    g = gen()  # 64-block tables: 1024 key slots, 2 requests x 2 kv heads -> 2 splits
    case = paged_case(g, [1, 1], [45, 0], block_size=16, width=64, sinks=True)
    assert num_kv_splits(2 * 2, 64 * 16) == 2
    got = check_paged(case)
    assert bool((got[1] == 0).all())


def test_num_kv_splits_from_shapes() -> None:
    assert num_kv_splits(programs=8, max_keys=256) == 1  # short tables: one split
    assert num_kv_splits(programs=512, max_keys=1 << 16) == 1  # the batch fills the device
    assert 1 < num_kv_splits(programs=8, max_keys=1 << 16) <= 16
    for d in (16, 64, 128, 256, 512):
        for block_size in (16, 32, 128):
            for dtype in (torch.float32, torch.bfloat16):
                for decode in (False, True):
                    cfg = tile_config(d, block_size, decode=decode, dtype=dtype)
                    assert cfg.block_m >= 16 and cfg.block_n >= 16
                    assert cfg.block_n & (cfg.block_n - 1) == 0  # a power of two
                    assert block_size > 64 or cfg.block_n % block_size == 0  # whole blocks


# --- prefill --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, block_size, index_dtype",
    [(16, 16, torch.int32), (32, 32, torch.int64), (64, 16, torch.int64), (48, 16, torch.int32)],
)
def test_chunked_prefill_mixed_lengths(d: int, block_size: int, index_dtype) -> None:
    g = gen()
    ctx = torch.randint(0, 40, (4,), generator=g).tolist()
    q_lens = [7, 1, 19, 3]  # a chunk with context, a decode row, a fresh prompt, a short chunk
    ctx[2] = 0
    seq_lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    case = paged_case(g, q_lens, seq_lens, hq=6, hkv=2, d=d, block_size=block_size,
                      index_dtype=index_dtype)  # fmt: skip
    check_paged(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_crossing_blocks_with_sinks(dtype) -> None:
    g = gen()
    # windows of 20 starting mid-block and spanning 2-3 blocks of 16; one row shorter than it
    case = paged_case(g, [10, 5, 24], [41, 12, 57], hq=4, hkv=1, dtype=dtype, sinks=True)
    check_paged(case, 20)
    check_paged(case, 1)  # each query sees only itself


def test_padded_rows_give_zeros() -> None:
    g = gen()
    for q_lens, seq_lens in (([1, 1, 1, 1], [9, 0, 17, 0]), ([4, 1, 2], [4, 0, 30])):
        for sinks in (False, True):
            case = paged_case(g, q_lens, seq_lens, sinks=sinks)
            got = check_paged(case)
            qsl = case["query_start_loc"]
            for b, n in enumerate(seq_lens):
                if n == 0:
                    assert bool((got[qsl[b] : qsl[b + 1]] == 0).all())


def test_paged_attention_rejects_bad_inputs() -> None:
    case = paged_case(gen(), [2, 1], [5, 9])
    with pytest.raises(ValueError, match="Hkv"):
        paged_attention(**{**case, "q": case["q"][:, :3]})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(**{**case, "block_tables": case["block_tables"].float()})
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(**case, sliding_window=0)
    with pytest.raises(ValueError, match="k_cache.dtype"):
        paged_attention(**{**case, "k_cache": case["k_cache"].half()})
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(**{**case, "query_start_loc": case["query_start_loc"][:2]})


# --- MLA decode -----------------------------------------------------------------------------

RANK, ROPE = 32, 16


@pytest.mark.parametrize(
    "dtype, splits, index_dtype",
    [
        (torch.float32, 1, torch.int32),
        (torch.float32, 3, torch.int64),
        (torch.bfloat16, 2, torch.int64),
    ],
)
def test_mla_decode_matches_reference(dtype, splits: int, index_dtype) -> None:
    g = gen()
    seq_lens, heads, block_size = [37, 0, 64, 5], 20, 16  # 20 heads: two head tiles of 16
    tables, num_blocks = make_tables(g, seq_lens, block_size, index_dtype)
    cache = torch.randn(num_blocks, block_size, RANK + ROPE, generator=g).to(dtype)
    cache = nan_unowned(cache, owned_slots(tables, seq_lens, block_size))
    q = torch.randn(len(seq_lens), heads, RANK + ROPE, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype)
    scale = (RANK + ROPE) ** -0.5
    out = torch.full((len(seq_lens), heads, RANK), float("nan"), dtype=dtype)
    got = mla_decode(q, cache, tables, lens, scale=scale, kv_lora_rank=RANK, out=out,
                     kv_splits=splits)  # fmt: skip
    assert got is out and got.dtype == dtype
    assert rel_err(got, mla_reference(q, cache, tables, lens, scale, RANK)) < RTOL[dtype]
    assert bool((got[1] == 0).all())
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, cache, tables, lens, scale=scale, kv_lora_rank=RANK + ROPE)
