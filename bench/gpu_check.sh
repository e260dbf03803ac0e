#!/usr/bin/env bash
# One prepared check of the engine on one CUDA GPU: at most ~8 minutes on
# an H200, every step under its own `timeout`, nothing installed from a registry.
#
#   bench/gpu_check.sh                 # on the GPU machine; outputs under ${OUT:-./gpu_check_out}
#   bench/gpu_check.sh --dry-run       # on a CPU-only machine, seconds: the same steps, checked
#   bench/gpu_check.sh --fetch-wheels  # here (registry access): the few pure-Python/small wheels
#                                      # the GPU image lacks, into .whl/ (carry it there)
#
# Steps (each prints "=== <step>: rc=N in S s"; the summary lists them):
#   env         versions (python, torch, CUDA, triton, transformers), nvidia-smi
#   wheels      .whl/*.whl installed offline into a temporary folder, when .whl/ exists
#   gpu-tests   pytest -q -m gpu tests (TRITON_INTERPRET=0: compiled kernels)
#   kernels     bench/gpu_kernels.py: fused MoE weight bandwidth, decode attention KV bandwidth,
#               against the device's copy bandwidth -> gpu_kernels.md / gpu_kernels.json
#   throughput  bench/throughput.py --engines moe-engine --device cuda: mixed-64 output tok/s on
#               bench-qwen3-moe (generated at first use, nothing downloaded) -> throughput.json
#   summary     summary.md: every step's status, the tables, tok/s and its ratio to the CPU
#               engine's mixed-64 figure quoted in bench/README.md (577.7 tok/s, measured on the
#               project's 2-core CPU machine; not re-measured here)
# --dry-run: TRITON_INTERPRET=1; the gpu tests are collected and must all skip; gpu_kernels.py
# runs with --dry-run (tiny shapes, CPU timers); the throughput command is parsed and shown,
# not run. Files under $OUT: gpu_check.log, gpu_kernels.md, gpu_kernels.json, throughput.json
# (not in a dry run), summary.md. Exit status 0 when every step passed, 1 otherwise, 2 for a
# bad flag or no CUDA device (not a dry run).
set -u

MODE=gpu
for arg in "$@"; do
    case "$arg" in
        --dry-run) MODE=dry ;;
        --fetch-wheels) MODE=fetch ;;
        -h | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench/gpu_check.sh: unknown argument '$arg' (--dry-run, --fetch-wheels)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
# The CPU engine's mixed-64 figure (bench/README.md, throughput.py table: moe-engine, bf16
# weights, native CPU kernels, 2-core AVX2 machine, 2026-11-29).
CPU_MIXED64_TOK_S=577.7
# Per-step limits, seconds (sum 460 s: the 8-minute budget with room for the start).
T_ENV=${GPU_CHECK_T_ENV:-20}
T_WHEELS=${GPU_CHECK_T_WHEELS:-30}
T_TESTS=${GPU_CHECK_T_TESTS:-120}
T_KERNELS=${GPU_CHECK_T_KERNELS:-120}
T_THROUGHPUT=${GPU_CHECK_T_THROUGHPUT:-170}
# Small wheels the GPU image lacks (bench/README.md, "gpu_check.sh"): the engine's messages
# (msgspec), its front end <-> core sockets (pyzmq) and the gRPC server's stubs.
WHEELS="msgspec pyzmq grpcio grpcio-health-checking grpcio-reflection protobuf"

if [ "$MODE" = fetch ]; then
    pins=$("$PY" -c "import importlib.metadata as m, sys
print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $WHEELS) || exit 1
    echo "downloading into $ROOT/.whl: $pins"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$ROOT/.whl" $pins || exit 1
    echo "carry .whl (git-ignored) to the GPU machine; gpu_check.sh installs it from there"
    exit 0
fi

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$MODE" = dry ]; then
    export TRITON_INTERPRET=1  # before any import of triton: there is no GPU
else
    export TRITON_INTERPRET=0  # compiled kernels, whatever a test module sets for the CPU
fi
STEPS=()
FAILED=0
LAST_RC=0
export PY MODE OUT

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT CMD...: CMD under `timeout` (TERM, then KILL 10 s later, to its whole process
# group), output into the log. A shell function runs as `bash -c NAME` (exported with export -f).
step() {
    local name=$1 limit=$2 start rc
    shift 2
    say "=== $name (timeout ${limit} s): $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && say "=== $name: TIMED OUT after ${limit} s"
    say "=== $name: rc=$rc in $(($(date +%s) - start)) s"
    STEPS+=("$name|$rc|$(($(date +%s) - start))")
    LAST_RC=$rc
    [ "$rc" = 0 ] || FAILED=1
}

say "gpu_check.sh mode=$MODE root=$ROOT out=$OUT commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)"

env_report() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PY" - "$MODE" <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}",
          p.multi_processor_count, "SMs")
for name in ("triton", "transformers", "safetensors", "msgspec", "zmq", "grpc", "pytest"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError as exc:
        print(name, "MISSING:", exc)
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    sys.exit("no CUDA device: torch.cuda.is_available() is False (use --dry-run on a CPU)")
EOF
}
export -f env_report
step env "$T_ENV" bash -c env_report
if [ "$MODE" = gpu ] && [ "$LAST_RC" != 0 ]; then
    say "no usable CUDA device; stopping"; exit 2
fi

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    if [ "$MODE" = dry ]; then
        say "=== wheels: would install $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl (dry run)"
    else
        SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
        step wheels "$T_WHEELS" "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target "$SITE" "$ROOT"/.whl/*.whl
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    fi
else
    say "=== wheels: no .whl/ (bench/gpu_check.sh --fetch-wheels makes it); using the image's packages"
fi

step gpu-tests "$T_TESTS" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
    --continue-on-collection-errors tests

if [ "$MODE" = dry ]; then
    step kernels "$T_KERNELS" "$PY" bench/gpu_kernels.py --dry-run --out "$OUT"
else
    step kernels "$T_KERNELS" "$PY" bench/gpu_kernels.py --out "$OUT"
fi

export THROUGHPUT_ARGS="--engines moe-engine --device cuda --json --cache-dir /tmp/gpu_check_cache"
throughput() {
    # shellcheck disable=SC2086  # word splitting of the fixed argument string is meant
    "$PY" bench/throughput.py $THROUGHPUT_ARGS >"$OUT/throughput.json.tmp" &&
        mv "$OUT/throughput.json.tmp" "$OUT/throughput.json" && cat "$OUT/throughput.json"
}
throughput_dry() {
    echo "would run: $PY bench/throughput.py $THROUGHPUT_ARGS > $OUT/throughput.json"
    # shellcheck disable=SC2086
    "$PY" - $THROUGHPUT_ARGS <<'EOF'
import inspect, sys
sys.path.insert(0, "bench")
import throughput
args = throughput.parse_args(sys.argv[1:])
assert args.device == "cuda" and args.engines == "moe-engine" and args.json, args
from moe_engine import LLM
ok = "device" in inspect.signature(LLM).parameters
print("throughput.py parses the GPU command: device", args.device, "engines", args.engines)
print("moe_engine.LLM takes device=:", ok if ok else "NO (the engine's --device is not merged "
      "yet; on the GPU this step would fail)")
EOF
}
export -f throughput throughput_dry
if [ "$MODE" = dry ]; then
    step throughput "$T_THROUGHPUT" bash -c throughput_dry
else
    step throughput "$T_THROUGHPUT" bash -c throughput
fi

"$PY" - "$OUT" "$MODE" "$CPU_MIXED64_TOK_S" "${STEPS[@]}" <<'EOF' | tee -a "$LOG"
import json, re, sys
from pathlib import Path
out, mode, cpu_tok_s, steps = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4:]
lines = ["# bench/gpu_check.sh summary" + (" (DRY RUN on the CPU: no GPU figures)" if mode == "dry"
                                          else ""), "", "| step | rc | seconds |", "|---|---:|---:|"]
lines += [f"| {s.split('|')[0]} | {s.split('|')[1]} | {s.split('|')[2]} |" for s in steps]
log = (out / "gpu_check.log").read_text().split("=== gpu-tests (")[-1].split("=== gpu-tests:")[0]
final = re.findall(r"^(?:=+ )?(\d+ (?:passed|failed|skipped|deselected|error).*? in [\d.]+s.*)$",
                   log, re.M)
lines += ["", "gpu tests: " + (final[-1].strip("= ") if final else "no pytest summary line")]
kernels = out / "gpu_kernels.md"
lines += ["", "## Kernels", "", kernels.read_text() if kernels.is_file() else "(no table)"]
report = out / "gpu_kernels.json"
if report.is_file() and mode == "gpu":
    rows = json.loads(report.read_text())["moe"]
    pct = [r["pct_of_copy"] for r in rows if r["format"] in ("int4", "mxfp4")
           and r["tokens"] in (8, 64) and "pct_of_copy" in r]
    if pct:
        lines.append(f"4-bit fused MoE at 8-64 tokens: {min(pct):.1f}-{max(pct):.1f}% of copy "
                     f"bandwidth (goal >= 60%)")
lines += ["", "## mixed-64 on bench-qwen3-moe"]
tp = out / "throughput.json"
if tp.is_file():
    engine = json.loads(tp.read_text())["engines"]["moe-engine"]
    rate = engine.get("output_tokens_per_s")
    lines.append(f"moe-engine --device cuda: {rate} output tok/s (runs {engine.get('runs_s')} s, "
                 f"compute dtype {engine.get('compute_dtype')})" if rate else
                 f"moe-engine --device cuda failed: {engine.get('error')}")
    if rate:
        lines.append(f"ratio to the CPU engine's {cpu_tok_s} tok/s (bench/README.md, 2-core "
                     f"machine): {rate / cpu_tok_s:.1f}x (goal >= 10x)")
else:
    lines.append("no throughput figure" + (" (dry run: the command is only checked)"
                                           if mode == "dry" else " (the step failed)"))
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "=== gpu_check.sh: $([ $FAILED = 0 ] && echo 'all steps passed' || echo 'some step FAILED'); outputs in $OUT"
exit $FAILED
