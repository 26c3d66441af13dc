"""How long a worker's model takes to be ready on a machine that has compiled nothing
yet: the default start of SmolLM2-135M-Instruct or another `--model` (its engine plan,
narrow weights, compiling) with inductor's on-disk cache empty, once per variant, each
in a fresh process.

Usage: python bench/first_start.py [--variants 'native=,graph=TOKENFLEET_NATIVE_DECODE=0']
           [--rounds 1] [--threads 2] [--model smollm2-135m-instruct]
           [--out bench/out/first_start.json] [--plot bench/out/first_start.png]

Each variant is NAME=ENV (space-separated VAR=VALUE pairs set for that process): by
default the native decode stack (the worker's default, nothing compiled for decode
ticks) and the compiled decode graph (`TOKENFLEET_NATIVE_DECODE=0`). A round runs every
variant in turn, each with its own empty `TORCHINDUCTOR_CACHE_DIR`, and records the
process's time to a loaded, compiled, warmed model (`worker.main.torch_model`, what a
worker does before it joins the fleet) and the `compile_s` its hash would carry. The
engine probe's cache (~/.cache/tokenfleet/probe) and the C++ kernels' build stay as
they are: they are per machine, not per start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import figure, machine_info, mark_end, outputs, parser, spread, write_json

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from tokenfleet.config.worker import WorkerSettings
from tokenfleet.worker.main import torch_model
_, info, _ = torch_model(WorkerSettings(model=sys.argv[2], threads=int(sys.argv[1])))
print(json.dumps({"ready_s": time.perf_counter() - t0, "compile_s": info.get("compile_s"),
                  "decode_path": info.get("decode_path")}))
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--variants", default="native=,graph=TOKENFLEET_NATIVE_DECODE=0")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a preset, file or folder")
    outputs(p, "first_start")
    args = p.parse_args()
    machine = machine_info()
    variants: dict[str, dict[str, str]] = {}
    for item in args.variants.split(","):
        name, _, env = item.partition("=")
        variants[name] = dict(pair.split("=", 1) for pair in env.split())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, env in variants.items():
            with tempfile.TemporaryDirectory(prefix="first-start-") as cache:
                child_env = {**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": cache}
                t0 = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(args.threads), args.model],
                    env=child_env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["process_s"] = time.perf_counter() - t0
            runs[name].append(record)
            print(
                f"round {r + 1}, {name}: ready after {record['ready_s']:.1f} s"
                f" (compile_s {record['compile_s']}, decode: {record['decode_path']})",
                flush=True,
            )
    results = {
        name: {
            "ready_s": spread([x["ready_s"] for x in rs]),
            "compile_s": spread([float(x["compile_s"] or 0.0) for x in rs]),
            "decode_path": rs[0]["decode_path"],
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    write_json(
        Path(args.out),
        {
            "variants": variants,
            "threads": args.threads,
            "model": args.model,
            "results": results,
            "machine": mark_end(machine),
        },
    )
    if not args.plot:
        return
    names = list(results)
    with figure(Path(args.plot), 1, 1, figsize=(2 + 1.5 * len(names), 3.5)) as ax:
        ax.bar(names, [results[n]["ready_s"]["median"] for n in names])
        ax.set_ylabel("s to a ready model, empty inductor cache")
        ax.set_title(f"{args.model} default start, {args.threads} threads")


if __name__ == "__main__":
    main()
