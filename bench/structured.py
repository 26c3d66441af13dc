"""The cost of structured output: the mixed workload with and without a JSON schema on
every session, same run, same engine.

Usage: python bench/structured.py [--rounds 3] [--model smollm2-135m-instruct]
                                  [--out bench/out/structured.json]
                                  [--plot docs/img/structured.png]

16 jobs at once (prompts 8-64 tokens, 16-96 new, `mixed_jobs`, seed 2), greedy, eos
ignored, through the in-process Engine (dtype auto). With a schema, every job carries
a JSON schema long enough that no job completes it within its budget (an object with
an array of at least 200 short strings), so both variants generate exactly the same
number of tokens and the difference is the grammar's cost alone: computing each
structured session's token mask (llguidance, on a thread while the forward runs),
applying it to the logits, and feeding each sampled token to the matcher. Rounds
alternate which variant goes first; min / median / max of useful tok/s. Target
(issue 14): <= 15 % fewer useful tok/s with the schema.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import mixed_workload, requests
from _engine import steps, submit_all
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

from tokenfleet.model import load_model
from tokenfleet.protocol import SamplingParams, Structured
from tokenfleet.worker.engine import Engine, EngineConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 200,
        },
        "done": {"type": "boolean"},
    },
    "required": ["title", "items", "done"],
    "additionalProperties": False,
}


def one_run(loaded: Any, jobs: list[Any], schema: bool) -> dict[str, Any]:
    eng = Engine(loaded, EngineConfig(max_active=32, max_batch_size=32, max_waiting=32))
    structured = Structured(kind="json_schema", value=json.dumps(SCHEMA)) if schema else None
    submit_all(eng, requests(jobs, sampling=SamplingParams(temperature=0.0), structured=structured))
    tokens = 0
    reasons: dict[str, int] = {}
    started = time.perf_counter()
    for out in steps(eng):
        tokens += len(out.tokens)
        for f in out.finished:
            reasons[str(f.result.finish_reason)] = reasons.get(str(f.result.finish_reason), 0) + 1
    wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "finish": reasons}


def plot(summary: dict[str, Any], title: str, path: Path) -> None:
    with figure(path, figsize=(5, 3.5)) as ax:
        medians, errors = spread_errors(list(summary.values()))
        ax.bar(list(summary), medians, yerr=errors, color=["#999", "#2a7"])
        ax.set_ylabel("useful tok/s (median, min-max)")
        ax.set_title(title)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    outputs(p, "structured")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Run()
    loaded = load_model(args.model, dtype="auto")
    jobs = mixed_workload(loaded.config.vocab_size)
    one_run(loaded, jobs[:4], True)  # warm-up: the grammar tokenizer, the first compile
    one_run(loaded, jobs[:4], False)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "schema": []}
    for r in range(args.rounds):
        for variant in abba(("plain", "schema"), r):
            got = one_run(loaded, jobs, variant == "schema")
            got["load"] = load_now()
            runs[variant].append(got)
            print(
                f"round {r} {variant:6s} {got['tok_s']:7.1f} tok/s {got['tokens']} tokens "
                f"{got['finish']}",
                flush=True,
            )
    summary = {v: spread([x["tok_s"] for x in rs]) for v, rs in runs.items()}
    ratio = summary["schema"]["median"] / summary["plain"]["median"]
    tokens_equal = {x["tokens"] for x in runs["plain"]} == {x["tokens"] for x in runs["schema"]}
    rows = [[v, *spread_cells(s)] for v, s in summary.items()]
    text = markdown_text(["variant", "tok/s med", "min", "max"], rows)
    text += f"\nschema / plain (medians): {ratio:.3f}; same tokens generated: {tokens_equal}\n"
    report = run.report(
        model=args.model,
        dtype=str(loaded.dtype),
        threads=args.threads,
        schema=SCHEMA,
        runs=runs,
        summary=summary,
        ratio_schema_over_plain=ratio,
        same_tokens=tokens_equal,
    )
    title = f"mixed workload, {args.model}: schema / plain {ratio:.2f}"
    run.finish(args, report, text, partial(plot, summary, title), table=text)


if __name__ == "__main__":
    main()
