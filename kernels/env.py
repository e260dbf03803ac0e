"""The kernels' own settings, read from the environment in one place.

`MOE_ENGINE_CACHE` (where built kernels and generated checkpoints are cached),
`MOE_ENGINE_AMX` (where the bf16 kernels may run), `MOE_ENGINE_THREADS` / `MOE_ENGINE_SPIN_US`
(the native thread pool, kernels/native/csrc/thread_pool.h) and `MOE_ENGINE_CPU_ISA`
(`kernels.native.library.choose_isa`). `moe_engine` reads them from here, never the reverse.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where generated checkpoints live: $MOE_ENGINE_CACHE, else ~/.cache/moe-engine."""
    root = os.environ.get("MOE_ENGINE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "moe-engine"



#: Values MOE_ENGINE_AMX accepts (`amx_setting`): 0 off, 1 on (AMX tiles, else AVX512-BF16),
#: avx512-bf16 (never the tiles).
AMX_SETTINGS = ("0", "1", "avx512-bf16")


def amx_setting() -> str:
    """MOE_ENGINE_AMX (one of `AMX_SETTINGS`, default "1"): where the bf16 kernels (linear and
    fused MoE, kernels/dense/amx.py) may run: "1" on AMX tiles where the CPU has them, else on
    AVX512-BF16 where it has that; "avx512-bf16" never on the tiles; "0" neither."""
    return os.environ.get("MOE_ENGINE_AMX") or "1"


def env_int(name: str, minimum: int) -> int | None:
    """Environment variable `name` as an integer >= minimum, or None when unset or empty.

    Raises:
        ValueError: naming the variable, its value and the limit.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={os.environ[name]!r}: must be an integer >= {minimum}")
    return value


def check_kernel_environment() -> None:
    """Check the kernels' settings in the environment: MOE_ENGINE_THREADS (integer >= 1),
    MOE_ENGINE_SPIN_US (integer >= 0; the kernels' pool would read anything else as 0),
    MOE_ENGINE_AMX (one of `AMX_SETTINGS`). MOE_ENGINE_CPU_ISA is checked by
    `kernels.native.library.choose_isa`.

    Raises:
        ValueError: the first bad one, naming the variable, its value and what it accepts.
    """
    env_int("MOE_ENGINE_THREADS", minimum=1)
    env_int("MOE_ENGINE_SPIN_US", minimum=0)
    amx = os.environ.get("MOE_ENGINE_AMX")
    if amx is not None and amx not in AMX_SETTINGS:
        raise ValueError(f"MOE_ENGINE_AMX={amx!r}: must be one of {', '.join(AMX_SETTINGS)}")
