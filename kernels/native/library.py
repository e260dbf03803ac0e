"""Build and load the engine's C++ CPU kernels (kernels/native/csrc/*.cpp) on first use.

Triton does not compile for a CPU, and torch's small matmuls leave most of a CPU's FMA units
idle at decode batch sizes (measured on the project's machine: a [8, 512] x [512, 512] float32
GEMM reaches 38 GFLOP/s on one or two cores, against 78 per core for large ones). The hot CPU
loops of the engine (the fused MoE experts, decode attention over the paged cache, the dense
linears, RMSNorm) are therefore C++ with AVX2/FMA (or AVX-512) intrinsics on their own thread
pool (csrc/thread_pool.h).

Two variants of the library are built from the same sources (kernels/native/build.py
`ISA_FLAGS`): "avx2" and "avx512" (512-bit micro-kernels: csrc/gemm_avx512.h, q4_avx512.h).
`choose_isa` picks one per process, once, from the CPU's features (`/proc/cpuinfo` flags:
avx512f, avx512bw, avx512vl and avx512dq for "avx512"; else torch's CPU capability), unless
`MOE_ENGINE_CPU_ISA` (auto, avx2, avx512) names one; a variant this CPU cannot run is refused
with the flags it lacks. The choice is logged when the library loads and shown in the kernel
registry's startup plan (`loaded_isa`).

They include no torch header: they export the C ABI of csrc/moe_engine_cpu.h (raw pointers and
sizes), wrapped by a small Python module generated from that header (`kernels.native.binding`:
Python.h only, ~0.3 us a call). The system's C++ compiler (`$CXX`, else g++) builds them the
first time a process needs them, one compiler per source in parallel and one link
(`kernels.native.build`: 6-8 s on a busy 2-core machine, where the torch-extension build of the
same kernels, each source including `torch/extension.h`, took 55-106 s). The build is cached
under `$MOE_ENGINE_CACHE/native/`, keyed by a digest of the sources, headers, flags, compiler
and Python ABI (an edited source rebuilds; concurrent processes wait on the build's file lock);
loading a cached build takes milliseconds. The wrappers (kernels/moe/native.py,
kernels/attention/native_*.py, kernels/dense/native_*.py, ...) check shapes and dtypes,
allocate outputs with torch and pass `tensor.data_ptr()`; the GIL is released during a kernel.
A call uses up to `torch.get_num_threads()` threads (passed per call) of the module's pool,
whose caller never waits for a thread the OS has not scheduled (an OpenMP barrier does;
bench/NOTES.md section 8); torch's own ops keep torch's OpenMP pool.

Whether they run is decided once, at startup, by the kernel registry (kernels/registry.py,
`--kernel-backend`): `native_unavailable_reason` builds or loads the library and says why it
cannot run here, if it cannot; the kernel objects call `load_native` only after that.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from kernels.env import cache_root
from kernels.native.binding import MODULE
from kernels.native.build import ABI_VERSION, BuildError, ensure_library
from kernels.native.progress import Reporter

logger = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be used here (the reason is the message)."""


#: The environment variable that overrides the variant: auto (default), avx2 or avx512.
ISA_ENV = "MOE_ENGINE_CPU_ISA"
#: The CPU flags (as /proc/cpuinfo spells them) each variant needs.
ISA_CPU_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
}
#: torch.backends.cpu.get_cpu_capability() values that imply each variant's flags (the
#: fallback where /proc/cpuinfo cannot be read; torch's AVX512 needs F, BW, VL and DQ).
_CAPABILITIES = {"avx2": ("AVX2", "AVX512"), "avx512": ("AVX512",)}


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (Linux; those the kernel enabled, so
    AVX-512 is absent where the OS does not save its registers), or None where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def isa_unsupported_reason(isa: str, flags: frozenset[str] | None = None) -> str | None:
    """None when this CPU runs variant `isa`, else why not (the flags it lacks).

    Args:
        isa: "avx2" or "avx512".
        flags: the CPU's flags; default `cpu_flags()` (torch's capability when unreadable).
    """
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        capability = torch.backends.cpu.get_cpu_capability()
        if capability in _CAPABILITIES[isa]:
            return None
        return f"torch's CPU capability is {capability}, below {isa}"
    missing = [f for f in ISA_CPU_FLAGS[isa] if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def choose_isa(requested: str | None = None,
               flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(variant, why) for this process: the requested one, or under "auto" the widest this CPU
    runs (avx512, else avx2).

    Args:
        requested: "auto", "avx2" or "avx512"; default `$MOE_ENGINE_CPU_ISA`, else "auto".
        flags: the CPU's flags; default `cpu_flags()`.

    Raises:
        ValueError: an unknown name, or a variant named that this CPU cannot run (the message
            names the flags it lacks).
        NativeUnavailable: under "auto", a CPU without AVX2/FMA/F16C.
    """
    env = os.environ.get(ISA_ENV, "")
    requested = (requested or env or "auto").strip().lower()
    where = f"{ISA_ENV}={env}" if env and requested == env.strip().lower() else requested
    if requested == "auto":
        no512 = isa_unsupported_reason("avx512", flags)
        if no512 is None:
            return "avx512", f"auto: this CPU has {', '.join(ISA_CPU_FLAGS['avx512'][3:])}"
        if isa_unsupported_reason("avx2", flags) is None:
            return "avx2", f"auto: not avx512, {no512}"
        raise NativeUnavailable(f"the native kernels need AVX2/FMA/F16C: "
                                f"{isa_unsupported_reason('avx2', flags)}")
    if requested not in ISA_CPU_FLAGS:
        raise ValueError(f"{where}: unknown instruction set {requested!r}; use auto, "
                         f"{', '.join(ISA_CPU_FLAGS)}")
    why = isa_unsupported_reason(requested, flags)
    if why is not None:
        raise ValueError(f"{where}: cannot run the {requested} kernels here: {why} "
                         f"(unset {ISA_ENV} or set it to auto)")
    return requested, where


#: A build progress callback: (message, estimated seconds left or None). `prepare_native` calls
#: it when a build starts, at least every 15 s while it runs, and when it ends.
ProgressCallback = Callable[[str, "float | None"], None]

#: The kernels under kernels/native/csrc/ (one source each, all in one library).
KERNELS = ("moe_cpu", "linear_cpu", "linear_q4_cpu", "paged_attention", "ops_cpu", "rope_cpu",
           "decode_layer", "prefill_attention", "repack")

#: Statuses of the entry points (csrc/moe_engine_cpu.h kOk, kBadArgument, kOutOfMemory).
OK, BAD_ARGUMENT, OUT_OF_MEMORY = 0, 1, 2


def build_dir() -> Path:
    """Where compiled kernels are cached: `$MOE_ENGINE_CACHE/native/` (one directory per
    digest of sources, headers, flags, compiler and Python ABI)."""
    return cache_root() / "native"


def _build(name: str) -> ModuleType:
    """The module holding kernel `name` (all kernels share one module).

    Raises:
        ValueError: an unknown kernel name.
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build failed (message inside).
    """
    if name not in KERNELS:
        raise ValueError(f"unknown native kernel {name!r}; kernels: {KERNELS}")
    return _library()


_lock = threading.Lock()
_loaded: ModuleType | None = None
_failure: NativeUnavailable | None = None
_loaded_isa: str | None = None

#: csrc/moe_engine_cpu.h `moe_engine_vector_bits` of each variant's build.
VECTOR_BITS = {"avx2": 256, "avx512": 512}


def _library(progress: ProgressCallback | None = None) -> ModuleType:
    """Build (or load from the cache) the module of every kernels/native/csrc/*.cpp, once per
    process (a failure is remembered too).

    Args:
        progress: told when a build starts, while it runs and when it ends (not called when the
            module loads from the cache, or was loaded before in this process).

    Raises:
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build or load failed (the message
            has the compiler's output).
        ValueError: `MOE_ENGINE_CPU_ISA` names an unknown variant or one this CPU cannot run
            (`choose_isa`; not remembered, so that a corrected environment is read again).
    """
    global _loaded, _failure
    if _loaded is not None:  # the per-call path: no lock
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise _failure
        try:
            _loaded = _load(progress)
        except NativeUnavailable as exc:
            _failure = exc
            raise
        return _loaded


def _load(progress: ProgressCallback | None) -> ModuleType:
    global _loaded_isa
    isa, why = choose_isa()
    module = _open(isa, progress)
    _loaded_isa = f"{isa} ({why})"
    logger.info("native CPU kernels: the %s build (%s)", isa, why)
    return module


def _open(isa: str, progress: ProgressCallback | None) -> ModuleType:
    """Build (or find cached) and load variant `isa`'s module, checking its ABI version and
    vector width."""
    report = Reporter(progress)
    try:
        path = ensure_library(build_dir(), report, isa=isa)
    except (BuildError, OSError) as exc:
        if report.active:
            report.failed(str(exc))
        raise NativeUnavailable(f"building kernels/native/csrc ({isa}) failed: {exc}") from exc
    if path in _by_path:
        return _by_path[path]
    try:  # torch is imported: its libgomp.so.1 is the one the module binds to
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise NativeUnavailable(f"loading {path} failed: {exc}") from exc
    if module.moe_engine_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI version {module.moe_engine_abi_version()}, "
                                f"kernels/native/library.py expects {ABI_VERSION}")
    bits = module.moe_engine_vector_bits()
    if bits != VECTOR_BITS[isa]:
        raise NativeUnavailable(f"{path} was built for {bits}-bit vectors, not {isa}'s "
                                f"{VECTOR_BITS[isa]}")
    _by_path[path] = module
    return module


#: Each loaded build by path: CPython keeps one copy of a single-phase extension module's
#: dictionary per (path, name) and, importing the same path again, copies it into whatever
#: module `sys.modules` holds under the name, i.e. the variant loaded last; so a build is
#: imported once and reused.
_by_path: dict[Path, ModuleType] = {}


_variants: dict[str, ModuleType] = {}


def load_variant(isa: str) -> ModuleType:
    """Variant `isa`'s module, built and loaded (once per process) beside the one the kernels
    use: for tests and benchmarks that compare the variants in one process (each module is its
    own shared object, loaded with RTLD_LOCAL, so the two sets of C symbols do not mix).

    Raises:
        ValueError: an unknown variant, or one this CPU cannot run (`choose_isa`).
        NativeUnavailable: its build or load failed.
    """
    isa, _ = choose_isa(isa)
    with _lock:
        if isa not in _variants:
            _variants[isa] = _open(isa, None)
        return _variants[isa]


@contextlib.contextmanager
def using(module: ModuleType) -> Iterator[None]:
    """Within the block, `load_native` returns `module` (a `load_variant` result) instead of
    the process's library: for tests and benchmarks that run the same kernel objects on each
    variant in turn; not for concurrent use (one module-level slot)."""
    global _loaded
    before = _loaded
    _loaded = module
    try:
        yield
    finally:
        _loaded = before


def loaded_isa() -> str | None:
    """The variant of the loaded library and why it was chosen, e.g. "avx512 (auto: this CPU
    has avx512f, ...)"; None before it loads (or where it cannot)."""
    return _loaded_isa if _loaded is not None else None


def dtype_flag(t: torch.Tensor, what: str) -> int:
    """The C ABI's dtype flag of `t`: 0 for float32, 1 for bfloat16.

    Raises:
        RuntimeError: any other dtype (the message names `what`).
    """
    if t.dtype == torch.float32:
        return 0
    if t.dtype == torch.bfloat16:
        return 1
    raise RuntimeError(f"{what} must be float32 or bfloat16, got {t.dtype}")


def check_status(status: int, what: str) -> None:
    """Raise for a native call's nonzero status.

    Raises:
        RuntimeError: BAD_ARGUMENT (`what` says which argument).
        MemoryError: OUT_OF_MEMORY.
    """
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"native kernel: out of memory ({what})")
    if status != OK:
        raise RuntimeError(f"native kernel: {what}")


def native_unavailable_reason(progress: ProgressCallback | None = None) -> str | None:
    """Build (or load) the native library, so that a server pays the one-time build before it
    reports ready rather than in its first request; None when it runs here, else why not.

    Args:
        progress: called with (message, estimated seconds left or None) when a build starts,
            at least every 15 s while it runs (or while this process waits for another
            process's build of the same sources), and when it ends (success: ETA 0.0;
            failure: None); the estimate never rises. Not called when the kernels load from
            the cache. The same messages are logged (start and end as warnings).

    Raises:
        ValueError: `MOE_ENGINE_CPU_ISA` names an unknown variant or one this CPU cannot run
            (a configuration error, refused rather than fallen back from).
    """
    try:
        _library(progress)
    except NativeUnavailable as exc:
        return str(exc)
    return None


def prepare_native(progress: ProgressCallback | None = None) -> list[str]:
    """`native_unavailable_reason`, raising instead: the kernel names once the library loads.

    Raises:
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build or load failed.
        ValueError: as `native_unavailable_reason`.
    """
    reason = native_unavailable_reason(progress)
    if reason is not None:
        raise NativeUnavailable(reason)
    return list(KERNELS)


def load_native(name: str) -> ModuleType:
    """The native module (kernel `name`'s functions: csrc/moe_engine_cpu.h's entry points, same
    names and argument order), built on first use. Called by the native-cpu kernel objects,
    which the registry chose only where the library loads.

    Raises:
        ValueError: an unknown kernel name.
        NativeUnavailable: the library cannot be built or loaded here.
    """
    return _build(name)
