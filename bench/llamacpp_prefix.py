"""What prefix sharing buys on the llama.cpp runner: jobs under one long system prompt,
with the engine's prefix cache on (cells lent between sequences) and off.

Usage: python bench/llamacpp_prefix.py [--rounds 3] [--jobs 8] [--system-tokens 400]
           [--out bench/out/llamacpp_prefix.json]

In process (no Redis): SmolLM2-135M-Instruct's GGUF on `LlamaCppRunner`, 2 threads, the
worker's default budgets (256 MiB of KV, 64 sessions, 256 prefill tokens a tick). Each
round runs the same jobs once per setting, settings interleaved ABBA: `--jobs` chat
prompts (a system prompt of about `--system-tokens` tokens, then a short question,
fresh per round so no round finds another's cache), 32 new tokens each, greedy, eos
ignored, submitted together and served 2 at a time. A fresh runner and engine per
setting and round. Reports wall time, TTFT (submit to first token) p50 and the prompt
tokens the cache supplied, median (min-max) over rounds, and the ratios.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
from _rounds import abba
from report import Run, outputs, parser

from tokenfleet.model.chat import render_chat
from tokenfleet.model.llamacpp_runner import LlamaCppOptions, LlamaCppRunner
from tokenfleet.model.smollm2 import require_smollm2_gguf
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.main import llamacpp_options

TEXT = (
    "answer every question briefly and kindly using plain words a child would know "
    "with one example from home school or the park and never a list or a table"
)
SETTINGS = ("prefix cache on", "prefix cache off")
NEW = 32


def jobs(runner: LlamaCppRunner, n: int, system_tokens: int, rnd: int) -> list[GenerationRequest]:
    tok = runner.tokenizer
    assert tok is not None
    rng = random.Random(rnd)
    words = TEXT.split(" ")
    system = " ".join(rng.choice(words) for _ in range(system_tokens))
    out = []
    for i in range(n):
        question = f"Question {i} of round {rnd}: why is the number {rng.randrange(1000)} even?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = render_chat(tok, messages)
        out.append(
            GenerationRequest(
                job_id=f"r{rnd}-{i}",
                prompt_ids=tok.encode(prompt),
                max_new_tokens=NEW,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.0),
            )
        )
    return out


def measure(setting: str, requests: list[GenerationRequest]) -> dict[str, Any]:
    cache = setting == "prefix cache on"
    config = EngineConfig(
        max_active=2, max_batch_size=2, max_waiting=len(requests), prefix_cache=cache
    )
    runner = LlamaCppRunner(require_smollm2_gguf(), llamacpp_options(config, threads=2))
    try:
        engine = Engine(runner, config)
        start = time.perf_counter()
        for r in requests:
            assert engine.submit(r).accepted
        first: dict[str, float] = {}
        cached = 0
        while engine.has_work:
            step = engine.step()
            now = time.perf_counter()
            for event in step.tokens:
                first.setdefault(event.job_id, now - start)
            cached += sum(f.result.usage.cached_tokens for f in step.finished)
        wall = time.perf_counter() - start
        return {
            "wall_s": wall,
            "ttft_p50_s": statistics.median(first.values()),
            "cached_tokens": cached,
            "prompt_tokens": sum(len(r.prompt_ids or []) for r in requests),
            "recomputed_tokens": runner.recomputed_tokens,
        }
    finally:
        runner.close()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=400)
    outputs(p, "llamacpp_prefix", plot=False)
    args = p.parse_args()
    torch.set_num_threads(1)  # torch only samples here, as in the worker
    run = Run()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    probe = LlamaCppRunner(
        require_smollm2_gguf(),
        LlamaCppOptions(kv_budget_bytes=2**24, block_size=16, max_sequences=1, max_tick_tokens=8),
    )
    try:
        workloads = [jobs(probe, args.jobs, args.system_tokens, r) for r in range(args.rounds)]
    finally:
        probe.close()
    for rnd in range(args.rounds):
        for setting in abba(SETTINGS, rnd):
            got = measure(setting, workloads[rnd])
            runs[setting].append(got)
            run.log(
                f"round {rnd + 1} {setting}: {got['wall_s']:.2f} s, TTFT p50 "
                f"{got['ttft_p50_s'] * 1000:.0f} ms, cached {got['cached_tokens']} of "
                f"{got['prompt_tokens']} prompt tokens"
            )
    summary: dict[str, Any] = {}
    for setting, rows in runs.items():
        summary[setting] = {
            field: {
                "median": statistics.median(r[field] for r in rows),
                "min": min(r[field] for r in rows),
                "max": max(r[field] for r in rows),
            }
            for field in ("wall_s", "ttft_p50_s", "cached_tokens")
        }
    on, off = summary["prefix cache on"], summary["prefix cache off"]
    ratios = {
        "wall_on_over_off": on["wall_s"]["median"] / off["wall_s"]["median"],
        "ttft_on_over_off": on["ttft_p50_s"]["median"] / off["ttft_p50_s"]["median"],
    }
    for setting, s in summary.items():
        print(
            f"{setting}: wall {s['wall_s']['median']:.2f} ({s['wall_s']['min']:.2f}-"
            f"{s['wall_s']['max']:.2f}) s, TTFT p50 {s['ttft_p50_s']['median'] * 1000:.0f} ms, "
            f"cached {s['cached_tokens']['median']:.0f} tokens"
        )
    print(f"on / off: wall {ratios['wall_on_over_off']:.2f}, TTFT {ratios['ttft_on_over_off']:.2f}")
    run.finish(args, run.report(settings=list(SETTINGS), runs=runs, summary=summary, ratios=ratios))


if __name__ == "__main__":
    main()
