"""The Triton kernels compiled for a CUDA device, against float64 torch references (`gpu` mark).

Skipped without CUDA (the reason says so); `bench/gpu_check.sh` runs them on a GPU machine
(`pytest -m gpu`, with `TRITON_INTERPRET=0` so that no test module that sets the interpreter
switch for the CPU turns these kernels into interpreted ones: Triton decides when a kernel is
decorated). The CPU twins, under the interpreter at tiny shapes, are
tests/test_fused_moe_triton.py and tests/test_triton_attention.py.

Shapes are realistic-ish (hidden 1024, 32 experts top-8; 32/4 heads of 128 over up to ~700
tokens of paged context) and inputs fresh random each run. Tolerance: relative Frobenius error
of the output against the float64 reference on the same rounded inputs (the quantized weights
dequantized to what the kernel sees) < 1e-2 in bf16, as in the CPU tests.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.moe.activation import SILU_AND_MUL, SwiGLU  # noqa: E402
from kernels.moe.fused_moe import fused_moe, fused_moe_int4, fused_moe_mxfp4  # noqa: E402
from kernels.moe.reference import fused_moe_reference  # noqa: E402
from quant.int4 import dequantize_int4, quantize_int4  # noqa: E402
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() "
        "is False); bench/gpu_check.sh runs these on a GPU machine"
    ),
]  # fmt: skip

CUDA = torch.device("cuda")
BF16_RTOL = 1e-2
HIDDEN, INTER, EXPERTS, TOP_K, INT4_GROUP = 1024, 384, 32, 8, 128


@pytest.fixture(autouse=True)
def compiled_triton() -> None:
    """Fail, not pass slowly, when the kernels were decorated under the interpreter."""
    if triton.knobs.runtime.interpret:
        pytest.fail("TRITON_INTERPRET is on: the kernels would be interpreted, not compiled; "
                    "run the gpu tests with TRITON_INTERPRET=0 (bench/gpu_check.sh does)")


def gen() -> torch.Generator:
    return torch.Generator(device=CUDA).manual_seed(torch.seed() % (2**31))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


# --- fused MoE -------------------------------------------------------------------------------


def make_moe(g: torch.Generator, tokens: int) -> dict:
    """bf16 activations, float32 weights at unit output scale, distinct experts per token,
    one token routed (partly) to other ranks' ids (-1, E), whose slots must contribute 0."""
    ids = torch.rand(tokens, EXPERTS, generator=g, device=CUDA).argsort(dim=-1)[:, :TOP_K]
    ids = ids.to(torch.int32)
    if tokens > 2:
        ids[1] = -1
        ids[2, 0] = EXPERTS
    return {
        "hidden": torch.randn(tokens, HIDDEN, generator=g, device=CUDA).to(torch.bfloat16),
        "w13": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device=CUDA) / HIDDEN**0.5,
        "w2": torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device=CUDA) / INTER**0.5,
        "topk_weights": torch.rand(tokens, TOP_K, generator=g, device=CUDA),
        "topk_ids": ids,
    }


def run_format(fmt: str, moe: dict, **extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel output, the bf16 w13 and w2 the kernel computes with) for one weight format."""
    x, tw, ti = moe["hidden"], moe["topk_weights"], moe["topk_ids"]
    if fmt == "bf16":
        w13, w2 = moe["w13"].to(torch.bfloat16), moe["w2"].to(torch.bfloat16)
        return fused_moe(x, w13, w2, tw, ti, **extra), w13, w2
    if fmt == "int4":
        p13, s13, z13 = quantize_int4(moe["w13"], INT4_GROUP, symmetric=False)
        p2, s2, z2 = quantize_int4(moe["w2"], INT4_GROUP, symmetric=False)
        got = fused_moe_int4(x, p13, s13, p2, s2, tw, ti, z13, z2, **extra)
        return got, dequantize_int4(p13, s13, z13), dequantize_int4(p2, s2, z2)
    q13, q2 = quantize_mxfp4(moe["w13"]), quantize_mxfp4(moe["w2"])
    got = fused_moe_mxfp4(x, *q13, *q2, tw, ti, **extra)
    return got, dequantize_mxfp4(*q13), dequantize_mxfp4(*q2)


def reference64(moe: dict, w13, w2, activation=SILU_AND_MUL, b13=None, b2=None) -> torch.Tensor:
    return fused_moe_reference(
        moe["hidden"].double(), w13.double(), w2.double(), moe["topk_weights"], moe["topk_ids"],
        activation=activation,
        b13=None if b13 is None else b13.double(),
        b2=None if b2 is None else b2.double(),
    )  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("fmt", ["bf16", "int4", "mxfp4"])
def test_fused_moe_on_cuda_matches_float64_reference(fmt: str, tokens: int) -> None:
    moe = make_moe(gen(), tokens)
    got, w13, w2 = run_format(fmt, moe)
    assert got.device.type == CUDA.type and got.dtype == torch.bfloat16
    assert got.shape == moe["hidden"].shape
    err = rel_err(got, reference64(moe, w13, w2))
    assert err < BF16_RTOL, (fmt, tokens, err)
    if tokens > 2:
        assert bool((got[1] == 0).all())  # every slot on another rank's experts


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_fused_moe_gpt_oss_activation_and_biases_on_cuda(fmt: str) -> None:
    """gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) with expert biases; activations scaled
    up so that the clamp cuts (the plain-SwiGLU reference is far off)."""
    g = gen()
    moe = make_moe(g, 48)
    moe["hidden"] = (moe["hidden"].float() * 6).to(torch.bfloat16)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=g, device=CUDA).to(torch.bfloat16)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g, device=CUDA).to(torch.bfloat16)
    clamped = SwiGLU(alpha=1.702, limit=7.0)
    got, w13, w2 = run_format(fmt, moe, activation=clamped, b13=b13, b2=b2)
    assert rel_err(got, reference64(moe, w13, w2, clamped, b13, b2)) < BF16_RTOL
    assert rel_err(got, reference64(moe, w13, w2, SwiGLU(alpha=1.702), b13, b2)) > 0.05


# --- paged attention -------------------------------------------------------------------------


@pytest.fixture
def paged_attention():
    try:
        from kernels.attention.triton_attention import paged_attention
    except ImportError as exc:
        pytest.skip(f"kernels.attention.triton_attention.paged_attention does not import ({exc})")
    return paged_attention


def make_paged(g, query_lens, context_lens, heads, block_size=16) -> dict:
    """A batch over a bf16 paged cache (blocks shuffled in the pool): sequence b holds
    context_lens[b] + query_lens[b] tokens, its query_lens[b] last ones are the queries."""
    hq, hkv, d = heads
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(per_seq)
    num_blocks = sum(per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g, device=CUDA).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=CUDA)
    start = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = perm[start : start + n]
        start += n
    cache = (num_blocks, block_size, hkv, d)
    qsl = torch.tensor([0, *query_lens], device=CUDA).cumsum(0).to(torch.int32)
    return {
        "q": torch.randn(sum(query_lens), hq, d, generator=g, device=CUDA).to(torch.bfloat16),
        "k_cache": torch.randn(cache, generator=g, device=CUDA).to(torch.bfloat16),
        "v_cache": torch.randn(cache, generator=g, device=CUDA).to(torch.bfloat16),
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
        "query_start_loc": qsl,
    }


def attention_reference64(batch: dict, scale: float, sliding_window=None, sinks=None):
    """Causal GQA attention per sequence in float64 over the gathered blocks: query head h
    reads KV head h // (Hq / Hkv); key j is visible to the query at position p iff j <= p and
    (no window or j > p - sliding_window); sinks [Hq] add exp(sink) to the denominator."""
    q, kc, vc = batch["q"].double(), batch["k_cache"].double(), batch["v_cache"].double()
    hq, hkv, bs = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.zeros_like(q)
    qsl = batch["query_start_loc"].tolist()
    for b, n in enumerate(batch["seq_lens"].tolist()):
        blocks = batch["block_tables"][b, : -(-n // bs)].long()
        k = kc[blocks].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = vc[blocks].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        qb = q[qsl[b] : qsl[b + 1]]
        pos = torch.arange(n - qb.shape[0], n, device=CUDA)[:, None]
        key = torch.arange(n, device=CUDA)[None, :]
        visible = key <= pos
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def run_attention(paged_attention, batch: dict, query_lens, **extra) -> torch.Tensor:
    scale = batch["q"].shape[-1] ** -0.5
    out = torch.full_like(batch["q"], float("nan"))
    paged_attention(**batch, scale=scale, max_query_len=max(query_lens), out=out, **extra)
    want = attention_reference64(batch, scale, **extra)
    assert not bool(torch.isnan(out).any()), "paged_attention left rows of `out` unwritten"
    err = rel_err(out, want)
    assert err < BF16_RTOL, err
    return out


QWEN3_HEADS = (32, 4, 128)  # Qwen3-30B-A3B: q heads, KV heads, head_dim
GPT_OSS_HEADS = (64, 8, 64)  # gpt-oss-20b


def test_paged_decode_attention_on_cuda(paged_attention) -> None:
    g = gen()
    contexts = torch.randint(0, 700, (8,), generator=g, device=CUDA).tolist()
    contexts[0] = 0  # a sequence whose only token is the query
    batch = make_paged(g, [1] * 8, contexts, QWEN3_HEADS)
    run_attention(paged_attention, batch, [1] * 8)


def test_paged_prefill_over_chunked_context_on_cuda(paged_attention) -> None:
    g = gen()
    query_lens, contexts = [1, 37, 128, 200], [300, 0, 77, 16]
    batch = make_paged(g, query_lens, contexts, QWEN3_HEADS)
    run_attention(paged_attention, batch, query_lens)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 150, 1]])
def test_paged_attention_sliding_window_and_sinks_on_cuda(paged_attention, query_lens) -> None:
    g = gen()
    batch = make_paged(g, query_lens, [400, 100, 3], GPT_OSS_HEADS)
    sinks = torch.randn(GPT_OSS_HEADS[0], generator=g, device=CUDA) + 4  # e^4: comparable to the
    # scores' exp-sum over the window, so that sinks move the output
    out = run_attention(paged_attention, batch, query_lens, sliding_window=128, sinks=sinks)
    scale = GPT_OSS_HEADS[2] ** -0.5
    assert rel_err(out, attention_reference64(batch, scale, sinks=sinks)) > 0.05  # window cut
    assert rel_err(out, attention_reference64(batch, scale, sliding_window=128)) > 0.05
