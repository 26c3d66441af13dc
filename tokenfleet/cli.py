"""The `tokenfleet` command line. Settings and flags are read here, at the edge, only."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from tokenfleet.config import Settings
from tokenfleet.errors import TokenfleetError
from tokenfleet.gateway.command import gateway as gateway_command
from tokenfleet.keys import Keys

app = typer.Typer(
    name="tokenfleet",
    help="A fleet of continuous-batching LLM workers coordinated through Redis.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

RedisUrl = Annotated[
    str | None,
    typer.Option("--redis-url", help="Redis URL (default: $REDIS_URL or redis://127.0.0.1:6379/0)"),
]
Prefix = Annotated[str | None, typer.Option("--prefix", help="key prefix of the fleet")]
Model = Annotated[str | None, typer.Option("--model", help="model name (one jobs stream each)")]


def settings(redis_url: str | None = None, prefix: str | None = None) -> Settings:
    """Environment settings, with any flags given on the command line taking precedence."""
    overrides: dict[str, str] = {}
    if redis_url:
        overrides["redis_url"] = redis_url
    if prefix:
        overrides["prefix"] = prefix
    return Settings().model_copy(update=overrides)


def fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command("queue-cap")
def queue_cap(
    cap: Annotated[int | None, typer.Argument(help="new cap; omit to show the current one")] = None,
    model: Model = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Show or set the jobs stream's cap (shared by every producer, in any language)."""
    from tokenfleet.producer import Producer

    conf = settings(redis_url, prefix)
    producer = Producer.from_url(conf.redis_url, prefix=conf.prefix, default_cap=conf.queue_cap)
    if cap is not None:
        if cap < 1:
            raise fail("the cap must be at least 1")
        producer.set_queue_cap(cap, model)
    typer.echo(
        f"{Keys(conf.prefix).jobs(model)}: cap {producer.queue_cap(model)}, "
        f"depth {producer.depth(model)}"
    )


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="prompt text")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", "-t")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="stop string (repeatable)")
    ] = None,
    job_id: Annotated[str | None, typer.Option("--job-id")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON event per line")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="print only the final result")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds of silence allowed")] = 120.0,
    model: Model = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Submit one job and stream its tokens to stdout."""
    from tokenfleet.producer import Producer

    conf = settings(redis_url, prefix)
    producer = Producer.from_url(conf.redis_url, prefix=conf.prefix, default_cap=conf.queue_cap)
    fields: dict[str, object] = {
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
        "stop": stop or [],
        "model": model,
    }
    if job_id:
        fields["job_id"] = job_id
    try:
        handle = producer.submit(**fields)
        if wait:
            result = handle.result(timeout=timeout)
            if as_json:
                typer.echo(result.model_dump_json())
            else:
                typer.echo(result.text)
                typer.echo(
                    f"[{result.finish_reason}: {result.usage.completion_tokens} tokens]", err=True
                )
            return
        for event in handle.stream(timeout=timeout):
            if as_json:
                typer.echo(event.model_dump_json())
            else:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        finish = handle.finish
        assert finish is not None
        if as_json:
            typer.echo(finish.model_dump_json())
        else:
            sys.stdout.write("\n")
            detail = f" ({finish.error.reason}: {finish.error.message})" if finish.error else ""
            typer.echo(f"[{finish.reason}{detail}]", err=True)
    except TokenfleetError as exc:
        raise fail(str(exc)) from None


@app.command()
def worker(
    model: Annotated[
        str, typer.Option("--model", help="preset (tiny-random) or checkpoint folder")
    ] = "tiny-random",
    model_name: Annotated[
        str | None,
        typer.Option("--model-name", help="jobs naming this model are served (default stream)"),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    kv_mb: Annotated[int, typer.Option("--kv-mb", help="KV cache budget, MiB")] = 256,
    max_batch: Annotated[int, typer.Option("--max-batch", help="decode sessions per tick")] = 32,
    max_active: Annotated[int, typer.Option("--max-active", help="sessions holding KV")] = 64,
    prefill_tokens: Annotated[
        int, typer.Option("--prefill-tokens", help="prefill tokens per tick")
    ] = 256,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="local waiting list")] = 4,
    name: Annotated[str | None, typer.Option("--name", help="worker name (unique)")] = None,
    burst: Annotated[
        bool, typer.Option("--burst", help="exit 0 once the stream is empty and nothing runs")
    ] = False,
    max_deliveries: Annotated[int, typer.Option("--max-deliveries")] = 3,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="seconds")] = 30.0,
    overlap: Annotated[
        bool,
        typer.Option(
            "--overlap/--no-overlap",
            help="read each tick's Redis replies after the next forward pass (default)",
        ),
    ] = True,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads")] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="serve Prometheus metrics on this port")
    ] = None,
    fault_key: Annotated[
        str | None,
        typer.Option(
            "--inject-fault-on-metadata",
            hidden=True,
            help="tests only: fail the forward of jobs whose metadata has this key",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Serve jobs from the fleet's stream with one continuous-batching engine."""
    import signal

    # A signal while torch and the model load: nothing is held yet, so leave cleanly.
    # The worker's own drain-then-stop handlers replace this once it runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    import logging
    import platform

    import redis
    import torch

    from tokenfleet.model import load_model
    from tokenfleet.worker.engine import Engine, EngineConfig
    from tokenfleet.worker.loop import Worker, WorkerOptions, default_worker_name
    from tokenfleet.worker.session import Session

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    conf = settings(redis_url, prefix)
    if threads:
        torch.set_num_threads(threads)
    try:
        loaded = load_model(model, dtype=dtype, device=device)
    except TokenfleetError as exc:
        raise fail(str(exc)) from None

    def inject(session: Session) -> None:
        if fault_key is not None and fault_key in session.request.metadata:
            raise RuntimeError(f"injected fault (metadata key {fault_key!r})")

    worker_name = name or default_worker_name()
    config = EngineConfig(
        kv_budget_bytes=kv_mb * 1024 * 1024,
        max_active=max_active,
        max_batch_size=max_batch,
        max_prefill_tokens_per_tick=prefill_tokens,
        max_waiting=max_waiting,
    )
    try:
        engine = Engine(
            loaded, config, worker=worker_name, fault=inject if fault_key is not None else None
        )
    except ValueError as exc:
        raise fail(f"invalid budget: {exc}") from None
    options = WorkerOptions(
        name=worker_name,
        model=model_name,
        burst=burst,
        max_deliveries=max_deliveries,
        drain_timeout_s=drain_timeout,
        overlap=overlap,
        info={
            "model": model_name or "default",
            "checkpoint": model,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "host": platform.node(),
        },
    )
    metrics = None
    if metrics_port is not None:
        from tokenfleet.worker.metrics import WorkerMetrics

        metrics = WorkerMetrics(worker_name, model_name or "default")
        metrics.serve(metrics_port)
    client = redis.Redis.from_url(conf.redis_url, socket_timeout=10, health_check_interval=5)
    runner = Worker(engine, client, Keys(conf.prefix), options, metrics)
    runner.install_signal_handlers()
    raise typer.Exit(code=runner.run())


@app.command()
def demo(
    jobs: Annotated[int, typer.Option("--jobs", help="how many jobs to submit")] = 24,
    workers: Annotated[int, typer.Option("--workers", help="worker processes")] = 2,
    producers: Annotated[int, typer.Option("--producers", help="producer threads")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 160,
    live: Annotated[bool, typer.Option("--live/--no-live", help="live view or plain lines")] = True,
    redis_url: Annotated[
        str | None, typer.Option("--redis-url", help="use this Redis instead of an embedded one")
    ] = None,
    prefix: Prefix = None,
) -> None:
    """Run a whole fleet locally: embedded Redis, workers, producers, a live view."""
    from tokenfleet.demo import run_demo

    conf = settings(None, prefix)
    code = run_demo(
        redis_url=redis_url,
        prefix=conf.prefix,
        jobs=jobs,
        workers=workers,
        producers=max(1, min(producers, jobs)),
        max_new_tokens=max_new_tokens,
        live=live,
    )
    raise typer.Exit(code=code)


def _watch_status(client: Any, keys: Keys, *, full_screen: bool) -> None:
    """Redraw the status tables every second until Ctrl-C."""
    import time

    from rich.console import Console
    from rich.live import Live

    from tokenfleet.status import fleet_status, render_status

    view = render_status(fleet_status(client, keys))
    with Live(view, console=Console(), screen=full_screen) as screen:
        try:
            while True:
                time.sleep(1)
                screen.update(render_status(fleet_status(client, keys)))
        except KeyboardInterrupt:
            pass


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="refresh every second")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Queue depth, waiting vs in flight, dead letters, and every live worker."""
    import redis
    from rich.console import Console

    from tokenfleet.status import fleet_status, render_status

    conf = settings(redis_url, prefix)
    client = redis.Redis.from_url(conf.redis_url)
    keys = Keys(conf.prefix)
    if as_json:
        typer.echo(json.dumps(fleet_status(client, keys)))
    elif watch:
        _watch_status(client, keys, full_screen=False)
    else:
        Console().print(render_status(fleet_status(client, keys)))


@app.command()
def top(redis_url: RedisUrl = None, prefix: Prefix = None) -> None:
    """Full-screen live view of the queues and the fleet (Ctrl-C to quit)."""
    import redis

    conf = settings(redis_url, prefix)
    _watch_status(redis.Redis.from_url(conf.redis_url), Keys(conf.prefix), full_screen=True)


@app.command()
def up(
    workers: Annotated[int, typer.Option("--workers", help="worker processes")] = 2,
    model: Annotated[
        str, typer.Option("--model", help="preset or checkpoint folder")
    ] = "tiny-random",
    threads: Annotated[int, typer.Option("--threads", help="torch threads per worker")] = 1,
    embedded: Annotated[
        bool, typer.Option("--embedded", help="start an embedded Redis instead of --redis-url")
    ] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Run a local multi-process fleet without Docker; Ctrl-C drains it and exits."""
    import signal
    import threading

    from tokenfleet.local import LocalWorkers, redis_for

    conf = settings(redis_url, prefix)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with redis_for(None if embedded else conf.redis_url) as (url, kind):
        fleet = LocalWorkers(url, conf.prefix, ["--model", model, "--threads", str(threads)])
        names = fleet.start(workers, name_prefix="up")
        typer.echo(f"fleet up: {len(names)} worker(s) on {url} ({kind}); Ctrl-C drains and stops")
        while not stop.wait(0.5):
            if not fleet.alive():
                typer.echo("every worker has exited", err=True)
                break
        typer.echo("draining: in-flight jobs finish, the rest are handed back")
        codes = fleet.drain()
    failed = {name: code for name, code in codes.items() if code != 0}
    typer.echo(f"stopped {len(codes)} worker(s)" + (f"; failures: {failed}" if failed else ""))
    raise typer.Exit(code=1 if failed else 0)


@app.command("dead-letters")
def dead_letters(
    requeue: Annotated[
        list[str] | None,
        typer.Option("--requeue", help="dead-letter entry id to submit again (repeatable)"),
    ] = None,
    count: Annotated[int, typer.Option("--count", help="entries to list")] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """List dead-lettered jobs (newest first), or submit chosen ones again."""
    import redis

    from tokenfleet.deadletters import list_dead_letters, requeue_dead_letter

    conf = settings(redis_url, prefix)
    client = redis.Redis.from_url(conf.redis_url)
    keys = Keys(conf.prefix)
    if requeue:
        for entry_id in requeue:
            try:
                job_id = requeue_dead_letter(client, keys, entry_id, default_cap=conf.queue_cap)
            except TokenfleetError as exc:
                raise fail(str(exc)) from None
            typer.echo(f"{entry_id}: job {job_id} submitted again")
        return
    entries = list_dead_letters(client, keys, count)
    if as_json:
        typer.echo(json.dumps(entries))
        return
    for e in entries:
        typer.echo(
            f"{e['id']}  job={e['job_id'] or '-'}  reason={e['reason']}  "
            f"deliveries={e['deliveries']}  {e['message'][:100]}"
        )
    typer.echo(f"{client.xlen(keys.dead_letters())} dead letter(s) in {keys.dead_letters()}")


app.command("gateway")(gateway_command)


@app.command(
    "bench",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="engine | e2e | gateway | submit")],
) -> None:
    """Run a benchmark from the source checkout's bench/ (extra options are passed on)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    if not script.is_file():
        raise fail(f"no benchmark {script} (benchmarks ship with the source checkout)")
    sys.argv = [str(script), *ctx.args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


@app.command("acl")
def acl(
    prefix: Prefix = None,
    clear: Annotated[
        bool,
        typer.Option("--clear", help="write given passwords as >text, not #sha256"),
    ] = False,
) -> None:
    """Print a Redis ACL file: one user per role (producer, worker, gateway, operator),
    each confined to the fleet's prefix with only the commands it sends.

    A role's password comes from $TOKENFLEET_REDIS_<ROLE>_PASSWORD (written as its
    SHA-256); without one the role gets the placeholder >change-me-<role>. Load the
    file with `redis-server --aclfile FILE`. See docs/operations.md, "Least privilege"."""
    import os

    from tokenfleet.acl import PASSWORD_ENV, render_acl_file

    conf = settings(None, prefix)
    passwords = {name: os.environ[env] for name, env in PASSWORD_ENV.items() if os.environ.get(env)}
    try:
        text = render_acl_file(conf.prefix, passwords, hashed=not clear)
    except ValueError as exc:
        raise fail(str(exc)) from None
    sys.stdout.write(text)


def main() -> None:
    import redis

    try:
        app()
    except redis.ConnectionError as exc:
        typer.echo(f"error: cannot reach Redis ({exc})", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
