"""Two code trees side by side on the engine benchmark's mixed workload, in one run.

Usage: python bench/ab_engine.py --tree new=. --tree old=/tmp/old [--configs tiny,small]
                                 [--rounds 6] [--out bench/out/ab_engine.json]

For a refactor that must not change speed: one checkpoint per config (built once,
`bench/_common.py`), then rounds that alternate the trees in ABBA order. Each
(round, tree) is a fresh `python` with PYTHONPATH=<tree> that loads the checkpoint,
warms up on the same jobs, then times `--reps` runs of the 16 mixed jobs through
the public engine API alone (`Engine(load_model(...), EngineConfig(...))`, submit,
step until done), which every tree has. Reported per tree: min / median / max
tokens/s over all timed runs, the generated tokens' agreement across trees, and
the load average around each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import build_checkpoint, mixed_jobs
from report import loadavg, machine_info, mark_end, spread, write_report

# Runs under the tree's tokenfleet; argv: checkpoint folder, jobs JSON, reps.
ROUND = r"""
import json, sys, time
import torch
from tokenfleet.model import load_model
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import Engine, EngineConfig

folder, jobs, reps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]))
loaded = load_model(folder, dtype="float32", device="cpu")
cfg = loaded.config
per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
longest = max(len(p) + n for p, n in jobs) + 16
config = EngineConfig(
    kv_budget_bytes=max(16 << 20, 2 * per_token * longest * len(jobs)),
    max_batch_size=len(jobs), max_active=len(jobs), max_waiting=len(jobs),
)

def run():
    engine = Engine(loaded, config)
    out = {}
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(jobs):
        req = GenerationRequest(job_id=f"j{i}", prompt_ids=prompt, max_new_tokens=n,
                                ignore_eos=True)
        assert engine.submit(req).accepted
        out[req.job_id] = []
    while engine.has_work:
        for event in engine.step().tokens:
            out[event.job_id].append(event.token_id)
    return time.perf_counter() - start, [out[f"j{i}"] for i in range(len(jobs))]

for _ in range(2):
    run()
seconds, tokens = [], None
for _ in range(reps):
    s, tokens = run()
    seconds.append(s)
print(json.dumps({"seconds": seconds, "tokens": tokens}))
"""


def run_round(tree: Path, folder: str, jobs: list[list[Any]], reps: int, threads: int) -> Any:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    proc = subprocess.run(
        [sys.executable, "-c", ROUND, folder, json.dumps(jobs), str(reps), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"round under {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_config(
    name: str, trees: dict[str, Path], rounds: int, reps: int, threads: int
) -> dict[str, Any]:
    useful = 0
    per_tree: dict[str, list[float]] = {t: [] for t in trees}
    tokens: dict[str, list[list[int]]] = {}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(name, Path(folder))
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        jobs = [[j.prompt_ids, j.max_new] for j in mixed_jobs(16, (8, 64), (16, 96), vocab)]
        useful = sum(n for _, n in jobs)
        order = list(trees)
        for r in range(rounds):
            for label in order if r % 2 == 0 else order[::-1]:  # ABBA
                loads.append(loadavg()[0])
                got = run_round(trees[label], folder, jobs, reps, threads)
                per_tree[label].extend(useful / s for s in got["seconds"])
                tokens[label] = got["tokens"]
            print(f"  {name} round {r + 1}/{rounds}, load {loadavg()[0]:.2f}", flush=True)
    first = next(iter(tokens.values()))
    result: dict[str, Any] = {
        "useful_tokens": useful,
        "rounds": rounds,
        "reps_per_round": reps,
        "threads": threads,
        "load_min_max": [min(loads), max(loads)],
        "same_tokens": all(t == first for t in tokens.values()),
        "tok_s": {label: {**spread(v), "runs": v} for label, v in per_tree.items()},
    }
    labels = list(trees)
    if len(labels) == 2:
        a, b = (statistics.median(per_tree[x]) for x in labels)
        result["median_ratio"] = {f"{labels[0]}/{labels[1]}": a / b}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="label=path, repeatable")
    parser.add_argument("--configs", default="tiny")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per round and tree")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="bench/out/ab_engine.json")
    args = parser.parse_args()
    trees = {t.split("=", 1)[0]: Path(t.split("=", 1)[1]) for t in args.tree}
    results: dict[str, Any] = {
        "machine": machine_info(),
        "trees": {k: str(v) for k, v in trees.items()},
    }
    for name in args.configs.split(","):
        results[name] = res = bench_config(name, trees, args.rounds, args.reps, args.threads)
        for label, s in res["tok_s"].items():
            print(
                f"{name} {label:>6}: {s['min']:7.0f} / {s['median']:7.0f} / {s['max']:7.0f}"
                " tok/s (min / median / max)"
            )
        print(f"{name} same tokens: {res['same_tokens']}; {res.get('median_ratio')}")
    mark_end(results["machine"])
    print(f"wrote {write_report(Path(args.out), results)}")


if __name__ == "__main__":
    main()
