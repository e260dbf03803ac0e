"""Routed experts bound to each kernel backend (`FusedMoE.bind_kernels`,
`QuantizedExperts.bind_kernels`, kernels/moe/backends.py) against the float64 reference.

Every weight format (float32; int4 with float32 or bfloat16 scales, symmetric or asymmetric;
MXFP4) on every backend (native-cpu, torch, triton under `TRITON_INTERPRET=1`), on fresh random
tiny shapes (H 64, I 32, 4 experts, top-2, a pair of another rank), with plain SwiGLU and with
gpt-oss's clamped SwiGLU and expert biases. The reference is `kernels.moe.reference
.fused_moe_reference` in float64 on the weights the kernels hold (the dequantized 4-bit values,
exact in float64). Tolerance, relative Frobenius error of the [T, H] output: 1e-4 (float32
arithmetic), except torch's int4 CPU matmul, which takes bfloat16 activations and rounds the
scales to bfloat16: 2e-2.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.moe.activation import SILU_AND_MUL, SwiGLU  # noqa: E402
from kernels.moe.reference import fused_moe_reference  # noqa: E402
from kernels.plan import KernelChoice, KernelPlan  # noqa: E402
from moe_engine.models.layers.expert_weights import load_all_experts  # noqa: E402
from moe_engine.models.layers.moe import FusedMoE  # noqa: E402
from moe_engine.models.layers.quantized_experts import QuantizedExperts  # noqa: E402
from quant.int4 import Int4Weight, dequantize_int4, quantize_int4  # noqa: E402
from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

E, H, INTER, TOP_K, TOKENS, GROUP = 4, 64, 32, 2, 5, 32
GPT_OSS = SwiGLU(alpha=1.702, limit=7.0)
_no_triton = importlib.util.find_spec("triton") is None
BACKENDS = [
    "native-cpu",
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(_no_triton, reason="triton not installed")),
]
#: (name, scale dtype, symmetric) of the int4 cases.
INT4_CASES = [
    ("fp32-sym", torch.float32, True),
    ("fp32-asym", torch.float32, False),
    ("bf16-sym", torch.bfloat16, True),
    ("bf16-asym", torch.bfloat16, False),
]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (2**31))


def _routing(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(TOKENS)])
    ids = ids.to(torch.int32)
    ids[1, 0] = -1  # a pair whose expert is on another rank
    return torch.rand(TOKENS, TOP_K, generator=g), ids


def _weights(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
            torch.randn(E, H, INTER, generator=g) / INTER**0.5)


def _extras(g: torch.Generator, gpt_oss: bool) -> dict:
    if not gpt_oss:
        return {"activation": SILU_AND_MUL, "b13": None, "b2": None}
    return {"activation": GPT_OSS, "b13": torch.randn(E, 2 * INTER, generator=g) * 0.1,
            "b2": torch.randn(E, H, generator=g) * 0.1}


def _reference(hidden, w13, w2, weights, ids, activation, b13, b2) -> torch.Tensor:
    def d(t):
        return None if t is None else t.double()

    return fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights, ids,
                               activation=activation, b13=d(b13), b2=d(b2))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


def _float_moe(g: torch.Generator, gpt_oss: bool) -> FusedMoE:
    moe = FusedMoE(E, TOP_K, H, INTER, True, torch.float32, expert_bias=gpt_oss,
                   activation=GPT_OSS if gpt_oss else SILU_AND_MUL,
                   routing="topk_softmax" if gpt_oss else "softmax_topk", router_bias=gpt_oss)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe


@torch.no_grad()
def _moe_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = moe._route(x)
    b13, b2 = moe.b13, moe.b2
    return _reference(x, moe.w13.data, moe.w2.data, weights, ids, moe.activation,
                      None if b13 is None else b13.data, None if b2 is None else b2.data)


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float_experts_bound_to_each_backend(backend: str, gpt_oss: bool) -> None:
    g = _gen()
    moe = _float_moe(g, gpt_oss)
    moe.bind_kernels(KernelPlan.uniform(backend))
    assert moe.kernel_backend == backend
    x = torch.randn(TOKENS, H, generator=g)
    assert _rel(moe(x), _moe_reference(moe, x)) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_experts_reload_then_rebind_serve_new_weights(backend: str) -> None:
    """A reload in place (the loader's path: copy, then reset_packed) and an explicit second
    bind both serve the new weights, never the layout made from the old ones."""
    g = _gen()
    moe = _float_moe(g, gpt_oss=True)
    moe.bind_kernels(KernelPlan.uniform(backend))
    x = torch.randn(TOKENS, H, generator=g)
    before = moe(x)
    load_all_experts(moe, "gate_up", torch.randn(E, 2 * INTER, H, generator=g) * 0.2)
    after = moe(x)
    assert moe.kernel_backend == backend
    want = _moe_reference(moe, x)
    assert _rel(after, want) < 1e-4 and _rel(before, want) > 1e-2
    with torch.no_grad():  # changed without the loader, then bound again
        moe.w2.copy_(torch.randn(E, H, INTER, generator=g) * 0.2)
        moe.b2.copy_(torch.randn(E, H, generator=g))
    moe.bind_kernels(KernelPlan.uniform(backend))
    assert _rel(moe(x), _moe_reference(moe, x)) < 1e-4


def _int4_experts(g, scale_dtype, symmetric, extras):
    """QuantizedExperts from a checkpoint-like int4 list (`from_int4`, the path of asymmetric
    and 16-bit-scale experts), and the float64 dequantized weights it holds."""
    w13, w2 = _weights(g)
    q = [quantize_int4(w, GROUP, symmetric=symmetric, scale_dtype=scale_dtype) for w in (w13, w2)]
    lists = [[Int4Weight(p[e], s[e], None if z is None else z[e]) for e in range(E)]
             for p, s, z in q]
    experts = QuantizedExperts.from_int4(*lists)
    for name, value in extras.items():
        setattr(experts, name, value)
    return experts, [dequantize_int4(*qi, dtype=torch.float64) for qi in q]


def _mxfp4_experts(g, extras):
    w13, w2 = _weights(g)
    experts = QuantizedExperts(w13, w2, "mxfp4", 32, **extras)
    return experts, [dequantize_mxfp4(*quantize_mxfp4(w), torch.float64) for w in (w13, w2)]


def _tolerance(backend: str, method: str) -> float:
    return 2e-2 if (backend, method) == ("torch", "int4") else 1e-4


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("case", INT4_CASES, ids=[c[0] for c in INT4_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int4_experts_bound_to_each_backend(backend: str, case: tuple, gpt_oss: bool) -> None:
    g = _gen()
    _, scale_dtype, symmetric = case
    extras = _extras(g, gpt_oss)
    experts, (d13, d2) = _int4_experts(g, scale_dtype, symmetric, extras)
    experts.bind_kernels(KernelPlan.uniform(backend))
    assert experts.backend == backend
    if backend == "triton":  # the canonical stacked layout itself, 16-bit scales as stored
        assert experts._held and experts.canonical().w13_scales.dtype == scale_dtype
    else:  # converted once; the canonical copy is gone
        assert not experts._held
    x = torch.randn(TOKENS, H, generator=g)
    weights, ids = _routing(g)
    want = _reference(x, d13, d2, weights, ids, **extras)
    assert _rel(experts(x, weights, ids), want) < _tolerance(backend, "int4")


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mxfp4_experts_bound_to_each_backend(backend: str, gpt_oss: bool) -> None:
    g = _gen()
    extras = _extras(g, gpt_oss)
    experts, (d13, d2) = _mxfp4_experts(g, extras)
    experts.bind_kernels(KernelPlan.uniform(backend))
    assert experts.backend == backend and experts._held == (backend != "native-cpu")
    x = torch.randn(TOKENS, H, generator=g)
    weights, ids = _routing(g)
    want = _reference(x, d13, d2, weights, ids, **extras)
    assert _rel(experts(x, weights, ids), want) < 1e-4


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
def test_quantized_experts_rebind_across_backends(method: str) -> None:
    """native-cpu -> triton -> native-cpu -> torch: each bind rebuilds from the canonical
    layout (given back exactly by the native tiles) and serves the same weights; after
    torch's lossy int4 CPU layout only torch can be bound again."""
    g = _gen()
    extras = _extras(g, gpt_oss=True)
    if method == "int4":
        experts, (d13, d2) = _int4_experts(g, torch.bfloat16, False, extras)
    else:
        experts, (d13, d2) = _mxfp4_experts(g, extras)
    x = torch.randn(TOKENS, H, generator=g)
    weights, ids = _routing(g)
    want = _reference(x, d13, d2, weights, ids, **extras)
    chain = ["native-cpu", "torch"] if _no_triton else ["native-cpu", "triton", "native-cpu"]
    for backend in [*chain, "torch", "torch"]:
        experts.bind_kernels(KernelPlan.uniform(backend))
        assert experts.backend == backend
        assert _rel(experts(x, weights, ids), want) < _tolerance(backend, method)
    if method == "int4":
        with pytest.raises(RuntimeError, match="cannot give the canonical layout back"):
            experts.bind_kernels(KernelPlan.uniform("native-cpu"))
    else:
        experts.bind_kernels(KernelPlan.uniform("native-cpu"))
        assert _rel(experts(x, weights, ids), want) < 1e-4


def test_fused_moe_binds_its_quantized_experts() -> None:
    g = _gen()
    moe = _float_moe(g, gpt_oss=True)
    w13, w2 = moe.w13.data.clone(), moe.w2.data.clone()
    moe.quantize("int4", GROUP, scale_dtype=torch.bfloat16)
    plan = KernelPlan.uniform("torch")
    plan.choices["fused_moe_int4"] = KernelChoice("fused_moe_int4", "native-cpu", "")
    moe.bind_kernels(plan)
    assert moe.quantized.backend == "native-cpu" and moe.kernel_backend is None
    x = torch.randn(TOKENS, H, generator=g)
    with torch.no_grad():
        weights, ids = moe._route(x)
    q13, q2 = (dequantize_int4(*quantize_int4(w, GROUP, scale_dtype=torch.bfloat16),
                               dtype=torch.float64) for w in (w13, w2))
    want = _reference(x, q13, q2, weights, ids, GPT_OSS, moe.b13.data, moe.b2.data)
    assert _rel(moe(x), want) < 1e-4


def test_unbound_experts_fall_back_to_todays_choice() -> None:
    """Modules nobody bound (built outside the engine) run the transitional fallback on first
    use: native-cpu where the native library loads, else torch; once chosen it stays."""
    g = _gen()
    moe = _float_moe(g, gpt_oss=False)
    assert moe.kernel_backend is None
    x = torch.randn(TOKENS, H, generator=g)
    assert _rel(moe(x), _moe_reference(moe, x)) < 1e-4
    assert moe.kernel_backend == "torch"
    experts, (d13, d2) = _mxfp4_experts(g, _extras(g, False))
    assert experts.backend is None and experts._held
    weights, ids = _routing(g)
    got = experts(x, weights, ids)
    assert experts.backend == "torch"
    assert _rel(got, _reference(x, d13, d2, weights, ids, SILU_AND_MUL, None, None)) < 1e-4


def test_bind_rejects_an_unknown_backend() -> None:
    plan = KernelPlan.uniform("torch")
    plan.choices["fused_moe"] = KernelChoice("fused_moe", "cutlass", "")
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        _float_moe(_gen(), gpt_oss=False).bind_kernels(plan)


# --- kernels/moe/fused_moe_configs.py and graph safety of the Triton path
# ---------------------------


def test_tile_configs_from_the_table_or_the_default_rule() -> None:
    from kernels.moe.fused_moe_configs import (
        TUNED,
        MoeTileConfig,
        default_config,
        get_moe_config,
    )

    entry = TUNED[("int4", 768, 2048)]
    assert get_moe_config(1, 768, 2048, "int4") == entry[1]
    assert get_moe_config(2, 768, 2048, "int4") == entry[64]  # the next bucket the entry has
    assert get_moe_config(10**6, 768, 2048, "int4") == entry[max(entry)]
    tiny = get_moe_config(5, INTER, H, "mxfp4")  # not in the table: the rule, capped by shape
    assert tiny == default_config(5, INTER, H, "mxfp4")
    assert (tiny.BLOCK_SIZE_M, tiny.BLOCK_SIZE_N, tiny.BLOCK_SIZE_K) == (16, 32, 64)
    with pytest.raises(ValueError, match="BLOCK_SIZE_N must be a power of two >= 16, got 24"):
        MoeTileConfig(16, 24, 64)
    with pytest.raises(ValueError, match="weight_format"):
        get_moe_config(1, INTER, H, "fp8")


@pytest.mark.skipif(_no_triton, reason="triton not installed")
def test_fused_moe_with_an_explicit_tile_config() -> None:
    from kernels.moe.fused_moe import fused_moe
    from kernels.moe.fused_moe_configs import MoeTileConfig

    g = _gen()
    w13, w2 = _weights(g)
    x = torch.randn(TOKENS, H, generator=g)
    weights, ids = _routing(g)
    extras = _extras(g, gpt_oss=True)
    want = _reference(x, w13, w2, weights, ids, **extras)
    for config in (MoeTileConfig(32, 16, 16, 2, 1), MoeTileConfig(16, 128, 32)):
        got = fused_moe(x, w13, w2, weights, ids, config=config, **extras)
        assert _rel(got, want) < 1e-4


@pytest.mark.skipif(_no_triton, reason="triton not installed")
def test_moe_align_block_size_reads_nothing_back_to_the_host(monkeypatch) -> None:
    """No .item(), int(), bool() or .tolist() of a tensor (each a host sync on CUDA, which a
    CUDA graph capture refuses): the output's shapes depend on the input's only."""
    from kernels.moe.fused_moe import moe_align_block_size

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read back to the host")

    _, ids = _routing(_gen())
    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 16, E)
    monkeypatch.undo()
    assert sorted_ids.shape[0] == expert_ids.shape[0] * 16 and total.shape == (1,)
    assert sorted(sorted_ids[sorted_ids < ids.numel()].tolist()) == [
        p for p in range(ids.numel()) if p != 2  # pair (1, 0) is another rank's
    ]
