"""The native CPU MoE kernel (kernels/native/csrc/moe_cpu.cpp) against a float64 torch reference.

Fresh random inputs each run; the kernel must build here (`--kernel-backend native-cpu` semantics: a
build failure is a test failure, not a skip).
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.native import PackedExperts, pack_tiles
from kernels.moe.reference import fused_moe_reference
from kernels.native.library import _build

GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    _build("moe_cpu")  # raises NativeUnavailable with the compiler's message


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _case(g, t, h, inter, e, k, *, dtype=torch.float32, bias=False):
    hidden = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    logits = torch.randn(t, e, generator=g)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
    b13 = torch.randn(e, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None

    def cast(x):
        return None if x is None else x.to(dtype)

    return (cast(hidden), cast(w13), cast(w2), topk_weights, topk_ids.to(torch.int32),
            cast(b13), cast(b2))


def _reference(hidden, w13, w2, weights, ids, activation=SILU_AND_MUL, b13=None, b2=None):
    def d(x):
        return None if x is None else x.double()

    return fused_moe_reference(d(hidden), d(w13), d(w2), weights, ids, activation=activation,
                               b13=d(b13), b2=d(b2))


@pytest.mark.parametrize(
    ("t", "h", "inter", "e", "k"),
    [(1, 64, 32, 8, 2),       # one token
     (13, 40, 24, 6, 3),      # H and I not multiples of the 16-column tile
     (37, 48, 16, 4, 4),      # top_k == num_experts
     (200, 32, 48, 16, 4)],   # several 6-row blocks per expert
)
def test_matches_float64_reference(t, h, inter, e, k):
    hidden, w13, w2, weights, ids, _, _ = _case(_gen(), t, h, inter, e, k)
    got = PackedExperts.pack(w13, w2)(hidden, weights, ids)
    want = _reference(hidden, w13, w2, weights, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [1, 61])
def test_every_work_item_runs_once_whatever_the_thread_count(t):
    """The pool's items (expert x 16-column tile x row chunk) are claimed a few at a time
    (csrc/thread_pool.cpp `claim_batch`): with 1 to 5 threads, item counts that no batch size
    divides, every item must run exactly once, so the output is bit-identical to one thread's
    (items write disjoint outputs; a skipped item would leave the previous call's values in the
    kernel's reused scratch, so a call on other tokens comes first) and to the float64
    reference."""
    # 13 tiles of the intermediate and 20 of the hidden size per expert: 78-240 items a phase
    hidden, w13, w2, weights, ids, _, _ = _case(_gen(), t, 320, 200, 6, 6)
    packed = PackedExperts.pack(w13, w2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(hidden, weights, ids)
        for threads in (2, 3, 5):
            for _ in range(3):
                # a call on other tokens (another count, so other row offsets) first, on one
                # thread: every item of it runs, and the reused scratch holds its values
                other, _, _, other_weights, other_ids, _, _ = _case(_gen(), t + 7, 320, 200, 6, 6)
                torch.set_num_threads(1)
                packed(other, other_weights, other_ids)
                torch.set_num_threads(threads)
                torch.testing.assert_close(packed(hidden, weights, ids), one, rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)
    want = _reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(one.double(), want, rtol=1e-4, atol=1e-4)


def test_remote_slots_zero_tokens_and_idle_experts():
    g = _gen()
    hidden, w13, w2, weights, ids, _, _ = _case(g, 19, 32, 16, 8, 2)
    ids[::3, 1] = -1  # slots of other ranks' experts
    ids[ids == 5] = 6  # expert 5 gets no token
    ids[4, 0] = 8  # an id past this rank's experts: skipped too
    packed = PackedExperts.pack(w13, w2)
    want = _reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(packed(hidden, weights, ids).double(), want, rtol=1e-4, atol=1e-4)
    none = torch.full_like(ids, -1)
    assert packed(hidden, weights, none).abs().max() == 0
    assert packed(hidden[:0], weights[:0], ids[:0]).shape == (0, 32)


def test_all_tokens_to_one_expert_and_int64_ids():
    # 250 rows on one expert: several 96-row work chunks (csrc/moe_cpu.cpp kChunk)
    hidden, w13, w2, weights, ids, _, _ = _case(_gen(), 250, 32, 16, 8, 2)
    ids[:, 0] = 7  # the last expert holds every token
    got = PackedExperts.pack(w13, w2)(hidden, weights, ids.long())
    torch.testing.assert_close(got.double(), _reference(hidden, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-4)


def test_gpt_oss_clamped_activation_and_biases():
    hidden, w13, w2, weights, ids, b13, b2 = _case(_gen(), 23, 48, 40, 8, 4, bias=True)
    hidden = hidden * 4  # push gate/up past the clamp limit
    packed = PackedExperts.pack(w13, w2, activation=GPT_OSS, b13=b13, b2=b2)
    want = _reference(hidden, w13, w2, weights, ids, GPT_OSS, b13, b2)
    got = packed(hidden, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    plain = PackedExperts.pack(w13, w2, b13=b13, b2=b2)(hidden, weights, ids)
    assert (plain - got).abs().max() > 1e-2  # the activation really differs


def test_bfloat16_weights_and_activations():
    hidden, w13, w2, weights, ids, _, _ = _case(_gen(), 29, 64, 32, 8, 2, dtype=torch.bfloat16)
    packed = PackedExperts.pack(w13, w2)
    assert packed.w13.dtype == torch.bfloat16
    got = packed(hidden, weights, ids)
    assert got.dtype == torch.bfloat16
    want = _reference(hidden, w13, w2, weights, ids)  # float64 on the same bf16 values
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_float32_weights_pack_as_bfloat16_only_when_exact():
    hidden, w13, w2, weights, ids, _, _ = _case(_gen(), 9, 32, 16, 4, 2)
    assert PackedExperts.pack(w13, w2).w13.dtype == torch.float32  # random fp32: not exact
    r13, r2 = w13.bfloat16().float(), w2.bfloat16().float()
    packed = PackedExperts.pack(r13, r2)
    assert packed.w13.dtype == torch.bfloat16 and packed.nbytes < r13.nbytes + r2.nbytes
    torch.testing.assert_close(packed(hidden, weights, ids).double(),
                               _reference(hidden, r13, r2, weights, ids), rtol=1e-4, atol=1e-4)


def test_pack_tiles_round_trip_and_shape_errors():
    w = torch.randn(3, 37, 20)
    packed = pack_tiles(w)
    assert packed.shape == (3, 3, 20, 16)
    assert torch.equal(packed.transpose(2, 3).reshape(3, -1, 20)[:, :37], w)
    with pytest.raises(ValueError, match="w2"):
        PackedExperts.pack(torch.randn(2, 8, 6), torch.randn(2, 6, 5))


def test_call_rejects_what_the_kernel_would_misread():
    """The C kernel trusts raw pointers: every mismatch is refused before the call."""
    g = _gen()
    hidden, w13, w2, weights, ids, _, _ = _case(g, 3, 32, 16, 4, 2)
    packed = PackedExperts.pack(w13, w2)
    with pytest.raises(RuntimeError, match="hidden size 32"):
        packed(hidden[:, :16].contiguous(), weights, ids)
    with pytest.raises(RuntimeError, match="topk_ids must be"):
        packed(hidden, weights[:2], ids[:2])
    with pytest.raises(RuntimeError, match="topk_weights"):
        packed(hidden, weights[:, :1], ids)
    with pytest.raises(RuntimeError, match="hidden must be float32 or bfloat16"):
        packed(hidden.half(), weights, ids)
    with pytest.raises(RuntimeError, match="biases must be"):
        bad = PackedExperts(packed.w13, packed.w2, torch.zeros(4, 3), torch.zeros(4, 32), 16,
                            32, packed.activation)
        bad(hidden, weights, ids)
    # hidden given strided and ids as int16 are made contiguous / int64 (no misread)
    wide = torch.zeros(3, 64)
    wide[:, ::2] = hidden
    torch.testing.assert_close(packed(wide[:, ::2], weights, ids.to(torch.int16)),
                               packed(hidden, weights, ids))


def test_engine_layer_uses_native_kernel_and_repacks_after_load():
    from moe_engine.models.layers.expert_weights import load_expert
    from moe_engine.models.layers.moe import FusedMoE

    g = _gen()
    moe = FusedMoE(8, 2, 32, 16, renormalize=True, dtype=torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(11, 32, generator=g)
    first = moe(x)
    assert moe._packed is not None
    new = torch.randn(16, 32, generator=g) * 0.2
    load_expert(moe, 3, "gate", new)  # a later load must not serve stale packed weights
    assert moe._packed is None
    logits = moe.gate(x)
    weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = _reference(x, moe.w13.data, moe.w2.data, weights, ids.int())
    torch.testing.assert_close(moe(x).double(), want, rtol=1e-4, atol=1e-4)
    assert first.shape == (11, 32)
