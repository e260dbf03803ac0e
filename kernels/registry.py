"""The kernel registry: for each op, the backend that runs it, chosen once at startup.

`choose_kernels` makes the one `KernelPlan` (kernels/plan.py) of the engine; every
kernel-using module of the model (experts, paged attention, linears, norms, rotary) takes the
kernel object that runs it from that plan at bind time (`bind_kernels` of the module:
`plan.linear(...)`, `plan.attention(...)`, `plan.float_experts(...)`, ...), never per call,
and never compares backend names. The choice depends on the engine's device, on what is
installed and builds (the native CPU library, Triton), on the model (head sizes, dtype, GQA
ratio a kernel supports) and on `--kernel-backend`; it is logged in the startup plan, with
every fallback the chosen kernels may take per call (`kernels.plan.fallbacks`), and returned
by `GetModelInfo`.

Backends:
- ``native-cpu``: the C++ kernels of kernels/native/csrc (kernels/native/library.py), CPU
  only, in the build for this CPU's instruction set (avx2 or avx512,
  `kernels.native.library.choose_isa`), which the plan names (`KernelPlan.native_isa`).
- ``torch``: plain torch ops (SDPA, cuBLAS/oneDNN GEMMs); every op, every device.
- ``triton``: the Triton kernels (kernels/moe/fused_moe.py,
  kernels/attention/triton_attention.py), on CUDA, or on the CPU under Triton's interpreter
  (``TRITON_INTERPRET=1``, tests only: auto never picks it on a CPU).

`--kernel-backend` is ``auto`` (the default), one backend name (every op that backend
implements uses it; the others keep auto's choice), or a comma list of ``op=backend`` pairs,
optionally after a backend name (``triton,linear=torch``). An explicit backend that cannot run
an op here is refused at startup with the reason (`KernelBackendError`), never mid-request.

The idea is vLLM's attention-backend selector and fused-MoE quant methods, reduced to one
table: `IMPLEMENTS` says which backend implements which op; `probe_backend` and `_unfit` say
why one cannot run here or this model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from kernels.plan import (
    BACKENDS,
    IMPLEMENTS,
    NATIVE_CPU,
    OPS,
    TORCH,
    TRITON,
    KernelChoice,
    KernelPlan,
)

logger = logging.getLogger(__name__)

#: The devices `--device` accepts besides "auto".
DEVICES = ("cpu", "cuda")


class KernelBackendError(ValueError):
    """A `--kernel-backend` that is malformed, or asks a backend for an op it cannot run here
    (the message names the op, the backend and why)."""


@dataclass(frozen=True)
class ModelFacts:
    """What of the model decides whether a kernel can run it.

    Attributes:
        head_dim: attention head size (query/key; MLA: qk_nope + qk_rope).
        dtype: the compute dtype's name ("float32", "bfloat16", "float16").
        mla: whether attention is multi-head latent attention.
        query_heads_per_kv: query heads per KV head (GQA ratio; 1 without GQA).
    """

    head_dim: int = 64
    dtype: str = "float32"
    mla: bool = False
    query_heads_per_kv: int = 1


def parse_kernel_backend(spec: str) -> tuple[str | None, dict[str, str]]:
    """`--kernel-backend` -> (default backend or None for auto, {op: backend}).

    Raises:
        KernelBackendError: an unknown backend or op, or a malformed item (names it and the
            valid values).
    """
    if not isinstance(spec, str):
        raise KernelBackendError(
            f"--kernel-backend must be a string such as 'auto' or 'torch,linear=native-cpu', "
            f"got {spec!r}"
        )
    default: str | None = None
    per_op: dict[str, str] = {}
    seen: set[str] = set()
    items = [s.strip() for s in spec.split(",") if s.strip()] or ["auto"]
    for i, item in enumerate(items):
        op, sep, backend = item.rpartition("=")
        op = op.strip()
        backend = backend.strip()
        if backend not in (*BACKENDS, "auto"):
            raise KernelBackendError(
                f"--kernel-backend: unknown backend {backend!r} in {spec!r}; backends: auto, "
                + ", ".join(BACKENDS)
            )
        if not sep:
            if i:
                raise KernelBackendError(
                    f"--kernel-backend: a plain backend name ({item!r}) must come first in "
                    f"{spec!r}, before the op=backend pairs"
                )
            default = None if backend == "auto" else backend
            continue
        if op not in OPS:
            raise KernelBackendError(
                f"--kernel-backend: unknown op {op!r} in {spec!r}; ops: {', '.join(OPS)}"
            )
        if op in seen:
            raise KernelBackendError(f"--kernel-backend: op {op!r} is given twice in {spec!r}")
        seen.add(op)
        if backend != "auto":
            per_op[op] = backend
    return default, per_op


def check_kernel_backend(device: str, spec: str, probe: Probe | None = None) -> None:
    """What of `--kernel-backend` can be refused before anything loads (`moe-serve` calls it
    before the port opens): a malformed spec, an op=backend pair whose backend has no kernel
    for the op, and a named backend other than native-cpu that cannot run on `device` (the
    native library's build is the engine's first startup phase, with its progress; the
    model-dependent checks come with the model, in `choose_kernels`).

    Raises:
        KernelBackendError: as `choose_kernels` would for these.
    """
    default, per_op = parse_kernel_backend(spec)

    def reason(backend: str) -> str | None:
        if backend == NATIVE_CPU and device == "cpu":
            return None  # built (and refused, if it must be) by the engine's first phase
        return (probe or probe_backend)(backend, device)

    _refuse_named(spec, default, per_op, reason)


def resolve_device(device: str) -> str:
    """`--device` -> "cpu" or "cuda" ("auto": cuda when torch sees a CUDA device).

    Raises:
        KernelBackendError: an unknown device, or "cuda" without a CUDA device.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise KernelBackendError(f"--device must be auto, cpu or cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise KernelBackendError(
            "--device cuda: torch sees no CUDA device (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu"
        )
    return device


#: A probe: None when the backend runs here, else why not. Injectable for tests.
Probe = Callable[[str], "str | None"]


def probe_backend(backend: str, device: str) -> str | None:
    """None when `backend` can run on `device` on this machine, else why not (the native
    library is built or loaded here, once per process: the one-time build happens at startup).
    """
    if backend == TORCH:
        return None
    if backend == NATIVE_CPU:
        if device != "cpu":
            return f"native-cpu runs on the CPU only (device is {device})"
        from kernels.native.library import native_unavailable_reason

        return native_unavailable_reason()
    if backend == TRITON:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "triton runs on CUDA, or on the CPU only under TRITON_INTERPRET=1"
        return None
    raise KernelBackendError(f"unknown backend {backend!r}")


def _unfit(op: str, backend: str, facts: ModelFacts) -> str | None:
    """None when `backend`'s kernel for `op` can run this model, else why not."""
    attention = op.startswith("attention_") or op == "mla_decode"
    if backend == NATIVE_CPU and op == "attention_decode":
        if facts.head_dim % 8:
            return f"the native decode kernel needs head_dim % 8 == 0, got {facts.head_dim}"
        if facts.dtype not in ("float32", "bfloat16"):
            return f"the native decode kernel runs float32/bfloat16, not {facts.dtype}"
    if backend == NATIVE_CPU and facts.dtype not in ("float32", "bfloat16"):
        return f"the native kernels run float32/bfloat16, not {facts.dtype}"
    if backend == NATIVE_CPU and op == "attention_prefill":
        if facts.dtype != "bfloat16" or facts.head_dim % 32 or facts.head_dim > 256:
            return (f"the native prefill attention runs bfloat16 with head_dim % 32 == 0 up to "
                    f"256, not {facts.dtype} with head_dim {facts.head_dim}")
        from kernels.dense import amx as cpu_amx

        if cpu_amx.bf16_backend() is None or not cpu_amx.dot_available():
            why = cpu_amx.amx_unavailable_reason() or "this CPU lacks AVX512-BF16"
            return f"the native prefill attention needs AVX512-BF16 ({why})"
        from kernels.attention.paged import NATIVE_PREFILL_MAX_GQA

        if facts.query_heads_per_kv > NATIVE_PREFILL_MAX_GQA:
            return (f"the native prefill attention takes at most {NATIVE_PREFILL_MAX_GQA} "
                    f"query heads per KV head, not {facts.query_heads_per_kv}")
    if backend == NATIVE_CPU and op == "decode_layer" and (facts.dtype != "bfloat16" or facts.mla):
        return "the native decode layer runs bfloat16 models without MLA"
    if backend == TRITON and attention and (facts.head_dim < 16):
        return f"the Triton attention kernels need head_dim >= 16, got {facts.head_dim}"
    if facts.mla and op in ("attention_prefill", "attention_decode") and backend != TORCH:
        return "MLA layers attend through mla_decode and the torch prefill path"
    return None


def choose_kernels(
    device: str,
    spec: str = "auto",
    facts: ModelFacts | None = None,
    probe: Probe | None = None,
) -> KernelPlan:
    """The backend of every op for `device`, the model `facts` and `--kernel-backend` `spec`.

    Auto: native-cpu on a CPU and triton on CUDA for the ops they implement and can run, torch
    for the rest (a backend that cannot run is noted with its reason). A backend named in
    `spec` wins wherever it implements the op; named for an op (``op=backend``), it must run it.

    Args:
        device: "cpu" or "cuda" (`resolve_device`).
        spec: `--kernel-backend` (see the module docstring).
        facts: the model's head size and dtype; None: defaults that every kernel runs.
        probe: `probe_backend(backend, device)`-like; injectable for tests.

    Raises:
        KernelBackendError: a malformed spec; a named backend that cannot run on this machine
            or device; an op=backend pair whose backend does not implement or cannot run the op.
    """
    facts = facts or ModelFacts()
    default, per_op = parse_kernel_backend(spec)
    reasons: dict[str, str | None] = {}

    def reason(backend: str) -> str | None:
        if backend not in reasons:
            reasons[backend] = (probe or probe_backend)(backend, device)
        return reasons[backend]

    _refuse_named(spec, default, per_op, reason)
    choices = {}
    for op in OPS:
        if op in per_op:
            backend = per_op[op]
            why = _unfit(op, backend, facts)  # it has the kernel (`_refuse_named`)
            if why is not None:
                raise KernelBackendError(f"--kernel-backend {op}={backend}: {why}")
            choices[op] = KernelChoice(op, backend, "")
            continue
        preferred = _auto_order(device)
        if default is not None:
            preferred = [default, *preferred]
        choices[op] = _first_fit(op, preferred, facts, reason)
    plan = KernelPlan(device, choices, _native_isa(choices))
    logger.debug("%s", plan.describe())
    return plan


def _refuse_named(
    spec: str,
    default: str | None,
    per_op: dict[str, str],
    reason: Callable[[str], str | None],
) -> None:
    """Refuse, in this order, an op=backend pair whose backend has no kernel for the op, then a
    named backend that cannot run here (`reason`).

    Raises:
        KernelBackendError: naming the op or the backend and why.
    """
    for op, backend in per_op.items():
        if op not in IMPLEMENTS[backend]:
            raise KernelBackendError(f"--kernel-backend {op}={backend}: "
                                     + _no_kernel(op, backend))
    for backend in {default, *per_op.values()} - {None}:
        why = reason(backend)
        if why is not None:
            raise KernelBackendError(f"--kernel-backend {spec}: {backend} cannot run: {why}")


def _native_isa(choices: dict[str, KernelChoice]) -> str:
    """The loaded native library's variant where an op chose native-cpu, else ""."""
    if not any(c.backend == NATIVE_CPU for c in choices.values()):
        return ""
    from kernels.native.library import loaded_isa

    return loaded_isa() or ""


def _no_kernel(op: str, backend: str) -> str:
    have = ", ".join(b for b in BACKENDS if op in IMPLEMENTS[b])
    return f"{backend} has no {op} kernel (backends with one: {have})"


def _auto_order(device: str) -> list[str]:
    return [NATIVE_CPU, TORCH] if device == "cpu" else [TRITON, TORCH]


def _first_fit(
    op: str, preferred: list[str], facts: ModelFacts, reason: Callable[[str], str | None]
) -> KernelChoice:
    """The first backend of `preferred` (then torch) that implements, can run and fits `op`;
    the reason records why an earlier preference was passed over."""
    passed: list[str] = []
    for backend in dict.fromkeys([*preferred, TORCH]):
        if op not in IMPLEMENTS[backend]:
            continue
        why = reason(backend) or _unfit(op, backend, facts)
        if why is None:
            return KernelChoice(op, backend, "; ".join(passed))
        passed.append(f"not {backend}: {why}")
    raise AssertionError("torch implements every op")  # pragma: no cover
