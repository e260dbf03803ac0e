"""Build and load the engine's C++ CPU kernels (kernels/csrc/*.cpp) on first use.

Triton does not compile for a CPU, and torch's small matmuls leave most of a CPU's FMA units
idle at decode batch sizes (measured on the project's machine: a [8, 512] x [512, 512] float32
GEMM reaches 38 GFLOP/s on one or two cores, against 78 per core for large ones). The hot CPU
loops of the engine (the fused MoE experts, decode attention over the paged cache) are
therefore C++ with AVX2/FMA intrinsics and OpenMP, compiled by `torch.utils.cpp_extension.load`
(g++ and ninja) the first time a process needs them and cached under
`$MOE_ENGINE_CACHE/torch_extensions/` (the cache is keyed by the source and flags, so an edited
source rebuilds; concurrent processes wait on the build's lock file).

`MOE_ENGINE_NATIVE=0` turns the native kernels off (the torch paths run instead);
`MOE_ENGINE_NATIVE=1` makes a failed build an error instead of a logged fallback; a
comma-separated list of kernel names (`moe_cpu,linear_cpu,paged_attention`) enables only those
(for ablations: bench/NOTES.md).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
#: Compiler flags: AVX2 + FMA + F16C (not -march=native, so a cache shared by machines of one
#: architecture level never holds an instruction another machine lacks).
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]


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

#: The kernels under kernels/csrc/ (one extension each).
KERNELS = ("moe_cpu", "linear_cpu", "paged_attention", "ops_cpu")


def native_mode(name: str) -> str:
    """How `MOE_ENGINE_NATIVE` treats kernel `name`: "0" (off), "1" (required) or "auto"
    (default: on when it builds). A list of kernel names means "auto" for those, "0" for the
    others.

    Raises:
        ValueError: a value that is none of these, naming the valid kernel names.
    """
    return _parse_mode(os.environ.get("MOE_ENGINE_NATIVE", "auto"), name)


@functools.cache
def _parse_mode(value: str, name: str) -> str:
    mode = value.strip().lower()
    if mode in ("0", "1", "auto"):
        return mode
    names = {n.strip() for n in mode.split(",") if n.strip()}
    if not names or not names <= set(KERNELS):
        raise ValueError(f"MOE_ENGINE_NATIVE must be 0, 1, auto or a list of {KERNELS}, "
                         f"got {value!r}")
    return "auto" if name in names else "0"


def build_dir() -> Path:
    """Where compiled extensions are cached: `$MOE_ENGINE_CACHE/torch_extensions/`."""
    from moe_engine.config import cache_root

    return cache_root() / "torch_extensions"


def _build(name: str) -> ModuleType:
    """The extension module holding kernel `name` (all kernels share one module).

    Raises:
        ValueError: an unknown kernel name.
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build failed (message inside).
    """
    if name not in KERNELS:
        raise ValueError(f"unknown native kernel {name!r}; kernels: {KERNELS}")
    return _build_all()


@functools.cache
def _build_all() -> ModuleType:
    """Compile (or load from the cache) the extension of every kernels/csrc/*.cpp.

    The sources build in parallel (ninja) into one module; the cache directory is named by a
    digest of every source and header, so any edit rebuilds.

    Raises:
        NativeUnavailable: this CPU lacks AVX2/FMA, or the build failed (message inside).
    """
    reason = _cpu_supported()
    if reason is not None:
        raise NativeUnavailable(reason)
    from torch.utils.cpp_extension import load

    sources = sorted(CSRC.glob("*.cpp"))
    digest = hashlib.sha256()
    for path in sources + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    name = f"moe_engine_cpu_{digest.hexdigest()[:12]}"
    directory = build_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    building = not (directory / f"{name}.so").exists()
    if building:
        logger.warning("building the native CPU kernels into %s (once per source version; "
                       "one to a few minutes)", directory)
    start = time.monotonic()
    try:
        module = load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=CFLAGS,
            extra_include_paths=[str(CSRC)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # compiler missing, headers missing, compile error
        raise NativeUnavailable(f"building kernels/csrc failed: {exc}") from exc
    if building:
        logger.warning("native CPU kernels built in %.0f s", time.monotonic() - start)
    return module


def prepare_native(progress: ProgressCallback | None = None) -> list[str]:
    """Check `MOE_ENGINE_NATIVE` and build (or load) the kernels it enables, so that a server
    pays the one-time build before it reports ready rather than in its first request.

    Args:
        progress: told when a build starts, while it runs and when it ends (not called when
            the kernels load from the cache).

    Returns:
        The enabled kernel names ([] when off or unavailable in "auto" mode).

    Raises:
        ValueError: an invalid `MOE_ENGINE_NATIVE` (the message lists the valid values).
        NativeUnavailable: the build failed and `MOE_ENGINE_NATIVE=1`.
    """
    enabled = [k for k in KERNELS if native_mode(k) != "0"]
    return [k for k in enabled if load_native(k) is not None]


def load_native(name: str) -> ModuleType | None:
    """Extension `name` (kernels/csrc/<name>.cpp), built on first use; None when
    `MOE_ENGINE_NATIVE=0`, or when it cannot be built and the mode is "auto" (logged once).

    Raises:
        NativeUnavailable: the build failed and `MOE_ENGINE_NATIVE=1`.
    """
    mode = native_mode(name)
    if mode == "0":
        return None
    try:
        return _build(name)
    except NativeUnavailable as exc:
        if mode == "1":
            raise
        _warn_once(name, str(exc))
        return None


@functools.cache
def _warn_once(name: str, reason: str) -> None:
    logger.warning("native kernel %s unavailable, using the torch path: %s", name, reason)
