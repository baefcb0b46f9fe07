#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize from the sources vendored in the
# llama-cpp-python sdist (PyPI), once, into .cache/llama.cpp/bin/. llama-server is the peer
# for bench/replay.py and bench/engine.py; llama-quantize makes the K-quant GGUF files the
# tests and bench/engine.py use (bench/gguf_quants.py).
#   bench/llama_cpp.sh            build unless the binaries are already there
#   bench/llama_cpp.sh --force    rebuild
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.cache/llama.cpp"
BIN="$CACHE/bin/llama-server"
QUANTIZE="$CACHE/bin/llama-quantize"
PIP="${PIP:-$ROOT/.venv/bin/pip}"

if [[ -x "$BIN" && -x "$QUANTIZE" && "${1:-}" != "--force" ]]; then
    echo "llama-server and llama-quantize already built: $BIN $QUANTIZE"
    exit 0
fi

mkdir -p "$CACHE/sdist" "$CACHE/bin"
if ! ls "$CACHE/sdist"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
    "$PIP" download --no-binary :all: --no-deps --dest "$CACHE/sdist" "llama-cpp-python==$VERSION"
fi
rm -rf "$CACHE/src"
mkdir -p "$CACHE/src"
tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src" --strip-components=1

# Tuned for this CPU (GGML_NATIVE), except on CPUs with AMX: this version's AMX matmul crashes
# (SIGSEGV in ggml_backend_amx_mul_mat at the first request), so there the build names the
# AVX-512 extensions itself and leaves AMX out, rather than running with --no-repack.
CPU_FLAGS=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo; then
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
               -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
               -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    echo "AMX CPU: building with AVX-512 and without the AMX path"
fi
cmake -S "$CACHE/src/vendor/llama.cpp" -B "$CACHE/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON "${CPU_FLAGS[@]}" \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$CACHE/build" --target llama-server llama-quantize -j "$(nproc)"
cp "$CACHE/build/bin/llama-server" "$BIN"
cp "$CACHE/build/bin/llama-quantize" "$QUANTIZE"
"$BIN" --version 2>&1 | head -n 2 || true
echo "built $BIN $QUANTIZE"
