"""The `tokenfleet` command line. Settings and flags are read here, at the edge, only."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tokenfleet.config import Settings
from tokenfleet.errors import TokenfleetError
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
