#!/usr/bin/env bash
# One prepared check of the engine on one CUDA GPU (H100/H200, no network): at most 8 minutes,
# every step under its own `timeout`, one summary table; nothing installed from a registry.
#
#   bench/gpu_check.sh                 # on the GPU machine; outputs under ${OUT:-./gpu_check_out}
#   bench/gpu_check.sh --dry-run       # on a CPU-only machine: the same steps, checked
#   bench/gpu_check.sh --fetch-wheels  # here (registry access): the few pure-Python/small wheels
#                                      # the GPU image lacks, into .whl/ (carry it there)
#
# Steps (each prints "=== <step>: rc=N in S s"; the summary lists them):
#   env         (a) versions (python, torch, CUDA, triton, transformers), nvidia-smi
#   wheels      .whl/*.whl installed offline into a temporary folder, when .whl/ exists
#   compile     bench/gpu_compile.py --quick: the Triton kernels compiled for this GPU's
#               architecture by the installed Triton, shared memory / spills within limits
#   gpu-tests   pytest -m gpu on tests/test_gpu.py and the CUDA-graph, communicator and device
#               tests (the graph pool in the plan, the warm-up, graphs vs eager, EP sync-free)
#   kernels     (b, c) bench/gpu_kernels.py: fused MoE bf16/int4/MXFP4 at Qwen3-30B-A3B and
#               gpt-oss-20b layer shapes at 1/8/64/512 tokens, split decode with and without
#               sinks/window, a prefill chunk, MLA decode at DeepSeek-V2-Lite widths; every row
#               checked against float64, then its bandwidth as % of the copy bandwidth
#   load-rss    bench/load_rss.py: peak host RSS of loading a ~470 MB checkpoint onto the device
#   e2e-<case>  (d, e, f) bench/gpu_e2e.py, one step per case: random-weight cuts (3 layers) of
#               Qwen3-30B-A3B (bf16, int4), gpt-oss-20b (MXFP4), DeepSeek-V2-Lite made on the
#               machine; fp32 token-exact vs transformers, graphs vs eager identical, bf16
#               agreement, decode step time at batch 1/8/64 vs the roofline, kernels per step,
#               memory at --gpu-memory-utilization 0.9 after a max_model_len prompt
#   summary     summary.md: every step's status and every table
# --dry-run: the kernels under TRITON_INTERPRET=1 at tiny shapes; the compile step compiles for
# sm_90 on the CPU; the e2e cases run on the CPU with tiny configs of the same families (cases
# in GPU_CHECK_E2E_CASES, default all), after printing the real plan (bench/gpu_e2e.py --plan:
# checkpoint sizes, roofline bytes per step). Files under $OUT: gpu_check.log, gpu_compile.json,
# gpu_kernels.md, gpu_kernels.json, e2e-<case>.json, summary.md. Exit status 0 when every step
# passed, 1 otherwise, 2 for a bad flag or no CUDA device (not a dry run).
set -u

MODE=gpu
for arg in "$@"; do
    case "$arg" in
        --dry-run) MODE=dry ;;
        --fetch-wheels) MODE=fetch ;;
        -h | --help) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench/gpu_check.sh: unknown argument '$arg' (--dry-run, --fetch-wheels)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
# Per-step limits, seconds (sum 470 s: the 8-minute budget with room for the start).
T_ENV=${GPU_CHECK_T_ENV:-15}
T_WHEELS=${GPU_CHECK_T_WHEELS:-20}
T_COMPILE=${GPU_CHECK_T_COMPILE:-45}
T_TESTS=${GPU_CHECK_T_TESTS:-60}
T_KERNELS=${GPU_CHECK_T_KERNELS:-90}
T_LOAD=${GPU_CHECK_T_LOAD:-25}
T_E2E=${GPU_CHECK_T_E2E:-45}        # each case; the first (with the memory step) gets 80
# The whole run's deadline: a step never gets more than what is left of it (each limit above is
# cut to the time left; a step with none left is not started and counts as failed).
T_TOTAL=${GPU_CHECK_T_TOTAL:-480}
E2E_CASES=${GPU_CHECK_E2E_CASES:-"qwen3-30b-a3b-bf16 qwen3-30b-a3b-int4 gpt-oss-20b-mxfp4 deepseek-v2-lite-bf16"}
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

# step NAME LIMIT CMD...: CMD under `timeout` (TERM, then KILL 5 s later, to its whole process
# group), output into the log; LIMIT is cut to what is left of T_TOTAL. A shell function runs as
# `bash -c NAME` (exported with export -f).
RUN_START=$(date +%s)
step() {
    local name=$1 limit=$2 start rc left
    shift 2
    left=$((T_TOTAL - ($(date +%s) - RUN_START) - 5))
    if [ "$left" -lt 5 ]; then
        say "=== $name: NOT STARTED (the run's ${T_TOTAL} s are spent)"
        STEPS+=("$name|skipped: no time left|0")
        LAST_RC=124 FAILED=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "=== $name (timeout ${limit} s): $*"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
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
# the engine imports these; without them every later step would fail one by one
if [ "$MODE" = gpu ] && ! "$PY" -c "import msgspec, zmq, grpc" 2>>"$LOG"; then
    say "msgspec / pyzmq / grpcio missing: run bench/gpu_check.sh --fetch-wheels where a registry" \
        "is reachable and carry .whl/ here; stopping"
    exit 2
fi

# the compile check never runs under the interpreter (it compiles for a GPU target: sm_90,
# H100/H200, with the Triton installed there; the quick set is 160 variants, ~280 CPU-seconds
# cold on this project's CPU machine, spread over every core). The dry run compiles
# tests/test_gpu_compile.py's subset only (Qwen3-30B-A3B's int4 decode tiles and split decode
# with its merge: 4 variants), enough to prove the step runs.
if [ "$MODE" = dry ]; then
    step compile "$T_COMPILE" env TRITON_INTERPRET=0 "$PY" bench/gpu_compile.py --quick \
        --arch sm_90 --jobs 2 --family Qwen3-30B-A3B --tokens 4 --op fused_moe \
        --op attention_decode --quant int4-g128-fp32 --dtype bf16 --json "$OUT/gpu_compile.json"
else
    step compile "$T_COMPILE" env TRITON_INTERPRET=0 "$PY" bench/gpu_compile.py --quick \
        --arch sm_90 --jobs "$(nproc)" --json "$OUT/gpu_compile.json"
fi

# the gpu-marked tests: the kernels and the engine on CUDA (tests/test_gpu.py), graph pool in the
# plan, warm-up before the first request, graphs vs --enforce-eager, the fixed all-to-all with no
# host sync, --device cuda startup
step gpu-tests "$T_TESTS" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
    tests/test_gpu.py tests/test_cuda_graphs.py tests/test_comm.py tests/test_device.py

if [ "$MODE" = dry ]; then
    step kernels "$T_KERNELS" "$PY" bench/gpu_kernels.py --dry-run --out "$OUT"
else
    step kernels "$T_KERNELS" "$PY" bench/gpu_kernels.py --out "$OUT"
fi

# host memory while the model loads straight onto the device (built on meta): peak RSS of a
# ~470 MB checkpoint's load, printed by bench/load_rss.py (not a dry run: --device cuda)
load_rss() {
    local ck=/tmp/gpu_check_load_rss
    if [ "$MODE" = dry ]; then  # the CPU load is tests/test_meta_loading.py's; here the CLI only
        "$PY" bench/load_rss.py --help >/dev/null &&
            echo "would run: $PY bench/load_rss.py --make $ck; ... --load $ck --device cuda"
        return
    fi
    [ -f "$ck/config.json" ] || "$PY" bench/load_rss.py --make "$ck" || return 1
    "$PY" bench/load_rss.py --load "$ck" --device cuda
}
export -f load_rss
step load-rss "$T_LOAD" bash -c load_rss

E2E_FLAGS="--out $OUT --workdir ${GPU_CHECK_WORKDIR:-/tmp/gpu_check_e2e}"
if [ "$MODE" = dry ]; then
    step e2e-plan "$T_ENV" "$PY" bench/gpu_e2e.py --plan
    E2E_FLAGS="$E2E_FLAGS --dry-run"
fi
limit=$((T_E2E + 35))  # the first case also makes its checkpoint and runs the memory step
for case in $E2E_CASES; do
    # shellcheck disable=SC2086  # the flags are words
    step "e2e-$case" "$limit" "$PY" bench/gpu_e2e.py --case "$case" $E2E_FLAGS
    limit=$T_E2E
done

"$PY" - "$OUT" "$MODE" "$E2E_CASES" "${STEPS[@]}" <<'EOF' | tee -a "$LOG"
import json, re, sys
from pathlib import Path
out, mode, cases, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4:]
lines = ["# bench/gpu_check.sh summary" + (" (DRY RUN on the CPU: no GPU figures)" if mode == "dry"
                                          else ""), "", "| step | rc | seconds |", "|---|---:|---:|"]
lines += [f"| {s.split('|')[0]} | {s.split('|')[1]} | {s.split('|')[2]} |" for s in steps]
comp = out / "gpu_compile.json"
if comp.is_file():
    c = json.loads(comp.read_text())
    kernels_ = c["summary"]["per_kernel"]
    lines += ["", f"compile ({c['arch']}, Triton {c['triton']}): {c['summary']['variants']} "
              f"variants, {len(c['failures'])} problems, max shared "
              f"{max((k['max_shared'] for k in kernels_.values()), default=0):,} B, "
              f"{sum(k['spilling'] for k in kernels_.values())} spilling, in {c['seconds']} s"]
    lines += [f"  FAIL: {m}" for m in c["failures"]]
log = (out / "gpu_check.log").read_text()
if "=== gpu-tests (" in log:
    section = log.split("=== gpu-tests (")[-1].split("=== gpu-tests:")[0]
    final = re.findall(r"^(\d+ (?:passed|failed|skipped|deselected|error).* in [\d.]+s.*)$",
                       section, re.M)
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", section, re.M)
    lines += ["", "gpu tests: " + (final[-1] if final else "no pytest summary line")]
    lines += [f"  skipped: {s_}" for s_ in skips]
kernels = out / "gpu_kernels.md"
lines += ["", "## Kernels (checked against float64, then timed)", "",
          kernels.read_text() if kernels.is_file() else "(no table)"]
lines += ["## End to end (random-weight 3-layer cuts)", "",
          "| case | fp32 = transformers | graphs = eager | bf16 agreement | step ms b1/b8/b64 "
          "| % of roofline b1/b8/b64 | kernels/step | memory | ok |",
          "|---|---|---|---|---|---|---:|---|---|"]
for case in cases:
    f = out / f"e2e-{case}.json"
    if not f.is_file():
        lines.append(f"| {case} | - | - | - | - | - | - | - | FAILED: no result (timed out or "
                     f"crashed before its first part; see gpu_check.log) |")
        continue
    r = json.loads(f.read_text())
    steps_ = r.get("steps") or []
    ms = "/".join(f"{x['step_ms']:.2f}" for x in steps_) or "-"
    pct = "/".join(f"{x['pct_of_roofline']}" for x in steps_) or "-"
    agree = r.get("agreement_vs_fp32_transformers") or {}
    mem = r.get("memory") or {}
    memory = (f"{mem['used_gib']}/{mem['total_gib']} GiB after {mem['max_model_len']} tokens"
              if "used_gib" in mem else "-")
    errors = "; ".join(f"{k}: {v[:80]}" for k, v in (r.get("errors") or {}).items())
    lines.append(f"| {r['case']} | {r.get('fp32_exact', 'n/a')} | {r.get('graphs_equal_eager')} "
                 f"| {agree.get('identical', '-')}/{agree.get('requests', '-')} | {ms} | {pct} "
                 f"| {r.get('kernels_per_decode_step') or '-'} | {memory} "
                 f"| {'ok' if r.get('ok') else 'FAILED ' + ('(stopped part-way) ' if r.get('partial') else '') + errors} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { say "=== summary: FAILED (no summary.md)"; FAILED=1; }
say "=== gpu_check.sh: $([ $FAILED = 0 ] && echo 'all steps passed' || echo 'some step FAILED'); outputs in $OUT"
exit $FAILED
