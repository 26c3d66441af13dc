"""Lower bands under an endless interactive flood: do batch jobs a worker pulled make
progress, and what share of the generated tokens does the batch band get?

Usage: python bench/band_share.py [--rounds 2] [--seconds 60] [--baseline TREE]
                                  [--model smollm2-135m-instruct]
                                  [--out bench/out/band_share.json]
                                  [--plot docs/img/band_share.png]

The issue's scenario: two real `tokenfleet worker`s (--max-active 4, one thread each:
the machine's two cores) through a redis-server this program starts. A feeder keeps
>= 20 interactive jobs (32-token prompts, 16 new tokens) waiting; once the band is
full, 10 batch jobs (48-token prompts, 256 new tokens) are submitted, and the flood goes
on for `--seconds`. Measured from Redis alone (the job hashes' `emitted`, the results):
batch jobs that made progress / finished, the batch band's share of generated tokens,
and interactive jobs finished per second. With `--baseline TREE` the same scenario runs
on workers imported from another checkout (its own prefix), rounds alternating.
"""

from __future__ import annotations

import random
import threading
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
    spread_cell,
    spreads,
)

from tokenfleet.local import LocalWorkers

BATCH = 10
BATCH_NEW = 256
INTERACTIVE_NEW = 16
DEPTH = 20
COLUMNS = {  # summary field: its column in the table
    "batch_progressed": "batch jobs progressed /10",
    "batch_finished": "finished",
    "batch_frozen_last_10s": "frozen (last 10 s)",
    "batch_share": "batch share of tokens",
    "interactive_finished_per_s": "interactive done /s",
}


def one_round(
    fleet: Fleet, workers: LocalWorkers, tag: str, seconds: float, seed: int
) -> dict[str, Any]:
    keys = workers.keys
    producer = fleet.producer(workers)
    client = producer.redis
    rng = random.Random(seed)
    stop = threading.Event()
    interactive = keys.jobs(None, "interactive")
    fed: list[str] = []

    def feed() -> None:
        feeder = fleet.producer(workers)
        frng = random.Random(seed + 1000)
        while not stop.is_set():
            if client.xlen(interactive) < DEPTH + 4:
                job_id = f"{tag}-int-{len(fed)}"
                feeder.submit(
                    random_request(job_id, 32, INTERACTIVE_NEW, frng, priority="interactive")
                )
                fed.append(job_id)
            else:
                stop.wait(0.01)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    if not wait_until(lambda: client.xlen(interactive) >= DEPTH, 300):
        raise TimeoutError("the feeder did not fill the interactive band")
    batch = [f"{tag}-batch-{i}" for i in range(BATCH)]
    for job_id in batch:
        producer.submit(random_request(job_id, 48, BATCH_NEW, rng, priority="batch"))
    started = time.perf_counter()
    emitted_at: dict[str, list[int]] = {j: [] for j in batch}
    while time.perf_counter() - started < seconds:
        for j in batch:
            emitted_at[j].append(int(client.hget(keys.job(j), "emitted") or 0))
        time.sleep(1.0)  # a sampling period, not a synchronisation
    wall = time.perf_counter() - started
    depth_at_end = int(client.xlen(interactive))
    stop.set()
    thread.join(timeout=10)
    batch_tokens = sum(int(client.hget(keys.job(j), "emitted") or 0) for j in batch)
    finished_int = 0
    int_tokens = 0
    for job_id in fed:
        state = client.hmget(keys.job(job_id), "status", "emitted", "started_at")
        int_tokens += int(state[1] or 0)
        finished_int += state[0] == b"finished"
    # drain what is left so the next round starts on an empty fleet
    for job_id in [*batch, *fed]:
        producer.handle(job_id).cancel()
    wait_until(lambda: not any(client.xlen(b.stream) for b in keys.bands(None)), 120, every_s=0.2)
    progressed = sum(1 for j in batch if emitted_at[j][-1] > 0)
    frozen = sum(
        1 for j in batch if len(set(emitted_at[j][-10:])) == 1 and emitted_at[j][-1] < BATCH_NEW
    )
    total = batch_tokens + int_tokens
    return {
        "wall_s": wall,
        "batch_progressed": progressed,
        "batch_finished": sum(1 for j in batch if emitted_at[j][-1] >= BATCH_NEW),
        "batch_frozen_last_10s": frozen,
        "batch_emitted": {j: emitted_at[j][-1] for j in batch},
        "batch_tokens": batch_tokens,
        "interactive_tokens": int_tokens,
        "batch_share": batch_tokens / total if total else 0.0,
        "interactive_finished_per_s": finished_int / wall,
        "interactive_depth_at_end": depth_at_end,
        "load": load_now(),
    }


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    with figure(path, figsize=(5.5, 3.5)) as ax:
        for i, rs in enumerate(runs.values()):
            shares = [x["batch_share"] for x in rs]
            ax.scatter([i] * len(shares), shares, s=20)
        ax.axhline(1 / 16, color="#999", linestyle="--", label="--band-share 1/16")
        ax.set_xticks(list(range(len(runs))), list(runs))
        ax.set_ylabel("batch band's share of generated tokens")
        ax.set_title("10 batch jobs beside an endless interactive flood")
        ax.legend()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--baseline", type=Path, default=None, help="another checkout")
    outputs(p, "band_share")
    args = p.parse_args()
    run = Run()
    log_dir = Path(args.out).parent / "band-share-logs"
    worker_args = ["--model", args.model, "--threads", "1", "--max-active", "4"]
    runs: dict[str, list[dict[str, Any]]] = {}
    with Fleet() as fleet:
        fleets = fleet.sides("bench-bands:", worker_args, args.baseline, log_dir)
        runs = {name: [] for name in fleets}
        for r in range(args.rounds):
            for name in abba(list(fleets), r):
                workers = fleets[name]  # started per round: an idle pair would share the cores
                names = [workers.start_one(f"{name.replace(' ', '-')}-r{r}-w{i}") for i in (1, 2)]
                workers.wait_live(names)
                got = one_round(fleet, workers, f"r{r}", args.seconds, seed=r)
                workers.drain()
                workers.procs.clear()
                runs[name].append(got)
                print(
                    f"round {r} {name:9s} batch progressed {got['batch_progressed']}/{BATCH} "
                    f"finished {got['batch_finished']} frozen {got['batch_frozen_last_10s']} "
                    f"share {got['batch_share']:.3f} "
                    f"interactive {got['interactive_finished_per_s']:.1f}/s "
                    f"load {got['load']['loadavg'][0]:.2f}",
                    flush=True,
                )
    summary = {name: spreads(rs, COLUMNS) for name, rs in runs.items()}
    rows = [[name] + [spread_cell(s[f]) for f in COLUMNS] for name, s in summary.items()]
    text = markdown_text(["workers", *COLUMNS.values()], rows)
    report = run.report(
        model=args.model,
        seconds=args.seconds,
        baseline=None if args.baseline is None else str(args.baseline),
        runs=runs,
        summary=summary,
    )
    run.finish(args, report, text, partial(plot, runs), table=text)


if __name__ == "__main__":
    main()
