"""Commands about jobs: `submit`, `queue-cap`, `dead-letters`."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from tokenfleet.cli.common import Model, Prefix, RedisUrl, connect, connect_producer, fail
from tokenfleet.errors import TokenfleetError


def queue_cap(
    cap: Annotated[int | None, typer.Argument(help="new cap; omit to show the current one")] = None,
    model: Model = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Show or set the jobs stream's cap (shared by every producer, in any language)."""
    conf, producer = connect_producer(redis_url, prefix)
    if cap is not None:
        if cap < 1:
            raise fail("the cap must be at least 1")
        producer.set_queue_cap(cap, model)
    typer.echo(
        f"{conf.keys().jobs(model)}: cap {producer.queue_cap(model)}, depth {producer.depth(model)}"
    )


def submit(
    prompt: Annotated[str, typer.Argument(help="prompt text")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 64,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", "-t", help="0 = greedy; unset: the model's default"),
    ] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="0 = off")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="1 = off")] = None,
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
    _, producer = connect_producer(redis_url, prefix)
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
    from tokenfleet.deadletters import list_dead_letters, requeue_dead_letter

    conf, client, keys = connect(redis_url, prefix)
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
    total = sum(int(client.xlen(keys.dead_letters(p))) for p in keys.partitions_all)
    typer.echo(f"{total} dead letter(s) in {keys.dead_letters()}")
