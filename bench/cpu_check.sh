#!/usr/bin/env bash
# The CPU checks of issues 25 and 26 in one command, for a session that lands on a CPU
# whose figures are missing or stale (the Xeon AMX's tick run; Zen 5's, first run 2026-12-07):
#
#   bash bench/cpu_check.sh [--only STEPS] [--rounds N]
#
# STEPS, a comma list (default: all, in this order):
#   tests    the tests of what differs by CPU: the int4/int8 kernels, the native decode
#            stack, the deterministic mode, the llama.cpp runner (its AMX repacking and
#            thread pool where the CPU has AMX)                                 ~6 min
#   ticks    issue 25 part 2: the decode tick outside the matmuls, native stack and
#            compiled graph in turn (bench/tick_profile.py, 3 rounds x 12 ticks) ~4 min
#   speed    issues 25 part 1 and 26: through Redis against llama-server Q4_1 and Q8_0,
#            the default start, the compiled graph, --quant int8 and the llama.cpp
#            runner, as started and with the flags that served it best on the Zen 4
#            (--kv-streams 16 --stream-interval-ms 30), in one run
#            (bench/default_vs_llamaserver.py)                                  ~7 min
#   quality  issue 25 part 1: perplexity against fp32, default and --quant int8, over
#            bench/data's six texts with each gap's standard error
#            (bench/default_quality.py --int8 --texts all)                     ~9 min
#
# Needs `make venv`, `make llamacpp` and `bash bench/build_llamacpp.sh` done (the last two
# build llama.cpp, ~15 min on 2 cores the first time); don't run it beside a build or CI:
# the figures are only as good as the machine is quiet. Each step records the load before
# it. Results: bench/results-<bench>-<cpu>-<date>[-runN].json (and .png where the program
# plots; -runN when the day has that name already), the CPU named as docs/benchmarks.md
# names machines (xeon-amx, zen5, zen4, zen3, or family and model); the log of every step
# in bench/out/cpu_check/<cpu>-<date>/.
set -euo pipefail
cd "$(dirname "$0")/.."

only="tests,ticks,speed,quality"
rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    *) echo "cpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done

PY=.venv/bin/python
[ -x "$PY" ] || { echo "cpu_check: no .venv here: run make venv first" >&2; exit 2; }

# the machine's name, as docs/benchmarks.md's machine list has them
field() { lscpu | sed -n "s/^$1:[[:space:]]*//p" | head -1; }
vendor=$(field "Vendor ID"); family=$(field "CPU family"); model=$(field "Model")
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]]; }
if [ "$vendor" = "GenuineIntel" ]; then
  if has amx_tile; then cpu=xeon-amx; else cpu=xeon; fi
elif [ "$family" = "26" ]; then cpu=zen5
elif [ "$family" = "25" ] && has avx512f; then cpu=zen4
elif [ "$family" = "25" ]; then cpu=zen3
else cpu="cpu-f${family}m${model}"
fi
date=$(date -u +%F)
logs="bench/out/cpu_check/$cpu-$date"
mkdir -p "$logs"
echo "cpu_check: $cpu ($(field 'Model name'), family $family model $model, $(nproc) cores)"
echo "cpu_check: flags: $(for f in amx_tile amx_int8 amx_bf16 avx512f avx512_vnni avx512_bf16 avx_vnni avx2; do has "$f" && printf '%s ' "$f"; done)"
lscpu > "$logs/lscpu.txt"

# a results name no earlier file has (a second check the same day gets -run2, ...)
fresh() {
  local base="bench/results-$1-$cpu-$date" name n=2
  name="$base"
  while compgen -G "$name.*" > /dev/null; do name="$base-run$n"; n=$((n + 1)); done
  echo "$name"
}

failed=()
step() {  # step NAME COMMAND...: run it with its output in the log, go on if it fails
  local name="$1"; shift
  case ",$only," in *",$name,"*) ;; *) return 0 ;; esac
  echo "cpu_check: $name (load $(cut -d' ' -f1-3 /proc/loadavg)): $*"
  local t0=$SECONDS
  if "$@" > "$logs/$name.log" 2>&1; then
    echo "cpu_check: $name passed in $((SECONDS - t0)) s"
  else
    echo "cpu_check: $name FAILED in $((SECONDS - t0)) s; the tail of $logs/$name.log:"
    tail -20 "$logs/$name.log"
    failed+=("$name")
  fi
}

step tests "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_q4_vnni.py tests/test_int8_vnni.py tests/test_native_decode.py \
  tests/test_engine_plan.py tests/test_deterministic.py tests/test_llamacpp_runner.py
ticks=$(fresh tick-profile)
step ticks "$PY" bench/tick_profile.py --decode native,graph --rounds "$rounds" --ticks 12 \
  --out "$ticks.json" --plot "$ticks.png"
speed=$(fresh default-vs-llamaserver)
step speed "$PY" bench/default_vs_llamaserver.py \
  --variants 'default=,graph=TOKENFLEET_NATIVE_DECODE=0,int8=--quant int8,llamacpp=--runner llamacpp,llamacpp-tuned=--runner llamacpp --kv-streams 16 --stream-interval-ms 30' \
  --theirs q4_1,q8_0 --rounds "$rounds" \
  --out "$speed.json" --plot "$speed.png"
quality=$(fresh default-quality-int8-alltexts)
step quality "$PY" bench/default_quality.py --int8 --texts all --out "$quality.json"

if [ ${#failed[@]} -gt 0 ]; then
  echo "cpu_check: failed: ${failed[*]} (logs in $logs)"
  exit 1
fi
echo "cpu_check: done; results $ticks.*, $speed.*, $quality.json; logs in $logs"
