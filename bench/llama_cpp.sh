#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist
# (PyPI), once, into .cache/llama.cpp/bin/llama-server. The peer for bench/replay.py.
#   bench/llama_cpp.sh            build unless the binary is already there
#   bench/llama_cpp.sh --force    rebuild
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.cache/llama.cpp"
BIN="$CACHE/bin/llama-server"
PIP="${PIP:-$ROOT/.venv/bin/pip}"

if [[ -x "$BIN" && "${1:-}" != "--force" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi

mkdir -p "$CACHE/sdist" "$CACHE/bin"
if ! ls "$CACHE/sdist"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
    "$PIP" download --no-binary :all: --no-deps --dest "$CACHE/sdist" "llama-cpp-python==$VERSION"
fi
rm -rf "$CACHE/src"
mkdir -p "$CACHE/src"
tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src" --strip-components=1

cmake -S "$CACHE/src/vendor/llama.cpp" -B "$CACHE/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)"
cp "$CACHE/build/bin/llama-server" "$BIN"
"$BIN" --version 2>&1 | head -n 2 || true
echo "built $BIN"
