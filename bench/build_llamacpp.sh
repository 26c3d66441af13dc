#!/usr/bin/env bash
# Build llama.cpp (CPU) for the baseline benchmarks, outside the repo.
#
#   bench/build_llamacpp.sh            # prints the bin dir on its last line
#   BIN=$(bench/build_llamacpp.sh | tail -1)
#   OPENMP=off bench/build_llamacpp.sh  # llama-server alone, built without OpenMP
#                                       # (ggml's own thread pool) in build-noomp: for
#                                       # default_vs_llamaserver.py --also no-openmp=DIR
#
# Source comes from the llama-cpp-python sdist on PyPI (it vendors llama.cpp),
# so no git or other network access is needed. Everything goes under
# ${TOKENFLEET_LLAMACPP_DIR:-$HOME/.cache/tokenfleet/llama.cpp}. Idempotent:
# exits at once when the binaries are already there. ~10 min on 2 cores; a tool
# added to TOOLS later is built incrementally (a minute or two) on the next call.
set -euo pipefail

VERSION=0.3.36   # llama-cpp-python version -> vendored ggml-org/llama.cpp@0c1e57098
ROOT=${TOKENFLEET_LLAMACPP_DIR:-$HOME/.cache/tokenfleet/llama.cpp}
SRC=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$ROOT/build
BIN=$BUILD/bin
STAMP=$BUILD/.tokenfleet-built  # lists the tools this llama.cpp does not have
# llama-quantize / llama-perplexity: bench/vs_llamacpp.py (Q8_0 / F32 files, perplexity)
TOOLS=(llama-server llama-batched-bench llama-cli llama-bench llama-quantize llama-perplexity)
FLAGS=()
if [[ ${OPENMP:-on} == off ]]; then
  BUILD=$ROOT/build-noomp BIN=$ROOT/build-noomp/bin STAMP=$ROOT/build-noomp/.tokenfleet-built
  TOOLS=(llama-server) FLAGS=(-DGGML_OPENMP=OFF)
fi

# 0. Already built (every tool there, or known to be missing from this source)? Done.
built() {
  [[ -f $STAMP ]] || return 1
  local t
  for t in "${TOOLS[@]}"; do
    [[ -x $BIN/$t ]] || grep -qx "skipped $t" "$STAMP" || return 1
  done
}
if built; then
  echo "$BIN"; exit 0
fi
mkdir -p "$ROOT"

# 1-2. Source: the llama-cpp-python sdist from PyPI (it vendors llama.cpp), unpacked once
#      and patched for gcc 12's AMX miscompile (scripts/llama_cpp_python.sh says how).
"$(dirname "$0")/../scripts/llama_cpp_python.sh" source >/dev/null

# 3. Tools: use system cmake/ninja, else pip-install them into a throwaway venv.
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  python3 -m venv "$ROOT/tools-venv"
  "$ROOT/tools-venv/bin/pip" install -q cmake ninja
  export PATH=$ROOT/tools-venv/bin:$PATH
fi

# 4. Configure + build (niced so other work on the box keeps going).
#    No embedded web UI (it would be downloaded from HF); commit id taken from
#    the sdist changelog since there is no .git.
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 "${FLAGS[@]}"
available=$(cmake --build "$BUILD" --target help)
targets=()
skipped=()
for t in "${TOOLS[@]}"; do
  if grep -q "^$t:" <<<"$available"; then targets+=("$t")
  else skipped+=("skipped $t"); echo "note: target $t does not exist in this llama.cpp, skipped" >&2; fi
done
nice -n 19 cmake --build "$BUILD" --target "${targets[@]}" -j "$(nproc)"
printf '%s\n' "${skipped[@]}" >"$STAMP"

echo "$BIN"
