#!/usr/bin/env bash
# llama.cpp's inference server (llama-server), built once from the llama.cpp sources that
# the llama-cpp-python release on PyPI carries; prints the binary's path.
#
#   infra/llama-server.sh            build if needed, print infra/llama.cpp/bin/llama-server
#
# rlstream's producers can sample with it (rlstream produce --policy openai:URL), and the
# tests of that path run against it. The build is optimized for build time, not speed
# (-O0): the tests serve a model of a few hundred thousand parameters. For real use, build
# llama.cpp as its own documentation says, or set LLAMA_SERVER_CFLAGS=-O3.
# Needs a C++17 compiler and CMake 3.18+ (apt-get install g++ cmake).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="0.3.36"   # llama-cpp-python's release, and with it the llama.cpp it vendors
out="$root/infra/llama.cpp"
bin="$out/bin/llama-server"
stamp="$out/bin/.built-from-$version"
python="${PYTHON:-python3}"
if [ -x "$bin" ] && [ -f "$stamp" ]; then
  echo "$bin"
  exit 0
fi
command -v cmake >/dev/null || { echo "rlstream: CMake is needed to build llama-server (apt-get install cmake)" >&2; exit 2; }
command -v c++ >/dev/null || { echo "rlstream: a C++ compiler is needed to build llama-server (apt-get install g++)" >&2; exit 2; }
work="$out/build-$version"
mkdir -p "$work"
if [ ! -f "$work/src/CMakeLists.txt" ]; then
  echo "== fetching llama.cpp (the sources of llama-cpp-python $version, from PyPI)" >&2
  "$python" -m pip download -q --no-deps --no-binary :all: -d "$work/dl" "llama-cpp-python==$version" >&2
  tar -xzf "$work/dl/llama_cpp_python-$version.tar.gz" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
  rm -rf "$work/src"
  mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$work/src"
  rm -rf "$work/dl" "$work/llama_cpp_python-$version"
fi
flags="${LLAMA_SERVER_CFLAGS:--O0 -g0}"
echo "== building llama-server (a few minutes)" >&2
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log" 2>&1 \
  || { tail -20 "$work/configure.log" >&2; exit 2; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log" >&2; exit 2; }
mkdir -p "$out/bin"
cp "$work/build/bin/llama-server" "$bin"
rm -rf "$work"
touch "$stamp"
echo "$bin"
