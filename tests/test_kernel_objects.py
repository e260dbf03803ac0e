"""The registry hands each layer the kernel object that runs (`KernelPlan.linear`,
`.attention`, `.rms_norm`, `.router_topk`, `.rope_prologue`, `.mla_decode`, `.decode_layer`,
`.float_experts`, `.quantized_experts`), and every fallback such an object may take is declared
and printed in the startup plan. Each fallback condition is forced here and checked twice: the
object takes it, and the plan's text names it."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged
from kernels.dense import amx
from kernels.dense.linear import NARROW_MAX_ROWS, NATIVE_MAX_ROWS, LinearKernel
from kernels.native.library import native_unavailable_reason
from kernels.plan import NATIVE_CPU, TORCH, KernelPlan
from kernels.registry import ModelFacts, choose_kernels
from moe_engine.models.layers.attention import PagedAttention, build_attention_batch
from moe_engine.models.layers.linear import Linear

needs_native = pytest.mark.skipif(
    native_unavailable_reason() is not None, reason="the native CPU library does not build here"
)


def _plan(backend: str = NATIVE_CPU) -> KernelPlan:
    return KernelPlan.uniform(backend)


def test_layers_never_name_a_backend() -> None:
    """Above kernels/, no layer compares backend names: the plan's objects decide (no
    NATIVE_CPU / TRITON names, no "native-cpu" / "triton" compared, no `plan.backend(op)`)."""
    import ast
    from pathlib import Path

    layers = Path(__file__).resolve().parents[1] / "moe_engine" / "models" / "layers"
    named = []
    for path in sorted(layers.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in ("NATIVE_CPU", "TRITON"):
                named.append(f"{path.name}:{node.lineno} {node.id}")
            elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in ("native-cpu", "triton")
                for c in (node.left, *node.comparators)
            ):
                named.append(f"{path.name}:{node.lineno} compares a backend name")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "backend"):
                named.append(f"{path.name}:{node.lineno} .backend(...)")
    assert not named, named


@needs_native
def test_linear_row_fallbacks_are_taken_and_declared() -> None:
    g = torch.Generator().manual_seed(0)
    wide = Linear(16, 80, bias=True)
    narrow = Linear(16, 32, bias=False)
    for layer in (wide, narrow):
        layer.bind_kernels(_plan())
        assert layer.kernel.packed is not None  # packed at bind, with the loading
        layer.reset_packed()  # from here a copy appears only where a batch takes the route
    assert wide.kernel.native_max_rows == NATIVE_MAX_ROWS
    assert narrow.kernel.native_max_rows == NARROW_MAX_ROWS
    narrow(torch.randn(NARROW_MAX_ROWS + 1, 16, generator=g))
    assert narrow.kernel.packed is None  # past the narrow threshold: torch's GEMM
    wide(torch.randn(NATIVE_MAX_ROWS + 1, 16, generator=g))
    assert wide.kernel.packed is None  # past the native threshold: torch's GEMM
    wide(torch.randn(3, 16, generator=g))
    assert wide.kernel.packed is not None  # within it: the native kernel
    text = _plan().describe()
    assert f"linear=native-cpu, per call: batches over {NATIVE_MAX_ROWS} rows" in text
    assert f"({NARROW_MAX_ROWS} for layers of fewer than" in text
    if amx.bf16_backend() is not None:  # the bf16 route, named with this CPU's kernel
        assert f"the bf16 kernel on {amx.bf16_backend()} at {amx.LINEAR_MIN_ROWS}-" in text
    else:
        assert f"no bf16 kernel here ({amx.amx_unavailable_reason()})" in text


def test_linear_float16_and_torch_plans_never_take_the_native_kernel() -> None:
    half = torch.zeros(80, 16, dtype=torch.float16)
    assert _plan().linear(half, None).native_max_rows == 0  # declared: float16 layers: torch
    torch_kernel = _plan(TORCH).linear(torch.zeros(80, 16), None)
    assert (torch_kernel.native_max_rows, torch_kernel.amx, torch_kernel.q4) == (0, False, False)
    assert "linear=torch, per call" not in _plan(TORCH).describe()


@needs_native
def test_quantized_linear_beyond_the_native_rows_runs_torch_over_the_dequantized_weights():
    g = torch.Generator().manual_seed(1)
    layer = Linear(64, 48, bias=False)
    layer.quantize("int4", 32, torch.float32)
    layer.bind_kernels(_plan())
    assert layer.kernel.q4
    x = torch.randn(NATIVE_MAX_ROWS + 1, 64, generator=g)
    want = torch.nn.functional.linear(x, layer.q4_packed().dequantized.to(x.dtype))
    assert torch.equal(layer(x), want)
    # on a CPU the dequantized copy lives for the call only (no third copy of the weight)
    assert layer.kernel.quantized_copy_bytes(layer.weight, layer.bias) == (
        layer.q4_packed().nbytes
    )
    assert "4-bit layers (--quantized-layers all): the 4-bit kernel up to" in _plan().describe()


def test_attention_gqa_fallback_is_chosen_by_the_registry_and_logged() -> None:
    facts = ModelFacts(head_dim=64, dtype="bfloat16", query_heads_per_kv=32)
    plan = choose_kernels("cpu", "auto", facts, probe=lambda backend, device: None)
    choice = plan.choices["attention_prefill"]
    assert choice.backend == TORCH
    # on a CPU without AVX512-BF16 the prefill kernel is passed over for that reason first
    assert "at most 16 query heads per KV head, not 32" in choice.reason or (
        "AVX512-BF16" in choice.reason
    )
    assert "attention_prefill" in plan.describe()
    kernels = _plan().attention(num_heads=32, num_kv_heads=1)
    assert kernels.prefill is None and kernels.prefill_backend == TORCH
    assert kernels.decode is paged.native_decode and kernels.native_decode
    fits = _plan().attention(num_heads=16, num_kv_heads=1)
    assert fits.prefill is paged.native_prefill and fits.prefill_backend == NATIVE_CPU


def test_attention_float_cache_fallback_is_taken_and_declared() -> None:
    """The native prefill kernel hands float32 calls to the layer's torch path."""
    q = torch.zeros(4, 2, 64)
    cache = torch.zeros(3, 16, 1, 64)
    batch = build_attention_batch(0, torch.tensor([4]), torch.tensor([0]),
                                  torch.tensor([[1]]), 16)
    assert paged.native_prefill(q, cache, cache, batch, 0.125, None, None) is None
    layer = PagedAttention(2, 1, 64, 0.125)
    layer.bind_kernels(_plan())
    assert layer.kernels.prefill is paged.native_prefill
    text = _plan().describe()
    assert "attention_prefill=native-cpu, per call: float32 queries or caches: torch" in text


def test_every_native_fallback_is_printed_once_per_op() -> None:
    text = _plan().describe()
    for op in ("linear", "attention_prefill", "fused_moe", "decode_layer", "rms_norm", "rotary",
               "router_topk"):
        assert f"{op}=native-cpu, per call: " in text, op
    assert "per call" not in _plan(TORCH).describe()


def test_small_ops_hand_out_a_kernel_or_none() -> None:
    native, torch_plan = _plan(), _plan(TORCH)
    weight = torch.ones(8)
    assert native.rms_norm(weight) is not None and torch_plan.rms_norm(weight) is None
    assert native.rms_norm(weight.half()) is None  # float16 weights: the torch ops
    assert native.router_topk("cpu") is not None and native.router_topk("cuda") is None
    assert torch_plan.router_topk("cpu") is None
    assert native.rope_prologue() is not None and torch_plan.rope_prologue() is None
    assert native.decode_layer() is not None and torch_plan.decode_layer() is None
    assert native.mla_decode() is None  # only triton has an absorbed MLA decode kernel
    assert native.rope_prologue(interleaved=True) is None  # the native rope: rotate-half only
    assert native.rope_prologue(partial=True) is None
    assert native.add_rms_norm(weight) is None and native.mla_rope_prologue() is None


def test_triton_small_ops_are_the_triton_kernels_and_declare_their_fallbacks() -> None:
    from kernels.attention.triton_mla_prologue import mla_rope_cache
    from kernels.dense import triton_norm, triton_rope

    plan = KernelPlan.uniform("triton", "cuda")
    weight = torch.ones(8, dtype=torch.bfloat16)
    assert plan.rms_norm(weight) is triton_norm.rms_norm
    assert plan.rms_norm(weight.half()) is triton_norm.rms_norm  # any float weight
    assert plan.add_rms_norm(weight) is triton_norm.fused_add_rms_norm
    for layout in ({}, {"interleaved": True}, {"partial": True}):
        assert plan.rope_prologue(**layout) is triton_rope.qk_norm_rope_cache
    assert plan.mla_rope_prologue() is mla_rope_cache
    text = plan.describe()
    for op in ("rms_norm", "rotary"):
        assert f"{op}=triton, per call: " in text, op


def test_layers_bind_the_triton_small_ops() -> None:
    """RMSNorm takes the triton kernels from the plan (its fused residual add too), and a
    bound norm called with a residual equals the add, then the torch norm."""
    from kernels.dense import triton_norm
    from moe_engine.models.layers.norm import RMSNorm

    plan = KernelPlan.uniform("triton", "cuda")
    norm = RMSNorm(24, 1e-6)
    norm.bind_kernels(plan)
    assert norm.kernel is triton_norm.rms_norm
    assert norm.add_kernel is triton_norm.fused_add_rms_norm
    g = torch.Generator().manual_seed(5)
    x, residual = torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g)
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, residual + x)
    torch.testing.assert_close(normed, RMSNorm(24, 1e-6)(residual + x), rtol=2e-6, atol=2e-6)


def test_graph_safety_is_the_registrys_word() -> None:
    assert _plan(TORCH).graph_unsafe(["attention_decode", "fused_moe"]) == [
        "attention_decode=torch", "fused_moe=torch"
    ]
    assert KernelPlan.uniform("triton", "cuda").graph_unsafe(["attention_decode"]) == []


def test_linear_kernel_torch_route_equals_nn_linear() -> None:
    g = torch.Generator().manual_seed(2)
    w, b, x = (torch.randn(*s, generator=g) for s in ((24, 16), (24,), (5, 16)))
    torch.testing.assert_close(LinearKernel.torch()(x, w, b), torch.nn.functional.linear(x, w, b))
