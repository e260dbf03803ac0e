#!/usr/bin/env bash
# Build llama.cpp from the llama-cpp-python sdist, for `bench/throughput.py --baseline llamacpp`.
#
# Everything lands in one throwaway folder (default bench/.venvs/llamacpp, git-ignored):
#   src/    the `llama-cpp-python==0.3.36` sdist (`pip download --no-binary :all: --no-deps`),
#           unpacked; its vendor/llama.cpp is the llama.cpp that is built and benchmarked, and
#           its convert_hf_to_gguf.py + gguf-py make the GGUFs (bench/llamacpp_gguf.py);
#   build/  CMake + Ninja build of vendor/llama.cpp as SHARED libraries only (libllama.so,
#           libggml*.so in build/bin; no server, tools, examples or tests), Release,
#           GGML_NATIVE=ON so ggml-cpu is compiled for this CPU (-march=native: AVX-512, VNNI,
#           BF16 and AMX where the CPU has them); the flags are written to build/cmake-flags.txt
#           and the features the library reports to build/system-info.txt. One line of the
#           vendored AMX kernel is fixed first (step 2: GCC 12 miscompiles its tile setup);
#   venv/   a venv with the llama-cpp-python package installed from the same sdist WITHOUT its
#           own native build (CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"), so its ctypes
#           bindings (`llama_cpp.llama_cpp`, the low-level API) load the library built above
#           through LLAMA_CPP_LIB_PATH=build/bin (the package's documented override; the
#           runner sets it from --lib-dir). Bindings and library come from one sdist, so the
#           ctypes structs match the headers.
# Quantized GGUFs (Q8_0, Q4_0) are made by `llama_model_quantize` of that library, so no
# llama-quantize binary is built. Each step prints what it does; rerunning skips what is done;
# `--force` starts from scratch.
#
#   bash bench/setup_llamacpp.sh                   # folder bench/.venvs/llamacpp
#   LLAMACPP_DIR=/elsewhere bash bench/setup_llamacpp.sh
#
# Needs: python3 >= 3.10 with venv, cmake >= 3.21, ninja (or make), a C/C++17 compiler, network
# access to PyPI (76 MB sdist; numpy, diskcache, jinja2, typing-extensions, scikit-build-core).
# Building took 3 min 15 s on the project's 2 cores. Exits non-zero when a step fails.
set -euo pipefail

usage() {
    sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'
    echo "options: --force (remove the folder first)"
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${LLAMACPP_DIR:-$here/.venvs/llamacpp}"
python="${PYTHON:-python3}"
version="0.3.36"
force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup_llamacpp: unknown option $arg" >&2; usage >&2; exit 2 ;;
    esac
done

say() { echo "[setup_llamacpp] $*"; }

if [[ $force == 1 && -d "$root" ]]; then
    say "--force: removing $root"
    rm -rf "$root"
fi
mkdir -p "$root/src"

# 1. The sdist, unpacked.
src="$root/src/llama_cpp_python-$version"
if [[ -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
    say "sdist unpacked: $src"
else
    tarball="$root/src/llama_cpp_python-$version.tar.gz"
    if [[ ! -f "$tarball" ]]; then
        say "pip download --no-binary :all: --no-deps llama-cpp-python==$version"
        "$python" -m pip download -q --no-binary :all: --no-deps -d "$root/src" \
            "llama-cpp-python==$version"
    fi
    say "unpacking $tarball"
    tar -xzf "$tarball" -C "$root/src"
fi
say "vendored llama.cpp: $(git -C "$src/vendor/llama.cpp" log -1 --format='%h %cs' 2>/dev/null \
    || echo 'no git metadata')"

# 2. A one-line fix to the vendored AMX kernel (upstream llama.cpp PR #26954, open): GCC 12
# drops the stores that fill the on-stack tile configuration before `_tile_loadconfig`, so every
# AMX matmul (Q4_0 / Q8_0 weights, batches of 32+ rows) dies with SIGILL on `tileloadd`. An empty
# asm statement that takes the config's address keeps the stores; the code is otherwise unchanged.
mmq="$src/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
marker="setup_llamacpp.sh: keep the tile config stores"
if grep -q "$marker" "$mmq"; then
    say "AMX tile-config fix already applied"
elif grep -q '^    _tile_loadconfig(&tc);$' "$mmq"; then
    say "applying the AMX tile-config fix to $mmq"
    sed -i "s|^    _tile_loadconfig(&tc);\$|    __asm__ __volatile__(\"\" : : \"r\"(\&tc) : \"memory\");  // $marker\n    _tile_loadconfig(\&tc);|" "$mmq"
    grep -q "$marker" "$mmq" || { say "ERROR: the AMX fix did not apply" >&2; exit 1; }
else
    say "ERROR: $mmq has no '_tile_loadconfig(&tc);' line to fix" >&2
    exit 1
fi

# 3. The shared library (ninja rebuilds only what changed).
build="$root/build"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=ON
    -DGGML_NATIVE=ON
    -DGGML_OPENMP=ON
    -DLLAMA_BUILD_COMMON=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
)
if [[ -f "$build/CMakeCache.txt" && -f "$build/cmake-flags.txt" \
      && "$(cat "$build/cmake-flags.txt")" == "${flags[*]}" ]]; then
    say "configured: $build (flags in $build/cmake-flags.txt)"
else
    say "cmake ${generator[*]} ${flags[*]}"
    cmake -S "$src/vendor/llama.cpp" -B "$build" "${generator[@]}" "${flags[@]}" >"$build.log" 2>&1 \
        || { tail -40 "$build.log" >&2; exit 1; }
    echo "${flags[*]}" > "$build/cmake-flags.txt"
fi
say "cmake --build $build --target llama (log $build.log)"
cmake --build "$build" --target llama -j "$(nproc)" >>"$build.log" 2>&1 \
    || { tail -40 "$build.log" >&2; exit 1; }
say "libraries: $(cd "$build/bin" && ls ./*.so | tr '\n' ' ')"

# 4. The python bindings, without a second native build.
venv="$root/venv"
if [[ ! -x "$venv/bin/python" ]]; then
    say "creating venv: $python -m venv $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi
vpy="$venv/bin/python"
have="$("$vpy" -m pip show llama_cpp_python 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$have" == "$version" ]]; then
    say "llama_cpp_python $have already installed"
else
    say "pip install $src with CMAKE_ARGS=-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF (bindings only)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$vpy" -m pip install -q "$src"
fi

# 5. Check: the bindings load the library built above and see this CPU's features.
say "checking the bindings"
LLAMA_CPP_LIB_PATH="$build/bin" "$vpy" -c '
import llama_cpp, llama_cpp.llama_cpp as ll
info = ll.llama_print_system_info().decode()
print(f"[setup_llamacpp] llama_cpp_python {llama_cpp.__version__}, library {ll._lib._name}")
print(f"[setup_llamacpp] system info: {info}")
' | tee "$build/system-info.txt"
say "done: $vpy (LLAMA_CPP_LIB_PATH=$build/bin)"
