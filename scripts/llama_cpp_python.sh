#!/usr/bin/env bash
# llama-cpp-python from its PyPI sdist (the only form PyPI has), patched, and built once
# per machine for `--runner llamacpp`.
#
#   scripts/llama_cpp_python.sh source      # unpack + patch; prints the package's source dir
#   scripts/llama_cpp_python.sh wheel PIP   # + a wheel for this CPU, built with PIP once
#                                           # and kept; prints the wheel's path
#
# The patch: gcc 12 drops the stores that fill the AMX tile config before
# `_tile_loadconfig(&tc)` in ggml-cpu/amx/mmq.cpp, so on a CPU with AMX llama.cpp's
# repacked weights crash (SIGILL in llama-server; the segfault in the first decode seen
# through the Python bindings, llama.cpp#20824, is taken to be the same: with the patch
# it is gone). A compiler barrier before each load keeps the stores (the
# cause upstream PR #26954 fixes). The patched package is versioned `0.3.36+tokenfleet.amx`
# (a local label: `llama-cpp-python==0.3.36` still matches it), which is how the runner
# knows it may keep llama.cpp's AMX weight repacking on.
#
# Built without OpenMP (GGML_OPENMP=OFF): OpenMP's threads spin after every tick while
# the worker sends the tick's Redis round trip, and redis-server and the clients then
# find both cores of a small machine taken. Without it the runner computes on a ggml
# thread pool of its own whose threads sleep between ticks (LlamaCppRunner's ThreadPool):
# on an EPYC Zen 4, ahead of the OpenMP build in 9 of 12 workloads over four bench runs,
# by 3 % on average (docs/benchmarks.md). llama-server (bench/build_llamacpp.sh) keeps
# llama.cpp's default.
#
# Everything lives under ${TOKENFLEET_LLAMACPP_DIR:-$HOME/.cache/tokenfleet/llama.cpp},
# shared with bench/build_llamacpp.sh (llama-server from the same source). The wheel is
# built with -march=native, so it is kept per CPU (flags, model name and compiler hashed):
# another venv on this machine installs it at once, another CPU builds its own.
set -euo pipefail

VERSION=0.3.36   # vendors ggml-org/llama.cpp@0c1e57098
LABEL=tokenfleet.amx
ROOT=${TOKENFLEET_LLAMACPP_DIR:-$HOME/.cache/tokenfleet/llama.cpp}
PKG=$ROOT/llama_cpp_python-$VERSION
MMQ=$PKG/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp
BARRIER='asm volatile("" : : "r"(&tc) : "memory");'

source_dir() {
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.source.lock"
  flock 9
  if [[ ! -f $PKG/CMakeLists.txt ]]; then
    python3 -m pip download -q --no-deps --no-binary :all: \
      "llama-cpp-python==$VERSION" -d "$ROOT"
    tar -xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
  fi
  if ! grep -qF "$BARRIER" "$MMQ"; then
    sed -i 's|^\([[:space:]]*\)_tile_loadconfig(&tc);|\1asm volatile("" : : "r"(\&tc) : "memory");\n\1_tile_loadconfig(\&tc);|' "$MMQ"
  fi
  local n_load n_barrier
  n_load=$(grep -c '_tile_loadconfig(&tc);' "$MMQ")
  n_barrier=$(grep -cF "$BARRIER" "$MMQ")
  if [[ $n_load -eq 0 || $n_load -ne $n_barrier ]]; then
    echo "AMX barrier patch failed ($n_barrier barriers / $n_load loadconfig)" >&2
    exit 1
  fi
  sed -i "s|^__version__ = \"$VERSION\"\$|__version__ = \"$VERSION+$LABEL\"|" "$PKG/llama_cpp/__init__.py"
  grep -q "^__version__ = \"$VERSION+$LABEL\"\$" "$PKG/llama_cpp/__init__.py" || {
    echo "could not label the version in $PKG/llama_cpp/__init__.py" >&2
    exit 1
  }
  flock -u 9
}

wheel() {
  local pip=$1 key out found
  local cmake_args="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=OFF"
  key=$({
    echo "$VERSION+$LABEL $cmake_args"
    grep -m1 '^flags' /proc/cpuinfo || true
    grep -m1 '^model name' /proc/cpuinfo || true
    "${CXX:-g++}" --version 2>/dev/null | head -1 || true
  } | sha256sum | cut -c1-16)
  out=$ROOT/wheels/$key
  found=$(ls "$out"/llama_cpp_python-*.whl 2>/dev/null | head -1 || true)
  if [[ -z $found ]]; then
    source_dir
    mkdir -p "$out"
    # no multimodal library (mtmd/llava): the runner does not use it; no OpenMP (above)
    CMAKE_ARGS="$cmake_args" nice -n 10 \
      "$pip" wheel -q --no-deps "$PKG" -w "$out.tmp" >&2
    mv "$out.tmp"/llama_cpp_python-*.whl "$out"/
    rm -rf "$out.tmp"
    found=$(ls "$out"/llama_cpp_python-*.whl | head -1)
  fi
  echo "$found"
}

case ${1:-} in
  source) source_dir; echo "$PKG" ;;
  wheel) wheel "${2:?usage: $0 wheel PIP}" ;;
  *) echo "usage: $0 source | wheel PIP" >&2; exit 2 ;;
esac
