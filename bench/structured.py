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

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from _common import mixed_jobs
from report import (
    load_now,
    machine_info,
    mark_end,
    markdown_table,
    pyplot,
    save_figure,
    spread,
    write_report,
    wrote,
)

from tokenfleet.model import load_model
from tokenfleet.protocol import GenerationRequest, SamplingParams, Structured
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


def run(loaded: Any, jobs: list[Any], schema: bool) -> dict[str, Any]:
    eng = Engine(loaded, EngineConfig(max_active=32, max_batch_size=32, max_waiting=32))
    structured = Structured(kind="json_schema", value=json.dumps(SCHEMA)) if schema else None
    for i, job in enumerate(jobs):
        request = GenerationRequest(
            job_id=f"j{i}",
            prompt_ids=job.prompt_ids,
            max_new_tokens=job.max_new,
            ignore_eos=True,
            sampling=SamplingParams(temperature=0.0),
            structured=structured,
        )
        assert eng.submit(request).accepted
    started = time.perf_counter()
    tokens = 0
    reasons: dict[str, int] = {}
    while eng.has_work:
        out = eng.step()
        tokens += len(out.tokens)
        for f in out.finished:
            reasons[str(f.result.finish_reason)] = reasons.get(str(f.result.finish_reason), 0) + 1
    wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "finish": reasons}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/out/structured.json")
    parser.add_argument("--plot", default="docs/img/structured.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    started = time.perf_counter()
    loaded = load_model(args.model, dtype="auto")
    jobs = mixed_jobs(16, (8, 64), (16, 96), loaded.config.vocab_size, seed=2)
    run(loaded, jobs[:4], True)  # warm-up: the grammar tokenizer, the first compile
    run(loaded, jobs[:4], False)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "schema": []}
    for r in range(args.rounds):
        order = ("plain", "schema") if r % 2 == 0 else ("schema", "plain")
        for variant in order:
            got = run(loaded, jobs, variant == "schema")
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
    rows = [
        [v, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}"] for v, s in summary.items()
    ]
    text = "\n".join(markdown_table(["variant", "tok/s med", "min", "max"], rows))
    text += f"\n\nschema / plain (medians): {ratio:.3f}; same tokens generated: {tokens_equal}\n"
    print(text)
    report = {
        "machine": mark_end(machine),
        "model": args.model,
        "dtype": str(loaded.dtype),
        "threads": args.threads,
        "schema": SCHEMA,
        "runs": runs,
        "summary": summary,
        "ratio_schema_over_plain": ratio,
        "same_tokens": tokens_equal,
        "wall_s": time.perf_counter() - started,
    }
    out = write_report(Path(args.out), report, text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = list(summary)
    meds = [summary[n]["median"] for n in names]
    ax.bar(
        names,
        meds,
        yerr=[
            [m - summary[n]["min"] for n, m in zip(names, meds, strict=True)],
            [summary[n]["max"] - m for n, m in zip(names, meds, strict=True)],
        ],
        color=["#999", "#2a7"],
    )
    ax.set_ylabel("useful tok/s (median, min-max)")
    ax.set_title(f"mixed workload, {args.model}: schema / plain {ratio:.2f}")
    save_figure(fig, Path(args.plot))
    print(wrote(out, args.plot, report["wall_s"]))


if __name__ == "__main__":
    main()
