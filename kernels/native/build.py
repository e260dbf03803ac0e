"""Compile kernels/native/csrc/*.cpp into one shared library, cached per source version.

The sources are plain C++ (AVX2/FMA or AVX-512 intrinsics, OpenMP) behind the C ABI of
csrc/moe_engine_cpu.h, without torch's headers, so the system compiler builds each translation
unit in a second or three (including `torch/extension.h` made each take ~35 s), plus the Python
module over that ABI (`kernels.native.binding`, generated from the header; Python.h only). One
compiler process per source runs in parallel (as many as this process may use cores), then one
link makes the extension module `_moe_engine_cpu<EXT_SUFFIX>`.

Variants: the same sources build for one instruction set each (`ISAS`): "avx2" (AVX2 + FMA +
F16C, every x86-64 CPU the kernels run on) and "avx512" (adds AVX-512 F/BW/VL/DQ; the headers
pick 512-bit micro-kernels under `__AVX512F__`, csrc/gemm.h). Which one a process loads is
decided once, from the CPU's features, by kernels/native/library.py `choose_isa`.

Cache: `<root>/moe_engine_cpu_<isa>_<digest>/`, the digest covering every source and header,
the binding generator, the variant's flags, the ABI version, the compiler's identity
(`--version`) and the Python ABI (EXT_SUFFIX, include directory), so an edit, another
compiler, another variant or another Python rebuilds. A build happens in a temporary
directory beside it, renamed into place when complete (an interrupted build leaves nothing that
looks finished); processes that need the same build at once (expert-parallel ranks, parallel
test workers) take an exclusive `fcntl.flock` on `<root>/moe_engine_cpu_<isa>_<digest>.lock`,
so one builds and the others wait, then load its result.

Progress (`kernels.native.progress.Reporter`): reported when a build starts, at least every
`PROGRESS_INTERVAL_S` while it runs (compiling or waiting for another process's build) and when
it ends, with an estimate from the per-source compile times of the last build on this machine
(`<root>/last_build.json`), or `EXPECTED_COMPILE_S` before any.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from kernels.native import binding as native_binding
from kernels.native.progress import Reporter

CSRC = Path(__file__).resolve().parent / "csrc"
#: The C ABI (csrc/moe_engine_cpu.h), from which the binding is generated.
HEADER = "moe_engine_cpu.h"
#: The generated binding's translation unit (written into the build directory).
BINDING = "binding.cpp"
LIBRARY = native_binding.MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
#: Bumped with any change of csrc/moe_engine_cpu.h's prototypes (part of the cache digest).
ABI_VERSION = 10
#: The flags of every variant; no -ffast-math.
BASE_CXXFLAGS = ("-O3", "-pthread", "-DNDEBUG", "-std=c++17", "-fPIC", "-fvisibility=hidden")
#: Instruction-set flags per variant, named (not -march=native), so that a cache shared by
#: machines of one architecture level never holds an instruction another machine lacks.
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq"),
}
#: The variants, the portable one first.
ISAS = tuple(ISA_FLAGS)


def cxxflags(isa: str) -> tuple[str, ...]:
    """The compiler flags of variant `isa`.

    Raises:
        ValueError: an unknown variant (names the known ones).
    """
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}; variants: {', '.join(ISAS)}")
    return BASE_CXXFLAGS[:1] + ISA_FLAGS[isa] + BASE_CXXFLAGS[1:]


#: Extra flags of single sources, appended to the variant's: the AMX kernels are their own
#: translation units, called only after csrc/amx_detect.cpp's runtime check. Only the AMX
#: flags (which enable the tile intrinsics and nothing the compiler emits by itself): inline
#: functions and templates these units share with the others (std::vector, cpu_common.h) are
#: merged by the linker into one copy, which must not hold an instruction the variant's CPU
#: lacks.
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
SOURCE_FLAGS = {"amx_gemm.cpp": AMX_FLAGS, "amx_moe.cpp": AMX_FLAGS,
                "amx_attention.cpp": AMX_FLAGS}
#: No OpenMP: the kernels run on their own pool (csrc/thread_pool.h), whose caller never waits
#: for a thread the OS has not scheduled (an OpenMP barrier does).
LDFLAGS = ("-shared", "-pthread")
#: Seconds per source on the project's 2-core machine (g++ 12.2, two compiling at once; 2.8-6 s
#: for moe_cpu.cpp between a quiet and a busy machine): the estimate of a first build, until a
#: build here has recorded its own (`last_build.json`).
EXPECTED_COMPILE_S = {"moe_cpu.cpp": 4.0, "paged_attention.cpp": 1.8, "linear_cpu.cpp": 1.3,
                      "linear_q4_cpu.cpp": 1.5,
                      "thread_pool.cpp": 0.8, "rope_cpu.cpp": 0.8, "ops_cpu.cpp": 0.6,
                      "decode_layer.cpp": 0.6, "binding.cpp": 0.5,
                      "amx_attention.cpp": 0.5}
EXPECTED_LINK_S = 0.2
#: A build (or the wait for another process's) taking longer than this fails (seconds).
BUILD_TIMEOUT_S = 900.0
_POLL_S = 0.05


class BuildError(RuntimeError):
    """The library could not be built (compiler missing, compile or link error, timeout)."""


def find_compiler() -> tuple[str, str]:
    """(path, identity) of the C++ compiler: `$CXX`, else g++, else c++; identity is the
    first line of its `--version`.

    Raises:
        BuildError: none found, or it does not run.
    """
    name = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    path = shutil.which(name) if name else None
    if path is None:
        raise BuildError(f"no C++ compiler found ($CXX={os.environ.get('CXX')!r}, g++, c++); "
                         "install g++ or set CXX")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"the C++ compiler {path} does not run: {exc}") from exc
    return path, (out.splitlines() or [""])[0]


def python_include() -> Path:
    """The directory holding Python.h (the binding's one include beyond csrc/).

    Raises:
        BuildError: Python.h is not there (the Python development headers are missing).
    """
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise BuildError(f"Python.h not found in {include}: install this Python's development "
                         "headers (e.g. python3-dev)")
    return include


def sources(csrc: Path, build: Path) -> list[Path]:
    """The translation units (csrc/*.cpp and the binding, written into `build`), longest
    expected compile first (they start first)."""
    binding = build / BINDING
    binding.write_text(native_binding.binding_source((csrc / HEADER).read_text()))
    paths = [*sorted(csrc.glob("*.cpp")), binding]
    return sorted(paths, key=lambda p: -EXPECTED_COMPILE_S.get(p.name, 1.0))


def build_name(compiler_identity: str, csrc: Path, isa: str = "avx2") -> str:
    """`moe_engine_cpu_<isa>_<digest>`: digest of the ABI version, variant `isa`'s flags,
    compiler identity, Python ABI, the binding generator and every source and header's name
    and bytes."""
    key = (f"{ABI_VERSION}\0{cxxflags(isa)}\0{sorted(SOURCE_FLAGS.items())}\0{LDFLAGS}\0"
           f"{compiler_identity}\0{LIBRARY}\0"
           f"{sysconfig.get_paths()['include']}")
    digest = hashlib.sha256(key.encode())
    generator = Path(native_binding.__file__)
    for path in [*sorted(csrc.glob("*.cpp")), *sorted(csrc.glob("*.h")), generator]:
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return f"moe_engine_cpu_{isa}_{digest.hexdigest()[:16]}"


def ensure_library(root: Path, report: Reporter, csrc: Path | None = None,
                   isa: str = "avx2") -> Path:
    """The built extension module of variant `isa` for the current sources under `root`,
    building it when missing.

    Args:
        root: the cache directory (`kernels.native.library.build_dir()`).
        report: progress of a build (or of the wait for another process's).
        csrc: the sources' directory; default `CSRC` (kernels/native/csrc).
        isa: the variant, one of `ISAS` (this machine must run it: `kernels.native.library`
            checks the CPU first).

    Returns at once (without reporting) when the build is cached; otherwise waits for the
    build's lock, builds (or finds that the lock's holder built it) and reports progress.

    Raises:
        BuildError: no compiler or Python.h, a compile or link error (with the compiler's
            output), or a build or wait over `BUILD_TIMEOUT_S`.
        ValueError: an unknown variant.
    """
    csrc = csrc or CSRC
    flags = cxxflags(isa)
    cxx, identity = find_compiler()
    python_include()
    name = build_name(identity, csrc, isa)
    final = root / name
    if (final / LIBRARY).is_file():
        return final / LIBRARY
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / f"{name}.lock", report) as lock:
        if (final / LIBRARY).is_file():  # the lock's previous holder built it
            report.built_elsewhere(final)
            return final / LIBRARY
        for stale in root.glob(f"{name}.tmp*"):  # left by a builder that died
            shutil.rmtree(stale, ignore_errors=True)
        _build(cxx, identity, flags, csrc, root, final, lock, report)
    return final / LIBRARY


@contextlib.contextmanager
def _build_lock(path: Path, report: Reporter) -> Iterator[object]:
    """Hold the exclusive lock on `path` (a file that also tells waiters who builds and how
    long that is expected to take), reporting while another process holds it."""
    with open(path, "a+") as lock:
        start = time.monotonic()
        waiting = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if time.monotonic() - start > BUILD_TIMEOUT_S:
                raise BuildError(f"waited {BUILD_TIMEOUT_S:.0f} s for the build lock {path}")
            if not waiting or report.due():
                report.waiting(path, time.monotonic() - start, first=not waiting)
                waiting = True
            time.sleep(_POLL_S * 4)
        try:
            yield lock
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(cxx: str, identity: str, flags: tuple[str, ...], csrc: Path, root: Path,
           final: Path, lock, report: Reporter) -> None:
    """Compile and link into a temporary directory, then rename it to `final`."""
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{final.name}.tmp"))
    tmp.chmod(0o755)
    try:
        srcs = sources(csrc, tmp)
        jobs = max(1, min(len(srcs), len(os.sched_getaffinity(0))))
        report.start(len(srcs), jobs, _expected_seconds(root, srcs), EXPECTED_LINK_S, final)
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"pid": os.getpid(), "started": time.time(),
                               "expected_s": report.eta()}))
        lock.flush()
        seconds = _compile_all([cxx, *flags], srcs, [f"-I{csrc}", f"-I{python_include()}"],
                               tmp, jobs, report)
        link_start = time.monotonic()
        objects = [str(tmp / f"{s.stem}.o") for s in srcs]
        _link([cxx, *objects, *LDFLAGS, "-o", str(tmp / LIBRARY)], tmp / "link.log", report,
              seconds)
        record = {"compiler": cxx, "identity": identity, "cxxflags": list(flags),
                  "jobs": jobs, "compile_s": seconds,
                  "link_s": round(time.monotonic() - link_start, 3),
                  "total_s": round(report.elapsed(), 3)}
        (tmp / "build.json").write_text(json.dumps(record, indent=1))
        if final.exists():  # a cache directory without its library (deleted by hand)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):
        (root / "last_build.json").write_text(json.dumps(record, indent=1))
    report.done(final)


def _compile_all(compiler: list[str], srcs: list[Path], includes: list[str], out: Path,
                 jobs: int, report: Reporter) -> dict[str, float]:
    """Run one compiler per source (`compiler`: its path and flags), `jobs` at a time; returns
    seconds per source name.

    Raises:
        BuildError: a source failed to compile (the others are stopped), or the time ran out.
    """
    pending = list(srcs)
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    done: dict[str, float] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                src = pending.pop(0)
                log = out / f"{src.stem}.log"
                cmd = [*compiler, *SOURCE_FLAGS.get(src.name, ()), *includes, "-c", str(src),
                       "-o", str(out / f"{src.stem}.o")]
                with _stop_signals_held(), open(log, "wb") as sink:
                    running[src.name] = (_spawn(cmd, sink), time.monotonic(), log)
            for name, (proc, started, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if proc.returncode != 0:
                    raise BuildError(f"compiling {name} failed (exit {proc.returncode}; "
                                     f"{' '.join(proc.args)}):\n{_tail(log)}")
                done[name] = round(time.monotonic() - started, 3)
                report.compiled(done, {n: time.monotonic() - s for n, (_, s, _) in running.items()})
            if _time_left(report) <= 0:
                raise BuildError(f"the build took over {BUILD_TIMEOUT_S:.0f} s")
            if report.due():
                report.tick(done, {n: time.monotonic() - s for n, (_, s, _) in running.items()})
            time.sleep(_POLL_S)
    finally:
        for proc, _, _ in running.values():
            _kill_group(proc)
    return done


def _link(cmd: list[str], log: Path, report: Reporter, done: Mapping[str, float]) -> None:
    """Run the link, reporting at the usual interval while it runs.

    Raises:
        BuildError: the link failed (its output inside) or the build's time ran out.
    """
    start = time.monotonic()
    proc = None
    try:
        with _stop_signals_held(), open(log, "wb") as sink:
            proc = _spawn(cmd, sink)
        while proc.poll() is None:
            if _time_left(report) <= 0:
                raise BuildError(f"linking {LIBRARY}: the build took over "
                                 f"{BUILD_TIMEOUT_S:.0f} s")
            if report.due():
                report.linking(done, time.monotonic() - start)
            time.sleep(_POLL_S)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
    if proc.returncode != 0:
        raise BuildError(f"linking {LIBRARY} failed (exit {proc.returncode}; "
                         f"{' '.join(cmd)}):\n{_tail(log)}")


_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while a compiler starts and is recorded, then deliver them.

    A stop signal raises inside the builder (the core's SIGTERM handler raises SystemExit); one
    that landed between the fork and the record would leave a compiler nobody kills, and its
    children outlive the build (PR_SET_PDEATHSIG ends only the direct child). Held, it reaches
    the previous handler when this block ends, and the caller's `finally` then stops every
    compiler. Python runs signal handlers in the main thread only: elsewhere nothing is held
    (nothing raises there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum))
                for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in held:
            signal.raise_signal(signum)


def _spawn(cmd: list[str], sink) -> subprocess.Popen:
    """Start a compiler or linker in a process group of its own (its children included), so
    that `_kill_group` ends all of it and a terminal's Ctrl-C reaches the engine, not it."""
    return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_child_setup)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a `_spawn`ed process and everything in its group (g++ and its cc1plus)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _child_setup() -> None:
    """In the child before exec: default SIGINT/SIGTERM (an engine core ignores them, and
    ignored signals survive exec), and SIGKILL when the building process dies (Linux prctl
    PR_SET_PDEATHSIG), the fallback for a builder killed outright."""
    for sig in _STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _tail(log: Path, chars: int = 3000) -> str:
    text = log.read_text(errors="replace").strip()
    return text if len(text) <= chars else "..." + text[-chars:]


def _expected_seconds(root: Path, srcs: list[Path]) -> dict[str, float]:
    """Expected compile seconds per source: the last build here, else `EXPECTED_COMPILE_S`."""
    last: Mapping[str, float] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        last = json.loads((root / "last_build.json").read_text()).get("compile_s", {})
    return {s.name: float(last.get(s.name) or EXPECTED_COMPILE_S.get(s.name, 1.0)) for s in srcs}


def _time_left(report: Reporter) -> float:
    """Seconds of `BUILD_TIMEOUT_S` left."""
    return BUILD_TIMEOUT_S - report.elapsed()
