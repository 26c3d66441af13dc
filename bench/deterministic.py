"""What `--deterministic` costs: the engine's mixed workload with and without it, in one run.

Usage: python bench/deterministic.py [--model smollm2-135m-instruct] [--rounds 3]
                                     [--quants none,int8] [--threads 2]
                                     [--out bench/out/deterministic.json]
                                     [--plot docs/img/deterministic.png]

The model is loaded once (bf16); each variant (default / deterministic, per weight
format) is a copy of it, switched as the worker would (`make_deterministic`). Rounds
alternate the variants (ABBA order), each a timed run of the 16 mixed jobs (greedy,
bench/_common.py) through the public engine API after one warm-up. Reported per
variant: min / median / max useful tokens/s, the deterministic ÷ default ratio of the
medians, whether each variant's tokens were the same in every round, and the load
average around the run. Eager (uncompiled) weights throughout. The plot: each variant's
median tok/s with its min–max range.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch
from _common import mixed_workload, requests
from _engine import engine_config, generate
from _rounds import abba, timed
from report import figure, loadavg, machine_info, mark_end, outputs, spread_errors, write_json

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.deterministic import make_deterministic
from tokenfleet.worker.engine import Engine


def variant(base: LoadedModel, quant: str | None, deterministic: bool) -> LoadedModel:
    loaded = copy.deepcopy(base)
    if quant is not None:
        loaded.model.quantize(quant)  # type: ignore[arg-type]
        loaded = dataclasses.replace(loaded, quant=quant)
    if deterministic:
        make_deterministic(loaded.model)
    return loaded


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quants", default="none,int8")
    p.add_argument("--threads", type=int, default=2)
    outputs(p, "deterministic")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    base = load_model(args.model, dtype="bfloat16", device="cpu")
    jobs = mixed_workload(base.config.vocab_size)
    config = engine_config(base, jobs, len(jobs))
    useful = sum(j.max_new for j in jobs)
    names: list[str] = []
    models: dict[str, LoadedModel] = {}
    for q in args.quants.split(","):
        quant = None if q == "none" else q
        for det in (False, True):
            name = f"{q if quant else 'bf16'}{'-det' if det else ''}"
            models[name] = variant(base, quant, det)
            names.append(name)

    def run(name: str) -> tuple[float, list[list[int]]]:
        engine = Engine(models[name], config)
        return timed(lambda: generate(engine, requests(jobs)))

    for name in names:  # warm-up
        run(name)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[list[int]]]] = {n: [] for n in names}
    load_before = loadavg()
    for r in range(args.rounds):
        for name in abba(names, r):
            s, got = run(name)
            seconds[name].append(s)
            tokens[name].append(got)
            print(f"round {r} {name:10} {useful / s:8.1f} tok/s", flush=True)
    rows: dict[str, Any] = {}
    for name in names:
        rates = [useful / s for s in seconds[name]]
        rows[name] = {
            "tok_s": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)},
            "same_tokens_every_round": all(t == tokens[name][0] for t in tokens[name]),
        }
    print(f"\n{'variant':10} {'min':>8} {'median':>8} {'max':>8}  same tokens every round")
    for name, row in rows.items():
        t = row["tok_s"]
        same = row["same_tokens_every_round"]
        print(f"{name:10} {t['min']:8.1f} {t['median']:8.1f} {t['max']:8.1f}  {same}")
    for name in names:
        if name.endswith("-det"):
            plain = name.removesuffix("-det")
            ratio = rows[name]["tok_s"]["median"] / rows[plain]["tok_s"]["median"]
            rows[name]["ratio_to_default"] = ratio
            print(f"{name}: {ratio:.3f}x the default's median tok/s")
    report = {
        "model": args.model,
        "rounds": args.rounds,
        "threads": args.threads,
        "useful_tokens": useful,
        "load_before": load_before,
        "variants": rows,
        "machine": mark_end(machine),
    }
    write_json(Path(args.out), report)
    with figure(Path(args.plot), 1, 1, figsize=(6, 3.5)) as ax:
        medians, errors = spread_errors([rows[n]["tok_s"] for n in names])
        ax.bar(names, medians, yerr=errors, capsize=4)
        ax.set_ylabel("useful tok/s (median, min-max)")
        ax.set_title(f"--deterministic cost, {args.model}, mixed workload")


if __name__ == "__main__":
    main()
