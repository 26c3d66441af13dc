"""Priority bands under a batch flood: how long interactive jobs wait for a worker when
a flood of batch jobs is already queued, with bands (the flood at `batch`, the
interactive jobs at `interactive`) and without (everything in the `default` band, FIFO),
same run, same worker.

Usage: python bench/priority.py [--rounds 3] [--flood 120] [--model smollm2-135m-instruct]
                                [--baseline TREE] [--variants bands,fifo]
                                [--out bench/out/priority.json]
                                [--plot docs/img/priority.png]

`--baseline TREE` adds the variant `baseline`: the bands variant served by a worker
imported from another checkout (e.g. `git worktree add /tmp/base c5ad02a`), on a prefix
of its own, interleaved with the others round by round, to tell a change's effect from
the machine's noise. Only one worker is busy at a time; the other idles on its own queue.

One real `tokenfleet worker` (dtype auto, --threads 2, --max-active 16) through a
redis-server this program starts on a free port. Each round submits the flood at once
(prompts 24-64 tokens, 24 new tokens each, greedy, eos ignored), waits until the worker
has started 16 of them, then submits 8 interactive jobs (16 new tokens) 0.5 s apart,
while the flood is still being served. Per interactive job: its queue wait (the
result's `timings.queued_s`: submit -> a worker admitted it) and its time to first
token. Per round: the flood's tok/s (it should not pay for the bands) and how many
batch sessions the worker preempted for interactive ones. Rounds
alternate which variant goes first; min / median / max over rounds of each round's
median and worst interactive wait.
"""

from __future__ import annotations

import random
import time
from functools import partial
from pathlib import Path
from typing import Any

from _common import random_request
from _fleet import Fleet
from _rounds import abba, wait_until
from report import (
    Run,
    figure,
    load_now,
    markdown_text,
    outputs,
    parser,
    pct,
    spread_cell,
    spreads,
)

from tokenfleet.local import LocalWorkers
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

PREFIX = "bench-priority:"
INTERACTIVE = 8
TIMEOUT_S = 600.0
FIELDS = ("wait_p50_s", "wait_max_s", "ttft_p50_s", "flood_tok_s")


def flood(tag: str, n: int, priority: str, rng: random.Random) -> list[GenerationRequest]:
    return [
        random_request(
            f"{tag}-batch-{i}", rng.randint(24, 64), 24, rng, priority=priority, tenant="pipeline"
        )
        for i in range(n)
    ]


def preemptions(workers: LocalWorkers) -> int:
    """The worker's preempted_total once its heartbeat caught up (no job in flight)."""
    (beat,) = workers.settle().values()
    return int(beat.get("preempted_total", 0))


def one_round(
    producer: Producer, workers: LocalWorkers, tag: str, n: int, bands: bool, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    variant = "bands" if bands else "fifo"
    if producer.keys.prefix != PREFIX:
        variant = "baseline"
    preempted_before = preemptions(workers)
    jobs = flood(tag, n, "batch" if bands else "default", rng)
    started = time.perf_counter()
    for outcome in producer.submit_many(jobs):
        assert outcome.accepted, outcome
    keys, client = producer.keys, producer.redis

    def busy() -> bool:  # the worker is busy with the flood: 16 started
        return sum(1 for j in jobs[:32] if client.hget(keys.job(j.job_id), "started_at")) >= 16

    if not wait_until(busy, TIMEOUT_S):
        raise TimeoutError("the worker did not start the flood")
    handles = []
    for k in range(INTERACTIVE):
        priority = "interactive" if bands else "default"
        job_id = f"{tag}-interactive-{k}"
        handles.append(
            producer.submit(random_request(job_id, 32, 16, rng, priority=priority, tenant="chat"))
        )
        time.sleep(0.5)  # the arrival process, not a synchronisation
    waits, ttfts = [], []
    for handle in handles:
        result = handle.result(timeout=TIMEOUT_S)
        assert result.timings.queued_s is not None and result.timings.ttft_s is not None
        waits.append(result.timings.queued_s)
        ttfts.append(result.timings.ttft_s)
    tokens = 0
    for job in jobs:
        tokens += len(producer.handle(job.job_id).result(timeout=TIMEOUT_S).token_ids)
    wall = time.perf_counter() - started
    return {
        "preempted": preemptions(workers) - preempted_before,
        "variant": variant,
        "interactive_wait_s": waits,
        "interactive_ttft_s": ttfts,
        "wait_p50_s": pct(waits, 50),
        "wait_max_s": max(waits),
        "ttft_p50_s": pct(ttfts, 50),
        "flood_tokens": tokens,
        "flood_wall_s": wall,
        "flood_tok_s": tokens / wall,
        "load": load_now(),
    }


def plot(runs: dict[str, list[dict[str, Any]]], flood: int, path: Path) -> None:
    with figure(path, figsize=(5.5, 3.5)) as ax:
        labels = {
            "bands": "bands (interactive over batch)",
            "fifo": "one FIFO band",
            "baseline": "bands, baseline tree",
        }
        colors = {"bands": "#2a7", "fifo": "#999", "baseline": "#27a"}
        for i, variant in enumerate(runs):
            waits = [w * 1000 for x in runs[variant] for w in x["interactive_wait_s"]]
            ax.scatter(
                [i + random.uniform(-0.15, 0.15) for _ in waits], waits, color=colors[variant], s=12
            )
        ax.set_xticks(list(range(len(runs))), [labels[v] for v in runs])
        ax.set_yscale("log")
        ax.set_ylabel("interactive queue wait, ms (log)")
        ax.set_title(f"{INTERACTIVE} interactive jobs beside a {flood}-job batch flood")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flood", type=int, default=120)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout")
    p.add_argument("--variants", default="bands,fifo")
    outputs(p, "priority")
    args = p.parse_args()
    run = Run()
    log_dir = Path(args.out).parent / "priority-logs"
    worker_args = ["--model", args.model, "--threads", str(args.threads), "--max-active", "16"]
    variants = [v for v in args.variants.split(",") if v]
    runs: dict[str, list[dict[str, Any]]] = {}
    with Fleet() as fleet:
        fleets = fleet.sides(PREFIX, worker_args, args.baseline, log_dir)
        variants += ["baseline"] if "baseline" in fleets else []
        runs = {v: [] for v in variants}
        producers = {}
        for name, workers in fleets.items():
            workers.start_one(f"priority-w-{name.replace(' ', '-')}")
            workers.wait_live()
            producers[name] = fleet.producer(workers)
            warm = producers[name].submit(prompt_ids=[1, 2, 3], max_new_tokens=4, job_id="warm")
            warm.result(60)
        for r in range(args.rounds):
            for k, variant in enumerate(abba(variants, r)):
                seed = 3 * r + k  # fresh prompts: none found in the prefix cache
                side = "baseline" if variant == "baseline" else "this tree"
                bands = variant != "fifo"
                tag = f"r{r}-{variant}"
                got = one_round(producers[side], fleets[side], tag, args.flood, bands, seed)
                runs[got["variant"]].append(got)
                print(
                    f"round {r} {got['variant']:5s} wait p50 {got['wait_p50_s'] * 1000:8.1f} ms "
                    f"max {got['wait_max_s'] * 1000:8.1f} ms  ttft p50 "
                    f"{got['ttft_p50_s'] * 1000:8.1f} ms  flood {got['flood_tok_s']:6.1f} tok/s "
                    f"preempted {got['preempted']} "
                    f"load {got['load']['loadavg'][0]:.2f}",
                    flush=True,
                )
    summary = {v: spreads(rs, FIELDS) for v, rs in runs.items()}
    rows = [
        [
            v,
            spread_cell(s["wait_p50_s"], ".0f", 1000),
            spread_cell(s["wait_max_s"], ".0f", 1000),
            f"{s['ttft_p50_s']['median'] * 1000:.0f}",
            spread_cell(s["flood_tok_s"], ".1f"),
        ]
        for v, s in summary.items()
    ]
    headers = [
        "variant",
        "interactive wait p50 ms (min–max)",
        "worst wait ms",
        "TTFT p50 ms",
        "flood tok/s",
    ]
    text = markdown_text(headers, rows)
    report = run.report(
        model=args.model,
        threads=args.threads,
        flood=args.flood,
        baseline=None if args.baseline is None else str(args.baseline),
        interactive=INTERACTIVE,
        runs=runs,
        summary=summary,
    )
    run.finish(args, report, text, partial(plot, runs, args.flood), table=text)


if __name__ == "__main__":
    main()
