"""Speed that survives a neighbour: the engine's decode throughput alone on the cores and
beside one CPU-bound process, per thread setting.

Usage: python bench/neighbour.py [--rounds 3] [--settings 'NAME|NAME']
           [--out bench/out/neighbour.json]

Each measurement is a fresh child process (thread and OpenMP settings apply at start)
that loads SmolLM2-135M-Instruct (dtype auto), decodes 8 streams x 64 tokens through
the in-process Engine, and reports useful tok/s. The neighbour is a second process
spinning one core in pure Python, started before the child and killed after it.
Settings are interleaved per round (quiet, busy, quiet, busy ...), and the verdict is
each setting's median busy / quiet ratio (target >= 0.4: a worker that keeps at least
about half its cores should keep at least 0.4 of its speed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from _rounds import abba
from report import Run, load_now, outputs, parser

SETTINGS: dict[str, dict[str, str]] = {
    "2 threads, OpenMP default": {"OMP_NUM_THREADS": "2"},
    "2 threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "2 threads, GOMP_SPINCOUNT=10000": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},
    "2 threads, GOMP_SPINCOUNT=100000": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "100000"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    # what `tokenfleet worker` does unless --threads is given: start at one thread per
    # core and follow the cores other processes leave free (worker/threads.py)
    "2 threads, governed (worker default)": {"OMP_NUM_THREADS": "2", "BENCH_GOVERNOR": "1"},
    # the same on `--runner llamacpp` (SmolLM2's GGUF on llama.cpp's kernels; torch samples
    # on one thread): its own threads fixed at 2, or governed as the worker does
    # (256 tokens a stream: llama.cpp decodes faster, and a run must outlast the
    # governor's 2 s window to show what it does)
    "llama.cpp, 2 threads": {"BENCH_RUNNER": "llamacpp", "BENCH_TOKENS": "256"},
    "llama.cpp, 1 thread": {
        "BENCH_RUNNER": "llamacpp",
        "BENCH_THREADS": "1",
        "BENCH_TOKENS": "256",
    },
    "llama.cpp, 2 threads, governed (worker default)": {
        "BENCH_RUNNER": "llamacpp",
        "BENCH_GOVERNOR": "1",
        "BENCH_TOKENS": "256",
    },
}

CHILD = r"""
import json, os, sys, time, torch
from tokenfleet.model import load_model
from tokenfleet.worker.threads import ThreadGovernor
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import Engine, EngineConfig
governor = None
if os.environ.get("BENCH_RUNNER") == "llamacpp":
    from tokenfleet.model.llamacpp_runner import LlamaCppOptions, LlamaCppRunner
    from tokenfleet.model.smollm2 import smollm2_gguf_path
    torch.set_num_threads(1)
    loaded = LlamaCppRunner(smollm2_gguf_path(), LlamaCppOptions(
        kv_budget_bytes=256 * 2**20, block_size=16, max_sequences=8, max_tick_tokens=8 + 512,
        threads=int(os.environ.get("BENCH_THREADS", "2"))))
    if os.environ.get("BENCH_GOVERNOR"):
        governor = ThreadGovernor.for_this_process(lambda: loaded.threads, loaded.set_threads)
    threads = lambda: loaded.threads
else:
    loaded = load_model("smollm2-135m-instruct", dtype="auto", device="cpu")
    if os.environ.get("BENCH_GOVERNOR"):
        governor = ThreadGovernor.for_this_process(torch.get_num_threads, torch.set_num_threads)
    threads = torch.get_num_threads
def run():
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=256 * 2**20), threads=governor)
    for i in range(8):
        eng.submit(GenerationRequest(job_id=f"j{i}", prompt_ids=[1 + i, 20, 30, 40] * 8,
                                     max_new_tokens=int(os.environ.get("BENCH_TOKENS", "64")),
                                     ignore_eos=True))
    t, n = time.perf_counter(), 0
    while eng.has_work:
        n += len(eng.step().tokens)
    return n / (time.perf_counter() - t)
run()  # warm-up
tok_s = run()
info = governor.telemetry() if governor is not None else {}
print(json.dumps({"tok_s": tok_s, "threads": threads(), "governor": info}))
"""

SPIN = "while True: pass"


def measure(env: dict[str, str], busy: bool) -> dict[str, Any]:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["load"] = load_now()
    return result


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    outputs(p, "neighbour", plot=False)
    p.add_argument("--settings", default="|".join(SETTINGS), help="names, |-separated")
    args = p.parse_args()
    run = Run()
    chosen = {name: SETTINGS[name] for name in args.settings.split("|")}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"quiet": [], "busy": []} for name in chosen
    }
    for r in range(args.rounds):
        for name, env in chosen.items():
            for busy in abba((False, True), r):
                got = measure(env, busy)
                runs[name]["busy" if busy else "quiet"].append(got)
                print(
                    f"round {r} {name:38s} {'busy ' if busy else 'quiet'} {got['tok_s']:7.1f}"
                    f" threads {got['threads']} {got.get('governor') or ''}"
                )
    summary = {}
    for name, both in runs.items():
        quiet = statistics.median(x["tok_s"] for x in both["quiet"])
        busy = statistics.median(x["tok_s"] for x in both["busy"])
        summary[name] = {"quiet_tok_s": quiet, "busy_tok_s": busy, "ratio": busy / quiet}
        print(f"{name:38s} quiet {quiet:7.1f}  busy {busy:7.1f}  ratio {busy / quiet:.2f}")
    run.finish(args, run.report(settings=chosen, runs=runs, summary=summary))


if __name__ == "__main__":
    main()
