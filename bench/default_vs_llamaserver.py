"""A real `tokenfleet worker` (through Redis, started as a user starts it) against
llama.cpp's `llama-server` on the same SmolLM2-135M-Instruct GGUF, the same 2 threads.

Usage: python bench/default_vs_llamaserver.py [--variants 'default=,int4=--quant int4']
           (the llama.cpp runner: --variants 'llamacpp=--runner llamacpp' --theirs q4_1;
           leading VAR=VALUE words set the worker's environment: 'old=TOKENFLEET_X=0')
           [--theirs q4_1,q8_0] [--rounds 3 (--quick: 1)] [--quick] [--llamacpp-bin DIR]
           [--multi STREAMS,PROMPT,NEW (default 8,32,128; e.g. 8,1024,128: long contexts)]
           [--also LABEL=DIR,... (the same files under other llama.cpp builds too)]
           [--out bench/out/default_vs_llamaserver.json]
           [--plot bench/out/default_vs_llamaserver.png]

Answers "the worker's default start ÷ llama-server Q4_1" (and ÷ Q8_0) for the workloads
of bench/vs_llamacpp.py (its `Settings` and `Workloads`, full size unless --quick):
  one    32 prompt + 256 new, greedy, eos ignored: generation tok/s, (new - 1) / (last
         token - first token), and end to end (tokens / (last token - submit));
  multi  8 x (32 + 128) at once: generated tokens / (last token - submit);
  mixed  vs_llamacpp's 16 mixed jobs at once (prompts 8-64, new 16-96): useful tok/s,
         TTFT p50 / p99 from the common submit time.
Both sides get the very same prompt token ids (llama-server's SSE chunks leave out
tokens of a not yet complete character: its streams are counted from its final
`timings.predicted_n`; a note says how many were left out). Every (round,
workload) draws fresh ids (same lengths as vs_llamacpp's jobs): the worker's prefix
cache, on by default, would otherwise serve repeated prompts from its cache
(llama-server runs with `cache_prompt: false`); the cached tokens the worker reports
are recorded as a check.

The tokenfleet side: one redis-server of this run's own (bench/_fleet.py's `Fleet`: a
free port, `--save '' --appendonly no`), one `tokenfleet worker --model
smollm2-135m-instruct --threads 2 FLAGS` per --variants entry, on a key prefix of its
own; jobs go in with `Producer.submit_many`, each followed by `JobHandle.stream()` in a
thread of its own, subscribed before the submit (bench/e2e.py's way). A worker counts as
loaded when its heartbeat hash exists (up to 600 s), then a small job and one untimed
pass of every workload warm it. The llama.cpp side: bench/_llamacpp.py's `Server`, one
`llama-server -np N` per file and workload (N = the workload's jobs), warmed the same way.

Sides started once, not per round: every worker and llama-server is started once and
kept for the whole run, and only one side generates at a time (rounds ABBA over all
sides). Measured on the 2-core machine this was written on: an idle worker (heartbeat
each second, blocking reads) used 0.15-0.2 % of a core, redis-server 0.2 %, an idle
llama-server 0 %: too little to perturb the side that runs, and restarting a worker per
round would time its start-up noise instead. Each run still records the CPU seconds the
idle sides used meanwhile (`idle_cpu` in the JSON; /proc counts them in 10 ms ticks), and
a note is written when they pass 1 % of the run's CPU and 0.05 s.

Before the rounds, each worker's greedy tokens are checked against each llama-server's
(4 fresh prompts x 64 tokens, one at a time; the server's whole `tokens` list):
`token_agreement` in the JSON, the same tokens expected of `--runner llamacpp` on the
same file.

Recorded too: lscpu's model name and SIMD flags, date, git commit, the load around each
round, and every field of each worker's heartbeat hash (its engine choices: dtype,
quant, compile ...) after warm-up and at the end. Prints a markdown table (median
(min–max) per side, ratios of medians), writes the JSON, a .md beside it and a PNG.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import random
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from _common import MODEL_CONFIGS, Job, Stream, requests
from _fleet import Fleet, follow
from _llamacpp import (
    CACHE,
    Server,
    completion_body,
    find_llamacpp,
    llamacpp_version,
    round_up,
)
from _rounds import abba
from report import (
    Run,
    figure,
    load_now,
    loadavg,
    markdown_table,
    num,
    parser,
    spread_cell,
    spread_errors,
)
from vs_llamacpp import THEIRS, Settings, Workloads, check_streams, gguf_file, metrics, summarize

from tokenfleet.local import LocalWorkers, cpu_seconds

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
THREADS = 2
VOCAB = int(MODEL_CONFIGS["smollm2-shape"]["vocab_size"])  # SmolLM2-135M's vocabulary
READY_S = 600.0  # a worker's load (and compile) may be slow
_ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=")
JOB_TIMEOUT_S = 600.0
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")
SCENARIOS = ("one", "multi", "mixed")
# (label, scenario, metric, scale, format): the table's rows
ROWS = [
    ("one stream: generation tok/s", "one", "decode_tok_s", 1.0, ".1f"),
    ("one stream: end-to-end tok/s", "one", "tok_s", 1.0, ".1f"),
    ("8 streams: aggregate tok/s", "multi", "tok_s", 1.0, ".1f"),
    ("mixed: useful tok/s", "mixed", "tok_s", 1.0, ".1f"),
    ("mixed: TTFT p50 ms (lower is better)", "mixed", "ttft_p50_s", 1000.0, ".0f"),
    ("mixed: TTFT p99 ms (lower is better)", "mixed", "ttft_p99_s", 1000.0, ".0f"),
]


def fresh(jobs: Sequence[Job], seed: int) -> list[Job]:
    """`jobs`' shapes (prompt lengths, new tokens) with new prompt ids drawn from `seed`."""
    rng = random.Random(seed)
    return [Job([rng.randrange(3, VOCAB) for _ in j.prompt_ids], j.max_new) for j in jobs]


def parse_variants(arg: str) -> dict[str, list[str]]:
    """'name=flags,name=flags' -> {name: shlex-split flags}."""
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in arg.split(",")):
        if not item:
            continue
        name, sep, flags = item.partition("=")
        if not sep or not name.strip() or name.strip() in out:
            sys.exit(f"--variants: '{item}' is not NAME=FLAGS with a new NAME")
        out[name.strip()] = shlex.split(flags)
    return out


# ---- the two kinds of side ------------------------------------------------------------


class WorkerSide:
    """One `tokenfleet worker` process on a key prefix of its own, fed through Redis."""

    def __init__(self, fleet: Fleet, name: str, flags: list[str], log_dir: Path) -> None:
        self.name = f"tokenfleet {name}"
        # leading VAR=VALUE words are the worker's environment, the rest its flags
        env = dict(f.split("=", 1) for f in itertools.takewhile(_ENV_WORD.match, flags))
        self.env = env
        self.args = ["--model", MODEL, "--threads", str(THREADS), *flags[len(env) :]]
        self.group: LocalWorkers = fleet.workers(f"bench-dvl-{name}:", self.args, log_dir=log_dir)
        start = time.perf_counter()
        (self.worker,) = self.group.start(1, name_prefix=f"dvl-{name}", env=env)
        self.group.wait_live(timeout=READY_S)
        self.ready_s = time.perf_counter() - start
        self.producer = fleet.producer(self.group)
        self.cached_tokens = 0  # prompt tokens its prefix cache served in timed runs

    def burst(self, scenario: str, jobs: Sequence[Job], tag: str) -> list[Stream]:
        reqs = requests(jobs, tag)
        followers = follow(self.producer, [r.job_id for r in reqs], JOB_TIMEOUT_S)
        t0 = time.perf_counter()
        for outcome in self.producer.submit_many(reqs):
            if not outcome.accepted or outcome.duplicate:
                raise RuntimeError(f"{self.name}: submit refused: {outcome}")
        streams = []
        for r, job in zip(reqs, jobs, strict=True):
            f = followers[r.job_id]
            streams.append(f.stream(t0, len(job.prompt_ids)))
            finish = f.handle.finish
            assert finish is not None
            streams[-1].stop_type = str(finish.reason)
            streams[-1].cached_tokens = finish.usage.cached_tokens
        return streams

    def heartbeat(self) -> dict[str, Any]:
        return dict(self.group.heartbeat(self.worker))

    def cpu_seconds(self) -> float:
        return float(sum(self.group.cpu_seconds().values()))

    def close(self) -> None:
        self.group.drain()


class ServerSide:
    """One GGUF file under llama-server: a server per workload, -np its job count."""

    def __init__(
        self, bin_dir: Path, name: str, path: Path, work: Workloads, build: str = ""
    ) -> None:
        self.name = f"llama-server {THEIRS[name].label(name)}" + (f" ({build})" if build else "")
        self.path = path
        self.servers: dict[str, Server] = {}
        self.held_back = 0  # tokens its streams left out (counted from their stop)
        try:
            for scenario, jobs in work.scenarios().items():
                ctx = round_up(max(len(j.prompt_ids) + j.max_new for j in jobs) + 16, 256)
                tag = f"-{build}" if build else ""
                log = CACHE / "logs" / f"dvl-llama-server-{name}{tag}-{scenario}.log"
                self.servers[scenario] = Server(bin_dir, path, THREADS, len(jobs), ctx, log)
        except BaseException:
            self.close()
            raise

    def burst(self, scenario: str, jobs: Sequence[Job], tag: str) -> list[Stream]:
        """The server's streams. Its SSE chunks leave out the tokens of a character not
        yet complete (byte tokens; seen with random prompts): `Server.stream` counts them
        from the server's final `predicted_n` (placeholders -1), and this adds them up."""
        streams = self.servers[scenario].burst(jobs)
        self.held_back += sum(s.held_back for s in streams)
        return streams

    def cpu_seconds(self) -> float:
        return sum(s.cpu_seconds() for s in self.servers.values())

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()


Side = WorkerSide | ServerSide


# ---- the run --------------------------------------------------------------------------


class Bench:
    def __init__(self, s: Settings, fleet: Fleet, log: Callable[[str], None]) -> None:
        self.s = s
        self.fleet = fleet
        self.log = log
        self.work = Workloads.make(s, VOCAB)
        self.sides: list[Side] = []
        self.notes: list[str] = []
        self.results: dict[str, dict[str, list[dict[str, Any]]]] = {k: {} for k in SCENARIOS}
        self.rounds: list[dict[str, Any]] = []
        self.idle_cpu: list[dict[str, Any]] = []

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            self.log(f"note: {message}")

    def others_cpu(self, side: Side) -> float:
        cpu = sum(o.cpu_seconds() for o in self.sides if o is not side)
        assert self.fleet.redis.pid is not None
        return cpu + (0.0 if isinstance(side, WorkerSide) else cpu_seconds(self.fleet.redis.pid))

    def run(self, side: Side, scenario: str, jobs: list[Job], tag: str, rnd: int | None) -> None:
        """One workload on one side; recorded unless `rnd` is None (warm-up)."""
        idle_before, start = self.others_cpu(side), time.perf_counter()
        streams = side.burst(scenario, jobs, tag)
        wall = time.perf_counter() - start
        idle = self.others_cpu(side) - idle_before
        where = "warm-up" if rnd is None else f"round {rnd}"
        for msg in check_streams(f"{side.name} {scenario} ({where})", jobs, streams):
            self.note(msg)
        for i, (job, s) in enumerate(zip(jobs, streams, strict=True)):
            if len(s.tokens) != job.max_new:
                self.note(f"{side.name} {scenario} ({where}) job {i}: stop {s.stop_type!r}")
        if rnd is None:
            return
        if isinstance(side, WorkerSide):
            side.cached_tokens += sum(s.cached_tokens or 0 for s in streams)
        share = idle / (wall * THREADS)
        self.idle_cpu.append(
            {
                "round": rnd,
                "side": side.name,
                "scenario": scenario,
                "idle_sides_cpu_s": idle,
                "share_of_run_cpu": share,
            }
        )
        if share > 0.01 and idle > 0.05:  # /proc counts CPU time in 10 ms ticks
            self.note(
                f"round {rnd}: the idle sides used {share:.1%} of the CPU during "
                f"{side.name} {scenario}"
            )
        self.results[scenario].setdefault(side.name, []).append({"round": rnd, **metrics(streams)})

    def jobs(self, scenario: str, seed: int) -> list[Job]:
        return fresh(self.work.scenarios()[scenario], seed)

    def warm_up(self, side: Side) -> None:
        side.burst("one", fresh(self.work.warm[:1], 98), f"warm-{len(self.sides)}")
        for i, scenario in enumerate(SCENARIOS):
            self.run(side, scenario, self.jobs(scenario, 99 + i), f"warm-{scenario}", None)

    def run_rounds(self, rounds: int) -> None:
        for rnd in range(rounds):
            order = abba(self.sides, rnd)
            at_start, start = load_now(), time.perf_counter()
            for side in order:
                for i, scenario in enumerate(SCENARIOS):
                    # fresh ids per round and workload, the same for every side
                    jobs = self.jobs(scenario, 1000 + 10 * rnd + i)
                    self.run(side, scenario, jobs, f"r{rnd}-{scenario}", rnd)
            entry = {
                "round": rnd,
                "order": [s.name for s in order],
                "seconds": time.perf_counter() - start,
                "load_start": at_start,
                "load_end": load_now(),
            }
            self.rounds.append(entry)
            self.log(
                f"round {rnd + 1}/{rounds}: {entry['seconds']:.0f} s, load "
                f"{at_start['loadavg'][0]:.2f} -> {loadavg()[0]:.2f}"
            )


# ---- facts, summaries, output ---------------------------------------------------------


def cpu_facts() -> dict[str, Any]:
    """lscpu's model name and which of CPU_FLAGS it lists."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"error": str(exc)}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {
        "model_name": fields.get("Model name", "").strip(),
        "cpus": fields.get("CPU(s)", "").strip(),
        "flags": {f: f in flags for f in CPU_FLAGS},
    }


def git_state() -> dict[str, Any]:
    """HEAD's commit and the paths that differ from it (the worker runs this tree)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    return {
        "commit": git("rev-parse", "HEAD").strip() or None,
        "uncommitted": git("status", "--porcelain").splitlines(),
    }


def ratios(summary: dict[str, Any], ours: list[str], theirs: list[str]) -> dict[str, Any]:
    """{ours ÷ theirs: {row label: ratio of medians}} (TTFT too: < 1 is ours sooner)."""
    out: dict[str, Any] = {}
    for a in ours:
        for b in theirs:
            row = {}
            for label, scenario, metric, _, _ in ROWS:
                try:
                    mine = summary[scenario][a][metric]["median"]
                    row[label] = mine / summary[scenario][b][metric]["median"]
                except (KeyError, ZeroDivisionError):
                    row[label] = float("nan")
            out[f"{a} ÷ {b}"] = row
    return out


def render(report: dict[str, Any]) -> list[str]:
    summary, sides = report["summary"], report["sides"]
    header = ["workload", *sides, *report["ratios"]]
    rows = []
    for label, scenario, metric, scale, fmt in ROWS:
        cells = []
        for side in sides:
            m = summary.get(scenario, {}).get(side, {}).get(metric)
            cells.append(spread_cell(m, fmt, scale) if m else "n/a")
        cells += [
            num(r[label], ".2f") + ("" if r[label] != r[label] else "x")
            for r in report["ratios"].values()
        ]
        rows.append([label, *cells])
    s = report["settings"]
    lines = [
        f"SmolLM2-135M-Instruct, {THREADS} threads, {len(report['rounds'])} round(s); one: "
        f"{s['one'][0]}+{s['one'][1]}, multi: {s['multi'][0]}x({s['multi'][1]}+"
        f"{s['multi'][2]}), mixed: {s['mixed_n']} jobs; median (min–max) over rounds",
        "",
        *markdown_table(header, rows),
        "",
        *(
            f"round {r['round'] + 1}: {r['seconds']:.0f} s, load "
            f"{r['load_start']['loadavg'][0]:.2f} -> {r['load_end']['loadavg'][0]:.2f}"
            for r in report["rounds"]
        ),
    ]
    agree = report.get("token_agreement", {})
    pairs = {k: v for k, v in agree.items() if isinstance(v, dict)}
    if pairs:
        lines += [
            "",
            f"greedy tokens against llama-server ({agree['jobs']} jobs x {agree['new']}):",
        ]
        lines += [
            f"- {pair}: {v['same']}/{agree['jobs']} the same; first differences "
            f"{v['first_difference']}"
            for pair, v in pairs.items()
        ]
    if report["notes"]:
        lines += ["", "notes:", *(f"- {n}" for n in report["notes"])]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    summary = report["summary"]
    panels = [(label, scenario, metric, scale) for label, scenario, metric, scale, _ in ROWS]
    with figure(path, 2, 3, figsize=(18, 8)) as axes:
        for ax, (label, scenario, metric, scale) in zip(axes.flat, panels, strict=True):
            sides = [k for k in report["sides"] if metric in summary[scenario].get(k, {})]
            stats = [
                {k: v * scale for k, v in summary[scenario][k][metric].items() if k != "n"}
                for k in sides
            ]
            med, errors = spread_errors(stats)
            colors = ["C0" if k.startswith("tokenfleet") else "C1" for k in sides]
            bars = ax.barh(sides, med, xerr=errors, color=colors, capsize=3)
            ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=4)
            ax.invert_yaxis()
            ax.set_title(label, fontsize=10)
            ax.grid(axis="x", alpha=0.3)
        ax.figure.suptitle(
            f"tokenfleet worker (through Redis) vs llama-server, SmolLM2-135M-Instruct, "
            f"{THREADS} threads, {len(report['rounds'])} round(s), median and min–max"
            + (" (quick)" if report["quick"] else ""),
            fontsize=11,
        )


def token_agreement(bench: Bench, seed: int, n: int = 4, new: int = 64) -> dict[str, Any]:
    """Greedy tokens of each worker against each llama-server, `n` jobs of the `one`
    workload's prompt length (fresh ids), one at a time: how many are the same tokens,
    and where the others first differ (the server's whole `tokens` list, not its stream)."""
    prompt_len = len(bench.work.one[0].prompt_ids)
    jobs = fresh([Job([0] * prompt_len, new)] * n, seed)
    servers = [s for s in bench.sides if isinstance(s, ServerSide)]
    theirs = {
        s.name: [
            [
                int(t)
                for t in s.servers["one"].post("/completion", completion_body(j.prompt_ids, new))[
                    "tokens"
                ]
            ]
            for j in jobs
        ]
        for s in servers
    }
    out: dict[str, Any] = {"jobs": n, "new": new, "lines": []}
    for w in (s for s in bench.sides if isinstance(s, WorkerSide)):
        ours = [w.burst("one", [j], f"agree-{seed}-{i}")[0].tokens for i, j in enumerate(jobs)]
        for name, want in theirs.items():
            firsts = [
                next((k for k, (a, b) in enumerate(zip(o, t, strict=False)) if a != b), None)
                for o, t in zip(ours, want, strict=True)
            ]
            same = sum(o == t for o, t in zip(ours, want, strict=True))
            out[f"{w.name} vs {name}"] = {"same": same, "first_difference": firsts}
            out["lines"].append(
                f"greedy tokens, {w.name} vs {name}: {same}/{n} jobs the same "
                f"(first differences at {firsts})"
            )
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--variants",
        default="default=",
        help="NAME=WORKER-FLAGS,... (e.g. 'default=,int4=--quant int4')",
    )
    p.add_argument("--theirs", default="q4_1,q8_0", help=f"of {', '.join(THEIRS)}")
    p.add_argument("--rounds", type=int, help="default 3 (--quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny lengths, 1 round (< 3 min)")
    p.add_argument("--llamacpp-bin", help="llama.cpp bin dir (default: build_llamacpp.sh)")
    p.add_argument(
        "--also",
        default="",
        help="LABEL=BIN-DIR,...: the same files under each other build's llama-server too, "
        "as sides of the same run (e.g. 'no-openmp=/path/to/build-noomp/bin')",
    )
    p.add_argument("--multi", default="", help="STREAMS,PROMPT,NEW of the multi workload")
    p.add_argument("--out", default="bench/out/default_vs_llamaserver.json")
    p.add_argument("--plot", default="bench/out/default_vs_llamaserver.png")
    args = p.parse_args()
    variants = parse_variants(args.variants)
    theirs = [n.strip() for n in args.theirs.split(",") if n.strip()]
    if not variants or not theirs or any(n not in THEIRS for n in theirs):
        sys.exit(f"need --variants and --theirs (of {', '.join(THEIRS)})")
    also = dict(entry.split("=", 1) for entry in args.also.split(",") if entry.strip())
    settings = Settings.quick() if args.quick else Settings.full()
    if args.multi:
        streams, prompt, new = (int(x) for x in args.multi.split(","))
        settings = dataclasses.replace(settings, multi=(streams, prompt, new))
    rounds = args.rounds or (1 if args.quick else 3)

    run = Run()
    log = run.log
    bin_dir, why = find_llamacpp(args.llamacpp_bin, log)
    if bin_dir is None:
        sys.exit(f"no llama.cpp: {why}")
    version = llamacpp_version(bin_dir)
    files = {n: gguf_file(n, bin_dir, log) for n in theirs}
    log_dir = CACHE / "logs" / "dvl-workers"
    inherited = {k: v for k, v in os.environ.items() if k.startswith("TOKENFLEET_")}
    beats: dict[str, Any] = {}
    with Fleet() as fleet:
        bench = Bench(settings, fleet, log)
        if inherited:
            bench.note(f"the workers inherit {inherited}: not quite a default start")
        try:
            for name, flags in variants.items():
                log(f"starting tokenfleet worker {name}: {shlex.join(flags) or '(defaults)'}")
                worker = WorkerSide(fleet, name, flags, log_dir)
                bench.sides.append(worker)
                log(f"{worker.name}: joined after {worker.ready_s:.1f} s; warming up")
                bench.warm_up(worker)
                beats[worker.name] = {
                    "args": worker.args,
                    "env": worker.env,
                    "ready_s": worker.ready_s,
                    "heartbeat_after_warm_up": worker.heartbeat(),
                }
            builds = [("", bin_dir), *((b, Path(d)) for b, d in also.items())]
            for (build, folder), (name, path) in itertools.product(builds, files.items()):
                server = ServerSide(folder, name, path, bench.work, build)
                bench.sides.append(server)
                log(f"{server.name}: up ({path.name}); warming up")
                bench.warm_up(server)
            agreement = token_agreement(bench, seed=4242)
            for line in agreement.pop("lines"):
                log(line)
            bench.run_rounds(rounds)
            for side in bench.sides:
                if isinstance(side, ServerSide) and side.held_back:
                    bench.note(
                        f"{side.name}: its streams left out {side.held_back} tokens (parts "
                        "of a character; counted all the same from the stop at n_predict)"
                    )
                if isinstance(side, WorkerSide):
                    beats[side.name]["heartbeat_end"] = side.heartbeat()
                    beats[side.name]["cached_tokens_in_timed_runs"] = side.cached_tokens
                    if side.cached_tokens:
                        bench.note(
                            f"{side.name}: its prefix cache served {side.cached_tokens} "
                            "prompt tokens in the timed runs"
                        )
        finally:
            for each in bench.sides:
                each.close()
    ours = [s.name for s in bench.sides if isinstance(s, WorkerSide)]
    others = [s.name for s in bench.sides if isinstance(s, ServerSide)]
    summary = summarize(bench.results)
    report = run.report(
        quick=args.quick,
        threads=THREADS,
        cpu=cpu_facts(),
        git=git_state(),
        settings=asdict(settings),
        sides=[*ours, *others],
        workers=beats,
        llamacpp={
            "bin": str(bin_dir),
            "also": also,
            "version": version,
            "files": {n: {"path": str(f), "bytes": f.stat().st_size} for n, f in files.items()},
        },
        rounds=bench.rounds,
        token_agreement=agreement,
        idle_cpu=bench.idle_cpu,
        measurements=bench.results,
        summary=summary,
        ratios=ratios(summary, ours, others),
        notes=bench.notes,
    )
    draw = None
    if importlib.util.find_spec("matplotlib") is None:
        report["notes"].append("matplotlib is not installed: no plot")
    else:
        draw = partial(plot, report)
    markdown = "\n".join(render(report)) + "\n"
    run.finish(args, report, markdown, draw, table=markdown)


if __name__ == "__main__":
    main()
