"""What the fleet costs one stream: the default start's engine stepped in this process
against a real `tokenfleet worker` through Redis, the same model, 2 threads, one run.

Usage: python bench/redis_overhead.py [--rounds 3] [--new 256] [--threads 2]
           [--runner torch|llamacpp] [--streams 1]
           [--workers 'via Redis=,spin 30k=GOMP_SPINCOUNT=30000']
           [--out bench/out/redis_overhead.json] [--plot docs/img/redis_overhead.png]

One stream of 32 prompt + `--new` tokens, greedy, eos ignored, fresh prompt ids each
time; generation tok/s = (tokens - 2) / (last token - second token) on both sides.
`--streams N` runs N such jobs at once (submitted together, each followed on a thread of
its own through Redis) and reports their rates' sum, the aggregate generation tok/s:

  in process   the worker's own model set-up (`worker.main.torch_model`: the engine
               plan, its probe and compile; with `--runner llamacpp` the worker's
               llama.cpp runner on the preset's GGUF, sized as the worker sizes it) and
               `Engine.step` until the job ends;
  via Redis    `tokenfleet worker --model M --threads T [--runner R]` (bench/_timed_worker.py: the
               same worker with its loop's phases timed) on a redis-server of this
               run's own, the job submitted with `Producer.submit` and followed with
               `JobHandle.stream()`, as a client does.

`--workers` starts one worker per entry, NAME=ENV FLAGS (space-separated VAR=VALUE pairs set
in that worker's environment only, e.g. OpenMP's, then worker flags, e.g. `--no-overlap`),
each on a key prefix of its own.
Rounds alternate the sides (ABBA). After the rounds each worker drains and reports its
loop's wall time per tick: the engine's step, sending the tick's round trip (fenced
writes, the read of what comes next), applying the last one's replies, and admitting;
and each phase's CPU time on the loop's thread ("cpu PHASE"): where wall exceeds CPU
outside the step, the loop was off its core (another process ran there).
The difference between the sides is what the scheduler's Redis loop, redis-server and
the client cost a stream on these cores.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _rounds import abba
from report import (
    figure,
    loadavg,
    machine_info,
    mark_end,
    outputs,
    parser,
    spread,
    spread_errors,
    write_json,
)

from tokenfleet.local import RedisServer
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest, SamplingParams

MODEL = "smollm2-135m-instruct"
HERE = Path(__file__).resolve().parent


def request(rng: random.Random, new: int) -> GenerationRequest:
    return GenerationRequest(
        job_id=f"overhead-{rng.getrandbits(48):x}",
        prompt_ids=[rng.randrange(100, 40_000) for _ in range(32)],
        max_new_tokens=new,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0),
    )


def rate(stamps: list[float]) -> float:
    return (len(stamps) - 2) / (stamps[-1] - stamps[1])


def in_process(threads: int, runner: str) -> Callable[[list[GenerationRequest]], float]:
    from tokenfleet.config.worker import WorkerSettings
    from tokenfleet.model.build import LoadedModel
    from tokenfleet.seam import ModelRunner
    from tokenfleet.worker.engine import Engine
    from tokenfleet.worker.main import engine_config, llamacpp_model, torch_model

    settings = WorkerSettings(model=MODEL, threads=threads, runner=runner)
    config = engine_config(settings)
    model: ModelRunner | LoadedModel
    if runner == "llamacpp":
        model, _, _ = llamacpp_model(settings, config)
    else:
        model, _, _ = torch_model(settings)
    engine = Engine(model, config)

    def run(reqs: list[GenerationRequest]) -> float:
        assert all(engine.submit(req).accepted for req in reqs)
        stamps: dict[str, list[float]] = {req.job_id: [] for req in reqs}
        while engine.has_work:
            out = engine.step()
            now = time.perf_counter()
            for job_id in {t.job_id for t in out.tokens}:
                stamps[job_id].append(now)
        return sum(rate(s) for s in stamps.values())

    return run


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runner", choices=("torch", "llamacpp"), default="torch")
    p.add_argument("--streams", type=int, default=1, help="jobs at once (aggregate tok/s)")
    p.add_argument("--workers", default="via Redis=")
    outputs(p, "redis_overhead")
    args = p.parse_args()
    machine = machine_info()
    rng = random.Random(0)
    server = RedisServer.launch()
    tmp = Path(tempfile.mkdtemp())
    envs = dict(entry.split("=", 1) for entry in args.workers.split(","))
    workers: dict[str, tuple[subprocess.Popen[bytes], Producer, Path]] = {}
    try:
        for n, (name, extra) in enumerate(envs.items()):
            timings = tmp / f"phases-{n}.json"
            env = dict(os.environ, TIMED_WORKER_OUT=str(timings))
            words = extra.split()  # leading VAR=VALUE words: its environment; the rest: flags
            own = list(itertools.takewhile(lambda w: not w.startswith("-") and "=" in w, words))
            env.update(pair.split("=", 1) for pair in own)
            prefix = f"overhead{n}"
            cmd = [sys.executable, str(HERE / "_timed_worker.py"), "worker"]
            cmd += ["--redis-url", server.url, "--prefix", prefix, "--name", prefix]
            cmd += ["--model", MODEL, "--threads", str(args.threads), "--runner", args.runner]
            cmd += words[len(own) :]
            log = open(tmp / f"worker-{n}.log", "w")  # noqa: SIM115 (kept to the end)
            proc = subprocess.Popen(cmd, env=env, stderr=log, stdout=log)
            workers[name] = (proc, Producer.from_url(server.url, prefix=prefix), timings)
        local = in_process(args.threads, args.runner)  # loads while the workers load
        for n, (name, (proc, producer, _)) in enumerate(workers.items()):
            while not producer.redis.exists(producer.keys.worker(f"overhead{n}")):
                if proc.poll() is not None:
                    raise SystemExit(f"worker {name!r} exited: see {tmp}")
                time.sleep(0.5)

        def via(producer: Producer) -> Callable[[list[GenerationRequest]], float]:
            def run(reqs: list[GenerationRequest]) -> float:
                handles = [producer.submit(req) for req in reqs]
                stamps: list[list[float]] = [[] for _ in reqs]

                def follow(i: int) -> None:
                    stamps[i] = [time.perf_counter() for _ in handles[i].stream()]

                threads = [threading.Thread(target=follow, args=(i,)) for i in range(len(reqs))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return sum(rate(s) for s in stamps)

            return run

        def jobs(new: int) -> list[GenerationRequest]:
            return [request(rng, new) for _ in range(args.streams)]

        sides: dict[str, Callable[[list[GenerationRequest]], float]] = {"in process": local}
        sides.update({name: via(producer) for name, (_, producer, _) in workers.items()})
        for run in sides.values():  # warm-up
            run(jobs(16))
        rates: dict[str, list[float]] = {name: [] for name in sides}
        loads = []
        for r in range(args.rounds):
            for name in abba(list(sides), r):
                rates[name].append(sides[name](jobs(args.new)))
                loads.append(loadavg()[0])
                print(f"round {r} {name:11} {rates[name][-1]:6.1f} tok/s", flush=True)
    finally:
        for proc, producer, _ in workers.values():
            proc.terminate()
            proc.wait(120)
            producer.redis.close()
        server.stop()
    per_tick: dict[str, dict[str, float]] = {}
    for name, (_, _, timings) in workers.items():
        phases = json.loads(timings.read_text())
        ticks = phases["tick"][1]
        per_tick[name] = {phase: 1000 * s / ticks for phase, (s, _) in phases.items()}
        for prefix in ("", "cpu "):
            per_tick[name][f"{prefix}loop outside the step"] = (
                per_tick[name][f"{prefix}iteration"] - per_tick[name][f"{prefix}tick"]
            )
        per_tick[name]["ticks"] = ticks
    medians = {name: spread(v)["median"] for name, v in rates.items()}
    report: dict[str, Any] = {
        "model": MODEL,
        "threads": args.threads,
        "runner": args.runner,
        "new_tokens": args.new,
        "streams": args.streams,
        "rounds": args.rounds,
        "workers": envs,
        "tok_s": {name: spread(v) for name, v in rates.items()},
        "ratio_to_in_process": {n: m / medians["in process"] for n, m in medians.items()},
        "worker_ms_per_tick": per_tick,
        "load_1min": spread(loads),
        "machine": mark_end(machine),
    }
    for name, row in report["tok_s"].items():
        ratio = report["ratio_to_in_process"][name]
        print(
            f"{name:12} {row['median']:6.1f} ({row['min']:.1f}-{row['max']:.1f}) tok/s, "
            f"{ratio:.3f}x in process"
        )
    for name, phases in per_tick.items():
        print(f"{name}: worker ms per tick", {k: round(v, 3) for k, v in phases.items()})
    write_json(Path(args.out), report)
    with figure(Path(args.plot), 1, 1, figsize=(2 + 1.5 * len(rates), 3.5)) as ax:
        bars, err = spread_errors([report["tok_s"][n] for n in rates])
        ax.bar(list(rates), bars, yerr=err, capsize=4)
        ax.set_ylabel(f"generation tok/s ({args.streams} stream(s), summed)")
        ax.set_title(f"{MODEL}, {args.runner} runner, {args.threads} threads")


if __name__ == "__main__":
    main()
