"""The kernel registry: for each op, the backend that runs it, chosen once at startup.

Every kernel-using module of the model (experts, paged attention, linears, norms, rotary)
reads its backend from the one `KernelPlan` made here, at bind time (`bind_kernels` of the
module), never per call. The choice depends on the engine's device, on what is installed and
builds (the native CPU library, Triton), on the model (head sizes a kernel supports) and on
`--kernel-backend`; it is logged in the startup plan and returned by `GetModelInfo`.

Backends:
- ``native-cpu``: the C++ kernels of kernels/csrc (kernels/native/library.py), CPU only, in the
build
  for this CPU's instruction set (avx2 or avx512, `kernels.native.library.choose_isa`), which the
  plan
  names (`KernelPlan.native_isa`).
- ``torch``: plain torch ops (SDPA, cuBLAS/oneDNN GEMMs); every op, every device.
- ``triton``: the Triton kernels (kernels/moe/fused_moe.py, kernels/attention/triton_attention.py),
on CUDA,
  or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests only: auto never
  picks it on a CPU).

`--kernel-backend` is ``auto`` (the default), one backend name (every op that backend
implements uses it; the others keep auto's choice), or a comma list of ``op=backend`` pairs,
optionally after a backend name (``triton,linear=torch``). An explicit backend that cannot run
an op here is refused at startup with the reason (`KernelBackendError`), never mid-request.

The idea is vLLM's attention-backend selector and fused-MoE quant methods, reduced to one
table: `IMPLEMENTS` says which backend implements which op; `_unavailable` says why it cannot
run here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kernels.attention.paged import PagedAttentionKernels
    from kernels.decode_layer.native import DecodeLayerKernel
    from kernels.dense.linear import LinearKernel, QuantScheme
    from kernels.moe.backends import BoundExperts, ExpertExtras

logger = logging.getLogger(__name__)

NATIVE_CPU, TORCH, TRITON = "native-cpu", "torch", "triton"
#: Every backend, in auto's order of preference where several could run an op.
BACKENDS = (NATIVE_CPU, TRITON, TORCH)

#: The ops a backend is chosen for.
OPS = (
    "fused_moe",  # routed experts, float weights (bf16 / fp16 / fp32)
    "fused_moe_int4",  # routed experts, int4 group-wise weights
    "fused_moe_mxfp4",  # routed experts, MXFP4 weights
    "attention_prefill",  # paged attention, multi-token queries (prefill chunks)
    "attention_decode",  # paged attention, one query token per request
    "mla_decode",  # MLA absorbed decode over the latent cache
    "linear",  # dense projections (QKV, output, router, dense MLP, LM head)
    "rms_norm",
    "rotary",  # rope (native-cpu: with q/k norm and the KV-cache write, one call per layer)
    "router_topk",  # softmax-top-k routing: the softmax and the stable top-k selection
    "decode_layer",  # a whole decoder layer of a decode step (native-cpu: one call)
)

#: Which ops each backend implements.
IMPLEMENTS: dict[str, frozenset[str]] = {
    NATIVE_CPU: frozenset(
        {"fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
         "attention_decode", "linear", "rms_norm", "rotary", "router_topk", "decode_layer"}
    ),
    TORCH: frozenset(OPS),
    TRITON: frozenset(
        {"fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
         "attention_decode", "mla_decode"}
    ),
}

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


@dataclass(frozen=True)
class KernelChoice:
    """One op's backend and why it was chosen (for the startup log)."""

    op: str
    backend: str
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    """The backend of every op, for one device.

    Attributes:
        device: "cpu" or "cuda".
        choices: op -> its `KernelChoice`, for every op of `OPS`.
        native_isa: where an op runs native-cpu, the library variant and why it was chosen
            (`kernels.native.library.loaded_isa`, e.g. "avx512 (auto: this CPU has avx512f, ...)");
            else "".
    """

    device: str
    choices: dict[str, KernelChoice] = field(default_factory=dict)
    native_isa: str = ""

    def backend(self, op: str) -> str:
        """The backend name that runs `op`.

        Raises:
            KeyError: an op not in `OPS`.
        """
        return self.choices[op].backend

    def as_dict(self) -> dict[str, str]:
        """op -> backend."""
        return {op: c.backend for op, c in self.choices.items()}

    def info(self) -> dict[str, str]:
        """What GetModelInfo returns as kernel_backends: `as_dict`, plus "native_cpu_isa" ->
        "avx2" or "avx512" where an op runs native-cpu."""
        out = self.as_dict()
        if self.native_isa:
            out["native_cpu_isa"] = self.native_isa.split()[0]
        return out

    def describe(self) -> str:
        """One line for the startup plan, e.g. "kernels (cpu): fused_moe=native-cpu, ...";
        choices that fell back say why on their own lines."""
        pairs = ", ".join(f"{op}={c.backend}" for op, c in self.choices.items())
        by_reason: dict[str, list[str]] = {}
        for c in self.choices.values():
            if c.reason:
                by_reason.setdefault(c.reason, []).append(c.op)
        notes = [f"  {', '.join(ops)}: {reason}" for reason, ops in by_reason.items()]
        for c in self.choices.values():
            for fallback in fallbacks(c.op, c.backend):
                notes.append(f"  {c.op}={c.backend} falls back for {fallback}")
        if self.native_isa:
            notes.append(f"  native-cpu build: {self.native_isa}")
        return "\n".join([f"kernels ({self.device}): {pairs}", *notes])

    # ------------------------------------------------------------ the kernel objects

    def linear(self, weight: torch.Tensor, quant_scheme: QuantScheme | None) -> LinearKernel:
        """What runs a dense projection of `weight` [out, in] (4-bit when `quant_scheme`):
        the "linear" backend's routes, with the fallbacks `fallbacks("linear", ...)` names."""
        from kernels.dense.linear import LinearKernel

        if self.backend("linear") == NATIVE_CPU:
            return LinearKernel.native(weight, quant_scheme)
        return LinearKernel.torch(quant_scheme)

    def attention(self, num_heads: int, num_kv_heads: int) -> PagedAttentionKernels:
        """The decode and prefill kernels of a paged attention layer of `num_heads` query
        heads over `num_kv_heads` KV heads (a layer whose GQA ratio the native prefill
        kernel does not take gets the torch path, as `choose_kernels` decides for the model)."""
        from kernels.attention import paged

        kernel_of = {NATIVE_CPU: (paged.native_decode, paged.native_prefill),
                     TRITON: (paged.triton_paged, paged.triton_paged)}
        decode_backend = self.backend("attention_decode")
        prefill_backend = self.backend("attention_prefill")
        decode = kernel_of.get(decode_backend, (None, None))[0]
        prefill = kernel_of.get(prefill_backend, (None, None))[1]
        if prefill is paged.native_prefill and (
            num_heads // num_kv_heads > paged.NATIVE_PREFILL_MAX_GQA
        ):
            prefill, prefill_backend = None, TORCH
        return paged.PagedAttentionKernels(decode, prefill, decode_backend, prefill_backend)

    def mla_decode(self) -> Callable[..., Any] | None:
        """The absorbed MLA decode kernel (`triton_attention.mla_decode`), or None: the
        layer's torch path."""
        if self.backend("mla_decode") != TRITON:
            return None
        from kernels.attention.triton_attention import mla_decode

        return mla_decode

    def rms_norm(self, weight: torch.Tensor) -> Callable[..., Any] | None:
        """The fused RMSNorm (`kernels.dense.ops.rms_norm`) for a float32/bfloat16 `weight`,
        or None: the layer's torch ops."""
        import torch

        if self.backend("rms_norm") != NATIVE_CPU:
            return None
        if weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        from kernels.dense.ops import rms_norm

        return rms_norm

    def router_topk(self, device_type: str) -> Callable[..., Any] | None:
        """The one-call softmax-top-k routing (`kernels.dense.ops.router_softmax_topk`) for a
        router on `device_type`, or None: torch's softmax and stable sort."""
        if self.backend("router_topk") != NATIVE_CPU or device_type != "cpu":
            return None
        from kernels.dense.ops import router_softmax_topk

        return router_softmax_topk

    def rope_prologue(self) -> Callable[..., Any] | None:
        """The one-call attention prologue (q/k norm, rope and the KV-cache write,
        `kernels.dense.ops.qk_norm_rope_cache`), or None: the layer's module path."""
        if self.backend("rotary") != NATIVE_CPU:
            return None
        from kernels.dense.ops import qk_norm_rope_cache

        return qk_norm_rope_cache

    def decode_layer(self) -> type[DecodeLayerKernel] | None:
        """The one-call native decode layer, or None: every layer module by module."""
        if self.backend("decode_layer") != NATIVE_CPU:
            return None
        from kernels.decode_layer.native import DecodeLayerKernel

        return DecodeLayerKernel

    def float_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, extras: ExpertExtras
    ) -> BoundExperts:
        """Float experts (w13 [E, 2I, H], w2 [E, H, I]) bound to the "fused_moe" backend."""
        from kernels.moe.backends import bind_float_experts

        return bind_float_experts(self.backend("fused_moe"), w13, w2, extras)

    def quantized_experts(self, method: str, weights: Any) -> BoundExperts:
        """4-bit experts ("int4" `Int4Experts`, "mxfp4" `Mxfp4Experts`) bound to the
        backend of their op ("fused_moe_int4" / "fused_moe_mxfp4")."""
        from kernels.moe.backends import bind_int4_experts, bind_mxfp4_experts

        if method == "int4":
            return bind_int4_experts(self.backend("fused_moe_int4"), weights)
        return bind_mxfp4_experts(self.backend("fused_moe_mxfp4"), weights)

    def keeps_experts(self, method: str, bound: BoundExperts | None) -> bool:
        """Whether binding `bound` (4-bit experts of `method`) again under this plan changes
        nothing: a layout that cannot be converted back (torch's int4 CPU layout) bound to the
        same backend again."""
        op = "fused_moe_int4" if method == "int4" else "fused_moe_mxfp4"
        return bound is not None and bound.restore is None and self.backend(op) == bound.backend

    def graph_unsafe(self, ops: list[str]) -> list[str]:
        """"op=backend" for each of `ops` whose kernel cannot be captured in a CUDA graph
        (only the Triton kernels are launch-only: the others read lengths on the host)."""
        return [f"{op}={self.backend(op)}" for op in dict.fromkeys(ops)
                if self.backend(op) != TRITON]

    @classmethod
    def uniform(cls, backend: str, device: str = "cpu") -> KernelPlan:
        """Every op on `backend` where it implements it, torch elsewhere; nothing is probed
        (for tests that build modules directly)."""
        choices = {
            op: KernelChoice(op, backend if op in IMPLEMENTS[backend] else TORCH, "")
            for op in OPS
        }
        return cls(device, choices)


def fallbacks(op: str, backend: str) -> tuple[str, ...]:
    """The conditions under which `op`'s kernel on `backend` hands a call to another kernel
    (declared by each kernel module beside the code that takes them; the startup plan prints
    them): () for a kernel that runs every call it is given."""
    if backend != NATIVE_CPU:
        return ()
    if op == "linear":
        from kernels.dense.linear import NATIVE_FALLBACKS

        return NATIVE_FALLBACKS
    if op == "attention_prefill":
        from kernels.attention.paged import NATIVE_PREFILL_FALLBACKS

        return NATIVE_PREFILL_FALLBACKS
    if op in ("fused_moe", "fused_moe_int4", "fused_moe_mxfp4"):
        from kernels.moe.backends import NATIVE_FALLBACKS

        return NATIVE_FALLBACKS
    if op == "decode_layer":
        from kernels.decode_layer.native import MAX_ROWS

        return (f"steps with prefills or over {MAX_ROWS} rows, and layers the kernel does "
                f"not implement (the log lists them): module by module",)
    if op == "rms_norm":
        return ("inputs of more than 3 dimensions or another dtype than the weight's: torch",)
    return ()


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
            return "the native prefill attention needs AVX512-BF16"
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
