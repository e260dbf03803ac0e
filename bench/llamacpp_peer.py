"""llama.cpp as a peer of `bench/throughput.py`: its build, its GGUFs, its rows.

One row per GGUF type (`--llamacpp-types`, default f32, bf16, Q8_0, Q4_0 of the benchmark
checkpoint, made by bench/llamacpp_gguf.py), each a `bench/llamacpp_runner.py` process under the
python of the venv `bench/setup_llamacpp.sh` makes (run on demand), loading the shared library
that script built from the llama-cpp-python sdist. Rows are named `llama.cpp-<type>`; every
further `--llamacpp-config` adds a row per type named `llama.cpp-<type>-<config>` (for trying
settings side by side, as bench/NOTES.md section 13 did).

A config is `key=value` items joined by commas. Keys are the runner's options with `_` for `-`
(RUNNER_KEYS), `env.NAME=VALUE` sets an environment variable of the runner, and a `TYPE:` prefix
(`q4_0:extra_bufts=on`) limits an item to the rows of that GGUF type. Items a config leaves out
keep DEFAULT_CONFIG's, then the runner's own defaults.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from llamacpp_gguf import DEFAULT_ROOT, DEFAULT_TYPES, GGUF_TYPES, ensure_ggufs
from peer_runner import PeerContext, PeerFamily, PeerLaunch, peer_environ

logger = logging.getLogger("bench.llamacpp_peer")

BENCH_DIR = Path(__file__).resolve().parent
ROW_PREFIX = "llama.cpp"
#: llamacpp_runner.py's options a config may set (`n_ubatch=256` -> `--n-ubatch 256`);
#: kv_unified is a switch (`kv_unified=1`).
RUNNER_KEYS = ("threads", "threads_batch", "n_batch", "n_ubatch", "flash_attn", "type_k",
               "type_v", "seq_order", "extra_bufts", "kv_unified")
#: The settings bench/NOTES.md section 13 measured best on the project's machine (2 cores,
#: AVX-512 + AMX): every CPU this process may use as a thread (2 beat 1 by 1.5-2x), flash
#: attention off (on: 20-30% slower), ggml-cpu's extra buffer types on (AMX / repacked Q8_0 and
#: Q4_0: 15-35% faster; no effect on f32 and bf16), n_ubatch 512 (128 and 2048 no better), one
#: KV stream per sequence (a unified KV cache: 3-4x slower), and for the f32 row an f32 KV cache
#: (as fast as f16 and token-exact with moe-engine in float32; f16 KV is not). OpenMP keeps its
#: default wait policy: libgomp spins briefly, then sleeps, so an idle runner takes no CPU
#: (measured 0.0 cores), while OMP_WAIT_POLICY=passive halved the throughput.
DEFAULT_CONFIG = (f"threads={len(os.sched_getaffinity(0))},flash_attn=off,extra_bufts=on,"
                  "n_ubatch=512,f32:type_k=f32,f32:type_v=f32")


def parse_config(text: str, gguf_type: str) -> tuple[list[str], dict[str, str]]:
    """The runner flags and extra environment of config `text` for a row of `gguf_type`.

    `"threads=2,q4_0:extra_bufts=off,env.OMP_WAIT_POLICY=passive"` for `q4_0` ->
    (`["--threads", "2", "--extra-bufts", "off"]`, `{"OMP_WAIT_POLICY": "passive"}`); for `f32`
    the `q4_0:` item is skipped. A later item overrides an earlier one of the same key.

    Raises:
        ValueError: an item without `=`, an unknown key, or a prefix that is no GGUF type.
    """
    options: dict[str, str] = {}
    env: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        scope, colon, key = key.rpartition(":")
        if not sep or not key:
            raise ValueError(f"llama.cpp config item {item!r} is not [TYPE:]key=value")
        if colon and scope not in GGUF_TYPES:
            raise ValueError(f"llama.cpp config item {item!r}: {scope!r} is not one of "
                             f"{sorted(GGUF_TYPES)}")
        if colon and scope != gguf_type:
            continue
        if key.startswith("env."):
            env[key[4:]] = value
        elif key in RUNNER_KEYS:
            options[key] = value
        else:
            raise ValueError(f"llama.cpp config item {item!r}: unknown key {key!r}; keys are "
                             f"{', '.join(RUNNER_KEYS)} and env.NAME")
    flags: list[str] = []
    for key, value in options.items():
        if key == "kv_unified":
            flags += ["--kv-unified"] if value.lower() not in ("0", "false", "off", "") else []
        else:
            flags += [f"--{key.replace('_', '-')}", value]
    return flags, env


def row_name(gguf_type: str, config: str | None) -> str:
    """`llama.cpp-q4_0` for the first config, `llama.cpp-q4_0-threads=1+flash_attn=on` for
    another (`,` becomes `+`, so that the name is one entry of `--engines`)."""
    base = f"{ROW_PREFIX}-{gguf_type}"
    return base if config is None else f"{base}-{config.replace(',', '+')}"


def ensure_llamacpp(root: Path) -> Path:
    """The python of the venv under `root`; runs `setup_llamacpp.sh` first when its bindings do
    not import against `root/build/bin` (the script's output goes to stderr).

    Raises:
        RuntimeError: the setup script failed.
    """
    python = root / "venv" / "bin" / "python"
    if python.is_file() and subprocess.run(
        [str(python), "-c", "import llama_cpp.llama_cpp"], capture_output=True, check=False,
        env={**os.environ, "LLAMA_CPP_LIB_PATH": str(root / "build" / "bin")},
    ).returncode == 0:
        return python
    script = BENCH_DIR / "setup_llamacpp.sh"
    logger.info("no llama.cpp in %s: running %s", root, script)
    done = subprocess.run(["bash", str(script)], env={**os.environ, "LLAMACPP_DIR": str(root)},
                          stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed with exit status {done.returncode}")
    return python


def llamacpp_launches(ctx: PeerContext) -> list[PeerLaunch]:
    """One launch per GGUF type of `ctx.args.llamacpp_types` and `--llamacpp-config` (the
    first named `llama.cpp-<type>`, see `row_name`), each config applied on top of
    DEFAULT_CONFIG; makes the build and the GGUFs first when missing.

    Raises:
        ValueError: an unknown GGUF type or a bad config.
        RuntimeError: the setup script failed.
        subprocess.CalledProcessError: making a GGUF failed.
    """
    args = ctx.args
    types = [t.strip() for t in args.llamacpp_types.split(",") if t.strip()]
    for gguf_type in types:
        if gguf_type not in GGUF_TYPES:
            raise ValueError(f"--llamacpp-types: {gguf_type!r} is not one of "
                             f"{sorted(GGUF_TYPES)}")
    configs = args.llamacpp_config or [""]
    parsed = {(t, c): parse_config(f"{DEFAULT_CONFIG},{c}", t) for c in configs for t in types}
    root = Path(args.llamacpp_dir)
    python = ensure_llamacpp(root)
    # bench/real_scale.py's own options: quantize from bf16, GGUFs beside its checkpoints
    extra = {k: v for k, v in (("quant_base", getattr(args, "llamacpp_quant_base", None)),
                               ("out", getattr(args, "llamacpp_gguf_dir", None))) if v}
    ggufs = ensure_ggufs(ctx.ckpt, root, types, **extra)
    lib_dir = root / "build" / "bin"
    launches = []
    for i, config in enumerate(configs):
        for gguf_type in types:
            flags, extra = parsed[(gguf_type, config)]
            settings: dict[str, Any] = {"config": f"{DEFAULT_CONFIG},{config}".strip(","),
                                        "env": extra}
            launches.append(PeerLaunch(
                name=row_name(gguf_type, None if i == 0 else config),
                argv=[str(python), str(BENCH_DIR / "llamacpp_runner.py"), "--model",
                      str(ggufs[gguf_type]), "--requests", str(ctx.requests_path),
                      "--lib-dir", str(lib_dir), *flags],
                env=peer_environ(LLAMA_CPP_LIB_PATH=str(lib_dir), **extra),
                compute_dtype=gguf_type, settings=settings))
    return launches


def add_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags of bench/throughput.py."""
    p.add_argument("--llamacpp-dir", type=Path,
                   default=Path(os.environ.get("LLAMACPP_DIR", DEFAULT_ROOT)),
                   help="bench/setup_llamacpp.sh's folder (build, venv, GGUFs), set up when "
                        "missing (default: $LLAMACPP_DIR or bench/.venvs/llamacpp)")
    p.add_argument("--llamacpp-types", default=",".join(DEFAULT_TYPES),
                   help=f"GGUF types, one row each, of {','.join(GGUF_TYPES)} (default "
                        f"{','.join(DEFAULT_TYPES)})")
    p.add_argument("--llamacpp-config", action="append", metavar="K=V,...",
                   help="runner settings over the defaults (" + DEFAULT_CONFIG + "); "
                        "repeatable, each further one a row per type; keys: "
                        f"{', '.join(RUNNER_KEYS)}, env.NAME; TYPE:key=value for one type")


LLAMACPP = PeerFamily(ROW_PREFIX, llamacpp_launches, add_arguments)
