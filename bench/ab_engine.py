"""Two code trees side by side on the engine benchmark's mixed workload, in one run.

Usage: python bench/ab_engine.py --tree new=. --tree old=/tmp/old [--configs tiny,small]
                                 [--rounds 6] [--out bench/out/ab_engine.json]

For a refactor that must not change speed: one checkpoint per config (built once,
`bench/_common.py`), then rounds that alternate the trees in ABBA order. Each
(round, tree) is a fresh `python` in the tree's folder with PYTHONPATH=<tree> that loads
the checkpoint, warms up on the same jobs, then times `--reps` runs of the 16 mixed jobs
through the public engine API alone (`Engine(load_model(...), EngineConfig(...))`,
submit, step until done; bench/_engine.py of this checkout, for every tree), which
every tree has. Reported per tree: min / median / max tokens/s over all timed runs, the
generated tokens' agreement across trees, and the load average around each round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import build_checkpoint, mixed_workload
from _rounds import abba
from _trees import Tree
from report import loadavg, machine_info, mark_end, outputs, parser, spread, write_report

BENCH = Path(__file__).resolve().parent

# Runs under the tree's tokenfleet; argv: bench/, checkpoint folder, jobs JSON, reps, threads.
ROUND = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, tokenfleet
from _common import Job, requests
from _engine import engine_config, generate
from _rounds import timed
from tokenfleet.model import load_model
from tokenfleet.worker.engine import Engine

folder, jobs, reps = sys.argv[2], [Job(*j) for j in json.loads(sys.argv[3])], int(sys.argv[4])
torch.set_num_threads(int(sys.argv[5]))
loaded = load_model(folder, dtype="float32", device="cpu")
config = engine_config(loaded, jobs, len(jobs))

def run():
    engine, reqs = Engine(loaded, config), requests(jobs)
    return timed(lambda: generate(engine, reqs))

for _ in range(2):
    run()
got = [run() for _ in range(reps)]
print(json.dumps({"seconds": [s for s, _ in got], "tokens": got[-1][1],
                  "tokenfleet": tokenfleet.__file__}))
"""


def run_round(tree: Tree, folder: str, jobs: list[list[Any]], reps: int, threads: int) -> Any:
    args = [str(BENCH), folder, json.dumps(jobs), str(reps), str(threads)]
    proc = subprocess.run(
        [sys.executable, "-c", ROUND, *args],
        env={**os.environ, **tree.env()},
        cwd=tree.path,  # `python -c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"round under {tree.path} failed:\n{proc.stderr[-4000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(got["tokenfleet"]).resolve().is_relative_to(tree.path):
        raise RuntimeError(f"round under {tree.path} imported {got['tokenfleet']}")
    return got


def bench_config(
    name: str, trees: list[Tree], rounds: int, reps: int, threads: int
) -> dict[str, Any]:
    per_tree: dict[str, list[float]] = {t.name: [] for t in trees}
    tokens: dict[str, list[list[int]]] = {}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        vocab = build_checkpoint(name, Path(folder)).config.vocab_size
        jobs = [[j.prompt_ids, j.max_new] for j in mixed_workload(vocab)]
        useful = sum(n for _, n in jobs)
        for r in range(rounds):
            for tree in abba(trees, r):
                loads.append(loadavg()[0])
                got = run_round(tree, folder, jobs, reps, threads)
                per_tree[tree.name].extend(useful / s for s in got["seconds"])
                tokens[tree.name] = got["tokens"]
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
    if len(trees) == 2:
        a, b = (statistics.median(per_tree[t.name]) for t in trees)
        result["median_ratio"] = {f"{trees[0].name}/{trees[1].name}": a / b}
    return result


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tree", action="append", required=True, help="label=path, repeatable")
    p.add_argument("--configs", default="tiny")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=3, help="timed runs per round and tree")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    outputs(p, "ab_engine", plot=False)
    args = p.parse_args()
    trees = [Tree.parse(spec) for spec in args.tree]
    results: dict[str, Any] = {
        "machine": machine_info(),
        "trees": {t.name: str(t.path) for t in trees},
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
