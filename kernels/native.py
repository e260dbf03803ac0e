"""Build and load the engine's C++ CPU kernels (kernels/csrc/*.cpp) on first use.

Triton does not compile for a CPU, and torch's small matmuls leave most of a CPU's FMA units
idle at decode batch sizes (measured on the project's machine: a [8, 512] x [512, 512] float32
GEMM reaches 38 GFLOP/s on one or two cores, against 78 per core for large ones). The hot CPU
loops of the engine (the fused MoE experts, decode attention over the paged cache, the dense
linears, RMSNorm) are therefore C++ with AVX2/FMA intrinsics and OpenMP.

They include no torch header: they export the C ABI of csrc/moe_engine_cpu.h (raw pointers and
sizes), wrapped by a small Python module generated from that header (`kernels.native_binding`:
Python.h only, ~0.3 us a call). The system's C++ compiler (`$CXX`, else g++) builds them the
first time a process needs them, one compiler per source in parallel and one link
(`kernels.native_build`: 6-8 s on a busy 2-core machine, where the torch-extension build of the
same kernels, each source including `torch/extension.h`, took 55-106 s). The build is cached
under `$MOE_ENGINE_CACHE/native/`, keyed by a digest of the sources, headers, flags, compiler
and Python ABI (an edited source rebuilds; concurrent processes wait on the build's file lock);
loading a cached build takes milliseconds. The wrappers in kernels/cpu_*.py check shapes and
dtypes, allocate outputs with torch and pass `tensor.data_ptr()`; the GIL is released during a
kernel. Every parallel region runs `torch.get_num_threads()` OpenMP threads (passed per call),
in torch's own OpenMP runtime: the module's libgomp.so.1 resolves to the copy torch loaded, so
there is one thread pool.

Whether they run is decided once, at startup, by the kernel registry (kernels/registry.py,
`--kernel-backend`): `native_unavailable_reason` builds or loads the library and says why it
cannot run here, if it cannot; the kernel objects call `load_native` only after that.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from kernels.native_binding import MODULE
from kernels.native_build import ABI_VERSION, BuildError, ensure_library
from kernels.native_progress import Reporter

logger = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be used here (the reason is the message)."""


def _cpu_supported() -> str | None:
    """None when this CPU runs the AVX2/FMA build, else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} lacks AVX2/FMA"
    return None


#: A build progress callback: (message, estimated seconds left or None). `prepare_native` calls
#: it when a build starts, at least every 15 s while it runs, and when it ends.
ProgressCallback = Callable[[str, "float | None"], None]

#: The kernels under kernels/csrc/ (one source each, all in one library).
KERNELS = ("moe_cpu", "linear_cpu", "paged_attention", "ops_cpu", "rope_cpu")

#: Statuses of the entry points (csrc/moe_engine_cpu.h kOk, kBadArgument, kOutOfMemory).
OK, BAD_ARGUMENT, OUT_OF_MEMORY = 0, 1, 2


def build_dir() -> Path:
    """Where compiled kernels are cached: `$MOE_ENGINE_CACHE/native/` (one directory per
    digest of sources, headers, flags, compiler and Python ABI)."""
    from moe_engine.config import cache_root

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


def _library(progress: ProgressCallback | None = None) -> ModuleType:
    """Build (or load from the cache) the module of every kernels/csrc/*.cpp, once per
    process (a failure is remembered too).

    Args:
        progress: told when a build starts, while it runs and when it ends (not called when the
            module loads from the cache, or was loaded before in this process).

    Raises:
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build or load failed (the message
            has the compiler's output).
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
    reason = _cpu_supported()
    if reason is not None:
        raise NativeUnavailable(reason)
    report = Reporter(progress)
    try:
        path = ensure_library(build_dir(), report)
    except (BuildError, OSError) as exc:
        if report.active:
            report.failed(str(exc))
        raise NativeUnavailable(f"building kernels/csrc failed: {exc}") from exc
    try:  # torch is imported: its libgomp.so.1 is the one the module binds to
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise NativeUnavailable(f"loading {path} failed: {exc}") from exc
    if module.moe_engine_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI version {module.moe_engine_abi_version()}, "
                                f"kernels/native.py expects {ABI_VERSION}")
    return module


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
