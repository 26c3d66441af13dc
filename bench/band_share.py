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

import argparse
import random
import threading
import time
from pathlib import Path
from typing import Any

import redis
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

from tokenfleet.local import EmbeddedRedis, LocalWorkers
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

BATCH = 10
BATCH_NEW = 256
INTERACTIVE_NEW = 16
DEPTH = 20


def job(job_id: str, priority: str, prompt: int, new: int, rng: random.Random) -> GenerationRequest:
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=[rng.randrange(1000, 20000) for _ in range(prompt)],
        max_new_tokens=new,
        ignore_eos=True,
        priority=priority,  # type: ignore[arg-type]
    )


def one_round(
    url: str, workers: LocalWorkers, tag: str, seconds: float, seed: int
) -> dict[str, Any]:
    keys = workers.keys
    client = redis.Redis.from_url(url)
    producer = Producer(client, keys=keys, default_cap=10_000)
    rng = random.Random(seed)
    stop = threading.Event()
    interactive = keys.jobs(None, "interactive")
    fed: list[str] = []

    def feed() -> None:
        feeder = Producer(redis.Redis.from_url(url), keys=keys, default_cap=10_000)
        frng = random.Random(seed + 1000)
        while not stop.is_set():
            if client.xlen(interactive) < DEPTH + 4:
                job_id = f"{tag}-int-{len(fed)}"
                feeder.submit(job(job_id, "interactive", 32, INTERACTIVE_NEW, frng))
                fed.append(job_id)
            else:
                stop.wait(0.01)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    while client.xlen(interactive) < DEPTH:
        time.sleep(0.01)
    batch = [f"{tag}-batch-{i}" for i in range(BATCH)]
    for job_id in batch:
        producer.submit(job(job_id, "batch", 48, BATCH_NEW, rng))
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
    for j in batch:
        producer.handle(j).cancel()
    for job_id in fed:
        producer.handle(job_id).cancel()
    deadline = time.monotonic() + 120
    while any(client.xlen(s) for s in keys.bands(None)) and time.monotonic() < deadline:
        time.sleep(0.2)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--out", default="bench/out/band_share.json")
    parser.add_argument("--plot", default="docs/img/band_share.png")
    args = parser.parse_args()
    machine = machine_info()
    t0 = time.perf_counter()
    embedded = EmbeddedRedis.start()
    log_dir = Path(args.out).parent / "band-share-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_args = ["--model", args.model, "--threads", "1", "--max-active", "4"]
    fleets = {"this tree": LocalWorkers(embedded.url, "bench-bands:", worker_args, log_dir=log_dir)}
    if args.baseline is not None:
        tree = args.baseline.resolve()
        fleets["baseline"] = LocalWorkers(
            embedded.url,
            "bench-bands-base:",
            worker_args,
            log_dir=log_dir,
            env={"PYTHONPATH": str(tree)},
            cwd=tree,
        )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in fleets}
    try:
        for r in range(args.rounds):
            order = list(fleets) if r % 2 == 0 else list(fleets)[::-1]
            for name in order:
                fleet = fleets[name]  # started per round: an idle pair would share the cores
                names = [fleet.start_one(f"{name.replace(' ', '-')}-r{r}-w{i}") for i in (1, 2)]
                fleet.wait_live(names)
                got = one_round(embedded.url, fleet, f"r{r}", args.seconds, seed=r)
                fleet.drain()
                fleet.procs.clear()
                runs[name].append(got)
                print(
                    f"round {r} {name:9s} batch progressed {got['batch_progressed']}/{BATCH} "
                    f"finished {got['batch_finished']} frozen {got['batch_frozen_last_10s']} "
                    f"share {got['batch_share']:.3f} "
                    f"interactive {got['interactive_finished_per_s']:.1f}/s "
                    f"load {got['load']['loadavg'][0]:.2f}",
                    flush=True,
                )
    finally:
        for fleet in fleets.values():
            fleet.drain()
        embedded.stop()
    fields = (
        "batch_progressed",
        "batch_finished",
        "batch_frozen_last_10s",
        "batch_share",
        "interactive_finished_per_s",
    )
    summary = {name: {f: spread([x[f] for x in rs]) for f in fields} for name, rs in runs.items()}
    rows = [
        [name] + [f"{s[f]['median']:.3g} ({s[f]['min']:.3g}–{s[f]['max']:.3g})" for f in fields]
        for name, s in summary.items()
    ]
    headers = [
        "workers",
        "batch jobs progressed /10",
        "finished",
        "frozen (last 10 s)",
        "batch share of tokens",
        "interactive done /s",
    ]
    text = "\n".join(markdown_table(headers, rows)) + "\n"
    print(text)
    report = {
        "machine": mark_end(machine),
        "model": args.model,
        "seconds": args.seconds,
        "baseline": None if args.baseline is None else str(args.baseline),
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - t0,
    }
    out = write_report(Path(args.out), report, text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for i, rs in enumerate(runs.values()):
        shares = [x["batch_share"] for x in rs]
        ax.scatter([i] * len(shares), shares, s=20)
    ax.axhline(1 / 16, color="#999", linestyle="--", label="--band-share 1/16")
    ax.set_xticks(list(range(len(runs))), list(runs))
    ax.set_ylabel("batch band's share of generated tokens")
    ax.set_title("10 batch jobs beside an endless interactive flood")
    ax.legend()
    save_figure(fig, Path(args.plot))
    print(wrote(out, args.plot, report["wall_s"]))


if __name__ == "__main__":
    main()
