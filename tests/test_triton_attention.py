"""Triton paged attention and MLA decode (`kernels.attention.triton_attention`) against float64
torch.

The kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set below before the first
`triton` import) on tiny fresh random inputs; each test prints its seed (shown by pytest on
failure). Inputs are rounded to the tested dtype first and the reference sees the same rounded
values. Tolerances (relative Frobenius error of the output against the float64 reference):
float32 < 1e-5; bfloat16 and float16 < 1e-2. Cache slots no request owns (the null block 0, the
tail of each request's last block, unused blocks) hold NaN: a kernel that reads one fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.attention.triton_attention import (  # noqa: E402
    invoke_paged_attention,
    mla_decode,
    num_kv_splits,
    paged_attention,
    tile_config,
)

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
               index_dtype=torch.int64, sinks=False, width=None):  # fmt: skip
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
        "sinks": torch.randn(hq, generator=g) if sinks else None,
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


def mla_reference(q, latent_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    b, heads, _ = q.shape
    out = torch.zeros(b, heads, RANK, dtype=torch.float64)
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    block_size = latent_cache.shape[1]
    for row, slots in enumerate(owned_slots(block_tables, seq_lens.tolist(), block_size)):
        if slots.numel():
            latent = flat[slots].double()
            probs = torch.softmax(q[row].double() @ latent.T * scale, dim=-1)
            out[row] = probs @ latent[:, :RANK]
    return out


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
    assert rel_err(got, mla_reference(q, cache, tables, lens, scale)) < RTOL[dtype]
    assert bool((got[1] == 0).all())
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, cache, tables, lens, scale=scale, kv_lora_rank=RANK + ROPE)
