"""The kernel registry (kernels/registry.py): one backend per op, chosen once per device, model
and `--kernel-backend`; refusals at startup with their reason; the choice bound to the modules
and logged in the startup plan."""

from __future__ import annotations

import logging

import pytest

from kernels.plan import NATIVE_CPU, OPS, TORCH, TRITON
from kernels.registry import (
    KernelBackendError,
    ModelFacts,
    choose_kernels,
    parse_kernel_backend,
    probe_backend,
)


def runs_everywhere(backend: str, device: str) -> str | None:
    """A machine where every backend builds and runs."""
    return None


def no_native(backend: str, device: str) -> str | None:
    return "building kernels/native/csrc failed: no C++ compiler" if backend == NATIVE_CPU else None


def test_auto_on_cpu_takes_native_where_it_has_a_kernel_torch_elsewhere():
    plan = choose_kernels("cpu", "auto", probe=runs_everywhere)
    assert set(plan.as_dict()) == set(OPS)
    for op in ("fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_decode", "linear",
               "rms_norm", "rotary", "router_topk"):
        assert plan.backend(op) == NATIVE_CPU, op
    for op in ("attention_prefill", "mla_decode"):
        assert plan.backend(op) == TORCH, op  # auto never takes triton on a CPU
    # the native decode layer runs bfloat16 models without MLA only
    assert plan.backend("decode_layer") == TORCH
    assert "runs bfloat16 models without MLA" in plan.describe()
    bf16 = choose_kernels("cpu", "auto", ModelFacts(dtype="bfloat16"), probe=runs_everywhere)
    assert bf16.backend("decode_layer") == NATIVE_CPU
    mla = choose_kernels("cpu", "auto", ModelFacts(dtype="bfloat16", mla=True),
                         probe=runs_everywhere)
    assert mla.backend("decode_layer") == TORCH


def test_auto_on_cuda_takes_triton_where_it_has_a_kernel():
    plan = choose_kernels("cuda", "auto", probe=lambda b, d: probe_backend(b, d) if b ==
                          NATIVE_CPU else None)
    for op in ("fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
               "attention_decode", "mla_decode", "rms_norm", "rotary", "router_topk"):
        assert plan.backend(op) == TRITON, op
    for op in ("linear", "decode_layer"):
        assert plan.backend(op) == TORCH, op


def test_a_native_build_failure_falls_back_to_torch_and_says_why():
    plan = choose_kernels("cpu", "auto", probe=no_native)
    assert set(plan.as_dict().values()) == {TORCH}
    lines = plan.describe().splitlines()
    assert lines[1:] == [  # one line per reason, naming its ops
        "  fused_moe, fused_moe_int4, fused_moe_mxfp4, attention_prefill, attention_decode, "
        "linear, rms_norm, rotary, router_topk, decode_layer: not native-cpu: building "
        "kernels/native/csrc failed: no C++ compiler"
    ]


def test_one_backend_name_covers_the_ops_it_implements():
    assert set(choose_kernels("cpu", "torch", probe=runs_everywhere).as_dict().values()) == {
        TORCH
    }
    plan = choose_kernels("cpu", "triton", probe=runs_everywhere)
    assert plan.backend("attention_prefill") == TRITON and plan.backend("fused_moe") == TRITON
    assert plan.backend("linear") == NATIVE_CPU  # triton has none: auto's choice stays
    plan = choose_kernels("cpu", "triton,fused_moe=torch,linear=torch", probe=runs_everywhere)
    assert plan.backend("fused_moe") == TORCH and plan.backend("linear") == TORCH
    assert plan.backend("fused_moe_int4") == TRITON


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bogus", "unknown backend 'bogus'"),
        ("fused_moe=cuda", "unknown backend 'cuda'"),
        ("matmul=torch", "unknown op 'matmul'"),
        ("linear=torch,triton", "must come first"),
        ("auto,linear=torch,linear=native-cpu", "op 'linear' is given twice"),
        ("linear=triton", "triton has no linear kernel (backends with one: native-cpu, torch)"),
        ("mla_decode=native-cpu", "native-cpu has no mla_decode kernel"),
    ],
)
def test_refusals_name_the_op_the_backend_and_why(spec, message):
    with pytest.raises(KernelBackendError, match=message.replace("(", r"\(").replace(")", r"\)")):
        choose_kernels("cpu", spec, probe=runs_everywhere)


def test_a_backend_that_cannot_run_here_is_refused_with_its_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelBackendError, match="triton cannot run: .*TRITON_INTERPRET=1"):
        choose_kernels("cpu", "triton")
    with pytest.raises(KernelBackendError, match="native-cpu runs on the CPU only"):
        choose_kernels("cuda", "native-cpu")
    with pytest.raises(KernelBackendError, match="native-cpu cannot run: .*no C\\+\\+ compiler"):
        choose_kernels("cpu", "linear=native-cpu", probe=no_native)


def test_native_prefill_attention_takes_bfloat16_models_where_the_cpu_has_avx512_bf16(
        monkeypatch):
    from kernels.dense import amx as cpu_amx

    bf16 = ModelFacts(head_dim=64, dtype="bfloat16")
    monkeypatch.setattr(cpu_amx, "_decided", [(cpu_amx.DOT, None)])
    monkeypatch.setattr(cpu_amx, "dot_available", lambda: True)
    assert choose_kernels("cpu", "auto", bf16, probe=runs_everywhere).backend(
        "attention_prefill") == NATIVE_CPU
    plan = choose_kernels("cpu", "auto", ModelFacts(head_dim=64), probe=runs_everywhere)
    assert plan.backend("attention_prefill") == TORCH  # float32
    assert "runs bfloat16 with head_dim % 32 == 0 up to 256, not float32" in plan.describe()
    monkeypatch.setattr(cpu_amx, "dot_available", lambda: False)
    plan = choose_kernels("cpu", "auto", bf16, probe=runs_everywhere)
    assert plan.backend("attention_prefill") == TORCH
    assert "attention_prefill: " in plan.describe()
    assert "the native prefill attention needs AVX512-BF16" in plan.describe()


def test_the_model_decides_too():
    odd = ModelFacts(head_dim=12)  # the native decode kernel needs head_dim % 8 == 0
    plan = choose_kernels("cpu", "auto", odd, probe=runs_everywhere)
    assert plan.backend("attention_decode") == TORCH and plan.backend("linear") == NATIVE_CPU
    assert "head_dim % 8 == 0, got 12" in plan.describe()
    with pytest.raises(KernelBackendError, match="attention_decode=native-cpu: .*got 12"):
        choose_kernels("cpu", "attention_decode=native-cpu", odd, probe=runs_everywhere)
    fp16 = choose_kernels("cpu", "auto", ModelFacts(dtype="float16"), probe=runs_everywhere)
    assert set(fp16.as_dict().values()) == {TORCH}
    mla = choose_kernels("cuda", "auto", ModelFacts(head_dim=576, mla=True),
                         probe=runs_everywhere)
    assert mla.backend("mla_decode") == TRITON and mla.backend("attention_decode") == TORCH


def test_a_spec_that_is_not_a_string_is_refused():
    with pytest.raises(KernelBackendError, match="must be a string .* got None"):
        parse_kernel_backend(None)


def test_parse_keeps_auto_and_pairs():
    assert parse_kernel_backend("auto") == (None, {})
    assert parse_kernel_backend(" torch , linear = native-cpu ") == (TORCH, {"linear": NATIVE_CPU})
    assert parse_kernel_backend("rms_norm=auto") == (None, {})


def test_serve_checks_the_flag_before_anything_starts():
    from moe_engine.cli.serve import build_parser, check_args

    args = build_parser().parse_args(["--model", "x", "--kernel-backend", "linear=fast"])
    assert "unknown backend 'fast'" in check_args(args)


def test_the_engine_binds_and_logs_its_choice(qwen3_ckpt, caplog):
    """--kernel-backend torch serves the same greedy tokens as the default (native-cpu) and no
    module runs a native kernel; the startup plan logs the choice."""
    from moe_engine import LLM, SamplingParams
    from moe_engine.models.layers.attention import PagedAttention
    from moe_engine.models.layers.linear import Linear

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 5, 7, 11, 13]}, {"prompt_token_ids": [2, 4]}]
    with caplog.at_level(logging.INFO):
        native = LLM(model=str(qwen3_ckpt), max_model_len=64)
    assert "kernels (cpu): fused_moe=native-cpu" in caplog.text
    torch_llm = LLM(model=str(qwen3_ckpt), max_model_len=64, kernel_backend="torch")
    assert set(torch_llm.engine.kernels.as_dict().values()) == {TORCH}
    modules = list(torch_llm.engine.model.modules())
    assert not any(m.kernel.native_max_rows for m in modules if isinstance(m, Linear))
    assert {m.kernels.decode_backend for m in modules if isinstance(m, PagedAttention)} == {TORCH}
    want = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_kernel_backend_errors_are_startup_errors(qwen3_ckpt):
    from moe_engine import LLM
    from moe_engine.errors import StartupError

    with pytest.raises(StartupError, match="triton has no linear kernel"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, kernel_backend="linear=triton")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("linear=triton", "linear=triton: triton has no linear kernel (backends with one: "
                          "native-cpu, torch)"),
        ("triton", "triton: triton cannot run: triton runs on CUDA, or on the CPU only under "
                   "TRITON_INTERPRET=1"),
    ],
)
def test_serve_refuses_a_backend_before_the_port_opens(spec, message, qwen3_ckpt, capsys,
                                                       monkeypatch):
    from moe_engine.cli.serve import main as serve_main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read per probe, not at import
    assert serve_main(["--model", str(qwen3_ckpt), "--kernel-backend", spec, "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"moe-serve: error: --kernel-backend {message}"]


def test_the_front_end_check_leaves_native_and_model_checks_to_the_engine():
    from kernels.registry import check_kernel_backend

    check_kernel_backend("cpu", "native-cpu", probe=no_native)  # built by the engine
    check_kernel_backend("cpu", "attention_decode=native-cpu", probe=runs_everywhere)
    with pytest.raises(KernelBackendError, match="native-cpu runs on the CPU only"):
        check_kernel_backend("cuda", "native-cpu")
