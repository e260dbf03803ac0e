"""Native decode attention (csrc/paged_attention.cpp) and linear (csrc/linear_cpu.cpp) against
float64 torch references, on fresh random inputs each run. A build failure fails the tests."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.native_decode import paged_decode_attention
from kernels.dense.amx import amx_unavailable_reason, bf16_backend
from kernels.dense.native_linear import PackedLinear
from kernels.native.library import _build
from kernels.plan import NATIVE_CPU, TORCH, KernelPlan
from moe_engine.models.layers.attention import attention_with_sinks


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    _build("paged_attention")
    _build("linear_cpu")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _paged(g, lens, hkv, d, block_size, dtype):
    """Random caches and block tables (shuffled blocks, null block 0 never used) for `lens`."""
    blocks = [-(-n // block_size) for n in lens]
    width = max(blocks)
    total = sum(blocks)
    k_cache = torch.randn(total + 1, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(total + 1, block_size, hkv, d, generator=g).to(dtype)
    ids = (torch.randperm(total, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for row, nb in enumerate(blocks):
        tables[row, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
    return k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, lens, scale, window=None, sinks=None):
    """float64: each row's keys gathered slot by slot, explicit softmax (with sinks)."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for row, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[row, pos // bs] * bs + pos % bs
        keys = k_cache.reshape(-1, hkv, d)[slots].double().transpose(0, 1)[None]  # [1,Hkv,n,D]
        values = v_cache.reshape(-1, hkv, d)[slots].double().transpose(0, 1)[None]
        visible = torch.ones(1, 1, 1, n, dtype=torch.bool)
        if window is not None:
            visible &= (pos > n - 1 - window)[None, None, None]
        s = torch.full((hq, 1), -1e30, dtype=torch.float64)  # no sink: a logit that vanishes
        if sinks is not None:
            s = sinks.double()[:, None]
        o = attention_with_sinks(q[row].double()[None, :, None], keys, values, visible, s, scale)
        out[row] = o[0, :, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size"), [(8, 2, 64, 16), (4, 4, 32, 8)])
def test_decode_attention_matches_reference(dtype, hq, hkv, d, block_size):
    g = _gen()
    lens = [1, block_size, block_size + 1, 37, int(torch.randint(2, 90, (1,), generator=g))]
    k_cache, v_cache, tables = _paged(g, lens, hkv, d, block_size, dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    got = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_decode_attention_sliding_window_and_sinks():
    g = _gen()
    lens, hq, hkv, d = [3, 20, 41], 8, 2, 16
    k_cache, v_cache, tables = _paged(g, lens, hkv, d, 4, torch.float32)
    q = torch.randn(3, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2
    for window, s in ((8, None), (None, sinks), (8, sinks), (1, None)):
        got = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.3,
                                     sliding_window=window, sinks=s)
        want = _reference(q, k_cache, v_cache, tables, lens, 0.3, window, s)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("hq", "hkv", "d", "block_size"),
                         [(8, 2, 64, 16), (16, 1, 32, 32), (6, 3, 128, 16), (4, 2, 256, 16)])
def test_decode_attention_scores_on_the_bf16_kernels(hq, hkv, d, block_size):
    """bf16 shapes the AMX scores take (csrc/amx_attention.cpp: whole 16-key tiles, keys
    outside [first, L) discarded, a window starting inside a tile, lengths ending inside one),
    and, where the CPU has no AMX, the AVX512-BF16 ones (csrc/bf16_dot.cpp: 16 / G keys at a
    time, a last partial group), against float64, and within bf16 rounding of the
    float32-FMA scores (amx=False)."""
    if bf16_backend() is None:
        pytest.skip(f"bf16 kernels off here: {amx_unavailable_reason()}")
    g = _gen()
    lens = [1, 15, 16, 17, 33, block_size * 3 + 5, int(torch.randint(2, 200, (1,), generator=g))]
    k_cache, v_cache, tables = _paged(g, lens, hkv, d, block_size, torch.bfloat16)
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    for window in (None, 7, 20):
        args = (q, k_cache, v_cache, tables, torch.tensor(lens), d**-0.5)
        got = paged_decode_attention(*args, sliding_window=window)
        off = paged_decode_attention(*args, sliding_window=window, amx=False)
        want = _reference(q, k_cache, v_cache, tables, lens, d**-0.5, window)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.double(), off.double(), rtol=2e-2, atol=2e-2)


def test_decode_attention_rejects_bad_arguments():
    g = _gen()
    k_cache, v_cache, tables = _paged(g, [5], 2, 16, 4, torch.float32)
    q = torch.randn(1, 4, 16, generator=g)
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([9]), 0.25)
    with pytest.raises(RuntimeError, match="head_dim"):
        paged_decode_attention(q[..., :12].contiguous(), k_cache, v_cache, tables,
                               torch.tensor([5]), 0.25)
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([0]), 0.25)
    with pytest.raises(RuntimeError, match="block_tables must be int64"):
        paged_decode_attention(q, k_cache, v_cache, tables.int(), torch.tensor([5]), 0.25)
    with pytest.raises(RuntimeError, match="k_cache/v_cache"):
        paged_decode_attention(q, k_cache, v_cache[:-1], tables, torch.tensor([5]), 0.25)
    with pytest.raises(RuntimeError, match="sinks"):
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([5]), 0.25,
                               sinks=torch.zeros(3))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 24), (7, 16, 64), (100, 33, 8), (1, 8192, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(m, n, k, bias):
    g = _gen()
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    packed = PackedLinear.pack(w, b)
    assert packed.weight.dtype == torch.float32  # random float32 values: not bfloat16-exact
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(packed(x).double(), want, rtol=1e-5, atol=1e-4)
    exact = PackedLinear.pack(w.bfloat16().float(), b)
    assert exact.weight.dtype == torch.bfloat16
    want = x.double() @ w.bfloat16().double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(exact(x[None]).double()[0], want, rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    got = exact(xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), xb.double() @ w.bfloat16().double().t()
                               + (0 if b is None else b.double()), rtol=2e-2, atol=2e-2)


def test_linear_rejects_what_the_kernel_would_misread():
    g = _gen()
    packed = PackedLinear.pack(torch.randn(20, 24, generator=g))
    with pytest.raises(RuntimeError, match="K = 24"):
        packed(torch.randn(3, 16, generator=g))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        packed(torch.randn(3, 24, generator=g).half())
    x = torch.randn(2, 3, 48, generator=g)[..., ::2]  # strided: copied, not misread
    torch.testing.assert_close(packed(x), x @ unpack_weight(packed).T, rtol=1e-5, atol=1e-5)


def unpack_weight(packed: PackedLinear) -> torch.Tensor:
    w = packed.weight.transpose(1, 2).reshape(-1, packed.in_features)
    return w[: packed.out_features].float()


def test_linear_module_repacks_after_reset_and_matches_torch_on_large_batches():
    from kernels.dense.linear import NARROW_MAX_ROWS, NATIVE_MAX_ROWS
    from moe_engine.models.layers.linear import Linear

    g = _gen()
    layer = Linear(16, 80, bias=True)
    router = Linear(16, 32, bias=False)  # narrower than NATIVE_MIN_OUT_FEATURES
    x = torch.randn(5, 16, generator=g)
    layer(x)
    assert layer.kernel.packed is None  # unbound: torch
    for module in (layer, router):
        module.bind_kernels(KernelPlan.uniform(NATIVE_CPU))
    first = layer(x)
    assert layer.kernel.packed is not None  # the native path ran
    torch.testing.assert_close(first, torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(router(x), torch.nn.functional.linear(x, router.weight))
    assert router.kernel.packed is not None  # a few rows: native, on the calling thread
    wide_batch = torch.randn(NARROW_MAX_ROWS + 1, 16, generator=g)
    router.reset_packed()
    torch.testing.assert_close(router(wide_batch), torch.nn.functional.linear(wide_batch,
                                                                              router.weight))
    assert router.kernel.packed is None  # more rows: torch's GEMM
    with torch.no_grad():
        layer.weight.mul_(2)
    layer.reset_packed()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    big = torch.randn(NATIVE_MAX_ROWS + 1, 16, generator=g)  # the torch path
    torch.testing.assert_close(layer(big), torch.nn.functional.linear(big, layer.weight,
                                                                       layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_native_rms_norm_matches_torch_path(dtype, weight_in_float32):
    from kernels.dense.ops import rms_norm
    from moe_engine.models.layers.norm import RMSNorm

    _build("ops_cpu")
    g = _gen()
    norm = RMSNorm(64, 1e-5, dtype=dtype, weight_in_float32=weight_in_float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    norm.bind_kernels(KernelPlan.uniform(TORCH))  # the torch path: the reference
    fused = torch.randn(7, 10 * 64, generator=g).to(dtype)
    inputs = [torch.randn(64, generator=g).to(dtype), torch.randn(9, 64, generator=g).to(dtype),
              fused[:, : 8 * 64].view(7, 8, 64)]  # heads sliced out of a fused QKV output
    for x in inputs:
        want = norm(x)
        got = rms_norm(x, norm.weight, 1e-5, weight_in_float32)
        assert got.dtype == dtype and got.shape == x.shape
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_native_rms_norm_rejects_what_the_kernel_would_misread():
    from kernels.dense.ops import rms_norm

    _build("ops_cpu")
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        rms_norm(torch.randn(64, 4).T, w, 1e-6)
    with pytest.raises(RuntimeError, match="x's dtype"):
        rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        rms_norm(x, torch.randn(32), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        rms_norm(torch.randn(2, 2, 2, 64), w, 1e-6)
