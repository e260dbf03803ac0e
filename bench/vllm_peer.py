"""vLLM's CPU build as a peer of `bench/throughput.py`: its venv, its environment, its rows.

One row per dtype vLLM supports on the CPU (`bfloat16` and `float32`; `--vllm-dtypes`), each a
`bench/vllm_runner.py` process under the venv's python (`bench/setup_vllm_cpu.sh`), so that the
comparison is against the best of them on whatever machine runs it (float32 on an AVX2 CPU,
where vLLM's bfloat16 is emulated; possibly bfloat16 where AVX512-BF16 / AMX exist).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from peer_runner import (
    PeerContext,
    PeerFamily,
    PeerLaunch,
    cpu_list,
    find_tcmalloc,
    peer_environ,
)

logger = logging.getLogger("bench.vllm_peer")

BENCH_DIR = Path(__file__).resolve().parent
#: Where `setup_vllm_cpu.sh` makes vLLM's venv unless $VLLM_CPU_VENV says otherwise.
DEFAULT_VLLM_VENV = BENCH_DIR / ".venvs" / "vllm-cpu"
#: vLLM's dtypes on the CPU -> the suffix of their row (`vllm-cpu-bf16`, `vllm-cpu-fp32`).
VLLM_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
ROW_PREFIX = "vllm-cpu"
#: GiB of KV cache per runner: the workload needs about 150 MiB in float32 (18k tokens of
#: 8 layers x 2 KV heads x 64 x (K, V) x 4 bytes), so two runners side by side fit easily.
KVCACHE_GIB = 1
#: The configurations `--vllm-config` names; see `vllm_cpu_env`.
CONFIGS = ("default", "both-cores", "best")
#: The rows run unless `--vllm-config` says otherwise: `best` is the fastest on a quiet
#: machine, `default` (one compute thread) when other processes compete for the two cores
#: (bench/NOTES.md section 8), so the best of both is the baseline either way.
DEFAULT_CONFIGS = ("best", "default")
#: Intel OpenMP settings of the `best` configuration (bench/NOTES.md section 8 has the
#: measurements that chose them): threads sleep as soon as a parallel region ends, so an
#: idle runner takes no CPU from the engine being timed.
BEST_KMP = {"KMP_BLOCKTIME": "0"}


def vllm_cpu_env(venv: Path, config: str = "best", extra: dict[str, str] | None = None
                 ) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment a vLLM runner gets, and a summary of the settings for the report.

    Always `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=KVCACHE_GIB`; then per `config`:
    `"default"` (vLLM's own thread binding, which keeps a core for the front end),
    `"both-cores"` (`VLLM_CPU_OMP_THREADS_BIND` = every CPU this process may run on, 0-1 on the
    project's machine, and `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), `"best"` (both cores, tcmalloc
    and the venv's Intel OpenMP `libiomp5.so` in LD_PRELOAD, the CPU setup vLLM documents,
    and BEST_KMP; a library that is not found is left out and reported as None). `extra` is
    applied last (for trying other settings).

    Raises:
        ValueError: unknown config.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown vLLM config {config!r}; choose from {CONFIGS}")
    env = peer_environ()
    settings = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB)}
    if config in ("both-cores", "best"):
        settings["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(os.sched_getaffinity(0))
        settings["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    preload: dict[str, str | None] = {"tcmalloc": None, "intel_openmp": None}
    if config == "best":
        preload["tcmalloc"] = find_tcmalloc()
        iomp = sorted(venv.glob("lib/libiomp5.so"))
        preload["intel_openmp"] = str(iomp[0]) if iomp else None
        libs = [p for p in (preload["tcmalloc"], preload["intel_openmp"], env.get("LD_PRELOAD"))
                if p]
        if libs:
            settings["LD_PRELOAD"] = ":".join(libs)
        settings.update(BEST_KMP)
    settings.update(extra or {})
    env.update(settings)
    return env, {"config": config, "env": settings, "preload": preload}


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python; runs `setup_vllm_cpu.sh` first when the venv has no vllm (its output
    goes to stderr).

    Raises:
        RuntimeError: the setup script failed.
    """
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True, check=False
    ).returncode == 0:
        return python
    script = BENCH_DIR / "setup_vllm_cpu.sh"
    logger.info("no vLLM in %s: running %s", venv, script)
    done = subprocess.run(["bash", str(script)], env={**os.environ, "VLLM_CPU_VENV": str(venv)},
                          stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed with exit status {done.returncode}")
    return python


def parse_env_pairs(items: list[str] | None) -> dict[str, str]:
    """`["A=1", "B=x,y"]` -> `{"A": "1", "B": "x,y"}` (the repeated `--vllm-env` flag).

    Raises:
        ValueError: an item without `NAME=`.
    """
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-env: expected NAME=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def vllm_launches(ctx: PeerContext) -> list[PeerLaunch]:
    """One launch per dtype of `ctx.args.vllm_dtypes` and configuration of
    `ctx.args.vllm_config` (both comma-separated; default both dtypes, DEFAULT_CONFIGS), named
    `vllm-cpu-bf16` / `vllm-cpu-fp32` for `best` and `vllm-cpu-bf16-default` etc. for the
    others, in that configuration's environment plus `ctx.args.vllm_env`.

    Raises:
        ValueError: a dtype vLLM's CPU build is not benchmarked in, or an unknown config.
        RuntimeError: the venv could not be made.
    """
    args = ctx.args
    dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    configs = [c.strip() for c in args.vllm_config.split(",") if c.strip()]
    for dtype in dtypes:
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"--vllm-dtypes: {dtype!r} is not one of {sorted(VLLM_DTYPES)}")
    for config in configs:
        if config not in CONFIGS:
            raise ValueError(f"--vllm-config: {config!r} is not one of {CONFIGS}")
    venv = Path(args.vllm_venv)
    python = ensure_vllm_venv(venv)
    launches = []
    for config in configs:
        env, settings = vllm_cpu_env(venv, config, parse_env_pairs(args.vllm_env))
        suffix = "" if config == "best" else f"-{config}"
        launches += [
            PeerLaunch(
                name=f"{ROW_PREFIX}-{VLLM_DTYPES[dtype]}{suffix}",
                argv=[str(python), str(BENCH_DIR / "vllm_runner.py"), "--model", str(ctx.ckpt),
                      "--requests", str(ctx.requests_path), "--dtype", dtype,
                      "--max-model-len", str(args.max_model_len)],
                env=env, compute_dtype=dtype, settings=settings,
            )
            for dtype in dtypes
        ]
    return launches


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flags of bench/throughput.py."""
    p.add_argument("--vllm-venv", type=Path,
                   default=Path(os.environ.get("VLLM_CPU_VENV", DEFAULT_VLLM_VENV)),
                   help="vLLM's CPU venv, made by bench/setup_vllm_cpu.sh when missing "
                        "(default: $VLLM_CPU_VENV or bench/.venvs/vllm-cpu)")
    p.add_argument("--vllm-dtypes", default=",".join(VLLM_DTYPES),
                   help="vLLM rows, one runner process per dtype (default bfloat16,float32)")
    p.add_argument("--vllm-config", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated, a row per config and dtype: best = both cores + "
                        "tcmalloc and Intel OpenMP preloaded + BEST_KMP; both-cores = no "
                        "preload; default = vLLM's own binding (one core kept for its front "
                        f"end, one compute thread); default {','.join(DEFAULT_CONFIGS)}")
    p.add_argument("--vllm-env", action="append", metavar="NAME=VALUE",
                   help="extra environment for the vLLM runners (repeatable), to try settings")


VLLM = PeerFamily(ROW_PREFIX, vllm_launches, add_arguments)
