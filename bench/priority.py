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

import argparse
import random
import time
from pathlib import Path
from typing import Any

import redis
from report import (
    load_now,
    machine_info,
    mark_end,
    markdown_table,
    pct,
    pyplot,
    save_figure,
    spread,
    write_report,
    wrote,
)

from tokenfleet.local import EmbeddedRedis, LocalWorkers
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

PREFIX = "bench-priority:"
BASELINE_PREFIX = "bench-priority-base:"
INTERACTIVE = 8
TIMEOUT_S = 600.0


def flood(tag: str, n: int, priority: str, rng: random.Random) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            job_id=f"{tag}-batch-{i}",
            prompt_ids=[rng.randrange(1000, 20000) for _ in range(rng.randint(24, 64))],
            max_new_tokens=24,
            ignore_eos=True,
            priority=priority,  # type: ignore[arg-type]
            tenant="pipeline",
        )
        for i in range(n)
    ]


def preemptions(workers: LocalWorkers) -> int:
    """The worker's preempted_total once its heartbeat caught up (no job in flight)."""
    (beat,) = workers.settle().values()
    return int(beat.get("preempted_total", 0))


def one_round(
    producer: Producer,
    client: redis.Redis,
    workers: LocalWorkers,
    tag: str,
    n: int,
    bands: bool,
    seed: int,
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
    keys = producer.keys
    # until the worker is busy with the flood (16 started)
    deadline = time.monotonic() + TIMEOUT_S
    while sum(1 for j in jobs[:32] if client.hget(keys.job(j.job_id), "started_at")) < 16:
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not start the flood")
        time.sleep(0.01)
    handles = []
    for k in range(INTERACTIVE):
        request = GenerationRequest(
            job_id=f"{tag}-interactive-{k}",
            prompt_ids=[rng.randrange(1000, 20000) for _ in range(32)],
            max_new_tokens=16,
            ignore_eos=True,
            priority="interactive" if bands else "default",
            tenant="chat",
        )
        handles.append(producer.submit(request))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=120)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--variants", default="bands,fifo")
    parser.add_argument("--out", default="bench/out/priority.json")
    parser.add_argument("--plot", default="docs/img/priority.png")
    args = parser.parse_args()
    machine = machine_info()
    started = time.perf_counter()
    embedded = EmbeddedRedis.start()
    log_dir = Path(args.out).parent / "priority-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_args = ["--model", args.model, "--threads", str(args.threads), "--max-active", "16"]
    variants = [v for v in args.variants.split(",") if v]
    fleets = {"": LocalWorkers(embedded.url, PREFIX, worker_args, log_dir=log_dir)}
    if args.baseline is not None:
        variants.append("baseline")
        tree = str(args.baseline.resolve())
        fleets["baseline"] = LocalWorkers(
            embedded.url,
            BASELINE_PREFIX,
            worker_args,
            log_dir=log_dir,
            env={"PYTHONPATH": tree},
            cwd=Path(tree),
        )
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        client = redis.Redis.from_url(embedded.url)
        producers = {}
        for name, fleet in fleets.items():
            fleet.start_one(f"priority-w{'-' + name if name else ''}")
            fleet.wait_live()
            producers[name] = Producer(client, keys=fleet.keys, default_cap=10_000)
            warm = producers[name].submit(prompt_ids=[1, 2, 3], max_new_tokens=4, job_id="warm")
            warm.result(60)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for k, variant in enumerate(order):
                tag = f"r{r}-{variant}"
                seed = 3 * r + k  # fresh prompts: none found in the prefix cache
                side = "baseline" if variant == "baseline" else ""
                got = one_round(
                    producers[side], client, fleets[side], tag, args.flood, variant != "fifo", seed
                )
                runs[got["variant"]].append(got)
                print(
                    f"round {r} {got['variant']:5s} wait p50 {got['wait_p50_s'] * 1000:8.1f} ms "
                    f"max {got['wait_max_s'] * 1000:8.1f} ms  ttft p50 "
                    f"{got['ttft_p50_s'] * 1000:8.1f} ms  flood {got['flood_tok_s']:6.1f} tok/s "
                    f"preempted {got['preempted']} "
                    f"load {got['load']['loadavg'][0]:.2f}",
                    flush=True,
                )
    finally:
        for fleet in fleets.values():
            fleet.drain()
        embedded.stop()
    summary = {
        v: {
            field: spread([x[field] for x in rs])
            for field in ("wait_p50_s", "wait_max_s", "ttft_p50_s", "flood_tok_s")
        }
        for v, rs in runs.items()
    }
    rows = [
        [
            v,
            f"{s['wait_p50_s']['median'] * 1000:.0f} ({s['wait_p50_s']['min'] * 1000:.0f}–"
            f"{s['wait_p50_s']['max'] * 1000:.0f})",
            f"{s['wait_max_s']['median'] * 1000:.0f} ({s['wait_max_s']['min'] * 1000:.0f}–"
            f"{s['wait_max_s']['max'] * 1000:.0f})",
            f"{s['ttft_p50_s']['median'] * 1000:.0f}",
            f"{s['flood_tok_s']['median']:.1f} ({s['flood_tok_s']['min']:.1f}–"
            f"{s['flood_tok_s']['max']:.1f})",
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
    text = "\n".join(markdown_table(headers, rows)) + "\n"
    print(text)
    report = {
        "machine": mark_end(machine),
        "model": args.model,
        "threads": args.threads,
        "flood": args.flood,
        "baseline": None if args.baseline is None else str(args.baseline),
        "interactive": INTERACTIVE,
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    out = write_report(Path(args.out), report, text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    labels = {
        "bands": "bands (interactive over batch)",
        "fifo": "one FIFO band",
        "baseline": "bands, baseline tree",
    }
    colors = {"bands": "#2a7", "fifo": "#999", "baseline": "#27a"}
    for i, variant in enumerate(variants):
        waits = [w * 1000 for x in runs[variant] for w in x["interactive_wait_s"]]
        ax.scatter(
            [i + random.uniform(-0.15, 0.15) for _ in waits], waits, color=colors[variant], s=12
        )
    ax.set_xticks(list(range(len(variants))), [labels[v] for v in variants])
    ax.set_yscale("log")
    ax.set_ylabel("interactive queue wait, ms (log)")
    ax.set_title(f"{INTERACTIVE} interactive jobs beside a {args.flood}-job batch flood")
    save_figure(fig, Path(args.plot))
    print(wrote(out, args.plot, report["wall_s"]))


if __name__ == "__main__":
    main()
