#!/usr/bin/env bash
# TTFT and TPOT (p50 / p99) of the same Poisson load, split against not split (issue 21).
#
#   bash bench/disagg_serve.sh [RATES...]        # default rates 2 4 (requests/s), 64 requests
#   SPLIT_PIN=1 bash bench/disagg_serve.sh       # prefill pinned to CPU 0, decode to CPU 1
#
# 1. not split: one `moe-serve` on the bench checkpoint;
# 2. split: `moe-serve --disaggregation-mode prefill` + `... decode` + `moe-router`;
# each driven by `bench/serve.py --request-rate RATES --num-requests 64 --long-prompts 0.125:768`
# (the mixed-64 distribution: prompts of 32-256 tokens, outputs of 16-256, with one request in
# eight on average given a 768-token prompt), all greedy. Every instance gets the
# same limits (--max-model-len 1024, --kv-cache-memory 1GiB). On a 2-core machine both split
# instances share the same two cores as the single one had, so the split cannot show its point
# (separate compute for prefill and decode) here: it measures the hand-off's cost. Reports go to
# $OUT (default /tmp/disagg_serve): single.json, split.json, and a summary on stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-/tmp/disagg_serve}"
rates=("${@:-2 4}")
read -r -a rates <<< "${rates[*]}"
ckpt="${MOE_ENGINE_CACHE:-$HOME/.cache/moe-engine}/bench-qwen3-moe"
mkdir -p "$out"
python3 - <<EOF
import sys; sys.path.insert(0, "$here")
from workload import ensure_bench_checkpoint
from pathlib import Path
ensure_bench_checkpoint(Path("$ckpt").parent)
EOF
flags=(--model "$ckpt" --max-model-len 1024 --kv-cache-memory 1GiB --log-level WARNING)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_up() { moe-client --server "$1" health --wait 300 > /dev/null; }

echo "[disagg_serve] not split: moe-serve on :50071"
moe-serve "${flags[@]}" --grpc-port 50071 --port 0 & pids+=($!)
wait_up 127.0.0.1:50071
python3 "$here/serve.py" --server 127.0.0.1:50071 --request-rate "${rates[@]}" \
    --num-requests 64 --long-prompts 0.125:768 --output "$out/single.json" > /dev/null
cleanup; pids=()

echo "[disagg_serve] split: prefill :50072, decode :50073, moe-router :50070" \
     "($([[ -n "${SPLIT_PIN:-}" ]] && echo "prefill on CPU 0, decode on CPU 1" || echo "both on every core"))"
pin_p=() pin_d=()  # SPLIT_PIN: one core each (the engine then runs one thread per instance)
if [[ -n "${SPLIT_PIN:-}" ]]; then pin_p=(taskset -c 0) pin_d=(taskset -c 1); fi
"${pin_p[@]}" moe-serve "${flags[@]}" --grpc-port 50072 --port 0 --disaggregation-mode prefill & pids+=($!)
"${pin_d[@]}" moe-serve "${flags[@]}" --grpc-port 50073 --port 0 --disaggregation-mode decode & pids+=($!)
wait_up 127.0.0.1:50072
wait_up 127.0.0.1:50073
moe-router --prefill 127.0.0.1:50072 --decode 127.0.0.1:50073 --grpc-port 50070 --port 0 \
    --log-level WARNING \
    & pids+=($!)
wait_up 127.0.0.1:50070
python3 "$here/serve.py" --server 127.0.0.1:50070 --request-rate "${rates[@]}" \
    --num-requests 64 --long-prompts 0.125:768 --output "$out/split.json" > /dev/null
cleanup; pids=()

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
print("| setup | rate (req/s) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | failures |")
print("|---|---|---|---|---|---|")
for name in ("single", "split"):
    report = json.load(open(f"{out}/{name}.json"))
    for run in report["runs"]:
        t, p = run["ttft_s"], run["tpot_s"]
        print(f"| {'not split' if name == 'single' else 'split'} | {run.get('request_rate')} | "
              f"{t['p50'] * 1e3:.0f} / {t['p99'] * 1e3:.0f} | {p['p50'] * 1e3:.1f} / "
              f"{p['p99'] * 1e3:.1f} | {run['output_throughput']:.0f} | {run['failures']} |")
EOF
