"""`tokenfleet batch run`: an OpenAI batch input file straight through a producer.

No gateway and no upload: lines are read from disk, submitted as the queue has room
(the same rule as the gateway's driver: at most `max_in_flight` out, and only while the
band they wait in, `priority`, is under `queue_share` of its cap; a tenant at its limit
means wait too), for `tenant`, and each result is appended to the output
file the moment it is in, flushed. Job ids come from the input file's content and the
line number, so a run stopped by Ctrl-C (or a crash) and started again skips the lines
already in the output, picks up the jobs still running in the fleet (their resubmission
is a duplicate, never a second run) and submits the rest.

A result is a success or an error line by the gateway's rule (`format.result_line`):
only a job that ended `stop` or `length` succeeds; one cancelled in the fleet (a handle's
`cancel()`, `SET P job:ID:cancel 1`) is an error line coded `request_cancelled`, its
partial text dropped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet.batch.format import (
    SUBMIT_REFUSALS,
    BatchLine,
    batch_id_for_file,
    error_line,
    parse_input,
    refused_line,
    result_line,
    succeeded,
    to_request,
)
from tokenfleet.errors import QueueFull
from tokenfleet.fleet import FleetView, read_workers
from tokenfleet.keys import DEFAULT_MODEL, DEFAULT_TENANT
from tokenfleet.producer import Producer
from tokenfleet.protocol import Priority, decode_result


@dataclass
class Progress:
    total: int
    done: int = 0  # lines in the output (success)
    failed: int = 0  # lines in the output (error)
    in_flight: int = 0
    tokens: int = 0  # completion tokens of the lines done in this run
    started: float = field(default_factory=time.monotonic)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.started)


def _endpoint(content: bytes) -> str:
    for raw in content.decode("utf-8", errors="replace").splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                break
            return str(url)
    return "/v1/chat/completions"


def _already_done(output: Path) -> dict[str, bool]:
    """custom_id -> succeeded, for the lines in the output already (a torn last line,
    cut by a crash, is dropped)."""
    if not output.exists():
        return {}
    done: dict[str, bool] = {}
    good = b""
    with output.open("rb") as f:
        for raw in f:
            try:
                line = json.loads(raw)
                done[line["custom_id"]] = succeeded(line)
            except (ValueError, KeyError, TypeError, AttributeError):
                break
            good += raw
    if output.stat().st_size != len(good):  # a line cut by a crash: rewrite without it
        output.write_bytes(good)
    return done


def run_batch(
    producer: Producer,
    source: Path,
    output: Path,
    *,
    endpoint: str | None = None,
    max_in_flight: int = 64,
    queue_share: float = 0.5,
    chat_max_tokens: int = 256,
    tenant: str = DEFAULT_TENANT,
    priority: Priority = "batch",
    on_progress: Callable[[Progress], None] | None = None,
    poll_s: float = 0.1,
) -> Progress:
    """Run every line of `source` not yet in `output`; returns the final counts."""
    content = source.read_bytes()
    lines = parse_input(content, endpoint or _endpoint(content))
    batch_id = batch_id_for_file(content)
    done_ids = _already_done(output)
    todo = [line for line in lines if line.custom_id not in done_ids]
    ok_before = sum(done_ids.values())
    progress = Progress(total=len(lines), done=ok_before, failed=len(done_ids) - ok_before)
    out: dict[str, BatchLine] = {}  # job id -> line, submitted and not in the output yet
    fleet: FleetView | None = None
    fleet_at = 0.0
    with output.open("a", encoding="utf-8") as sink:

        def write(entry: dict[str, Any], ok: bool) -> None:
            sink.write(json.dumps(entry) + "\n")
            sink.flush()
            if ok:
                progress.done += 1
            else:
                progress.failed += 1

        queue = list(reversed(todo))
        while queue or out:
            if fleet is None or time.monotonic() - fleet_at > 1.0:
                fleet, fleet_at = (
                    FleetView(read_workers(producer.redis, producer.keys)),
                    time.monotonic(),
                )
            room: dict[str, int] = {}  # jobs each model's queue takes this round
            while queue and len(out) < max_in_flight:
                line = queue[-1]
                if line.body is None:
                    write(error_line(batch_id, line, "invalid_request", line.error or ""), False)
                    queue.pop()
                    continue
                model = line.body.model
                if model not in room:
                    stream_model = None if model == DEFAULT_MODEL else model
                    cap = producer.queue_cap(stream_model)  # each band's
                    depth = producer.depth(stream_model, priority)
                    room[model] = math.ceil(cap * queue_share) - depth
                if room[model] <= 0:
                    break
                try:
                    job = to_request(
                        batch_id,
                        line,
                        fleet.models.get(model),
                        chat_max_tokens=chat_max_tokens,
                        tenant=tenant,
                        priority=priority,
                    )
                    producer.submit(job)
                except QueueFull:  # the band, or the tenant's limit: wait
                    break
                except SUBMIT_REFUSALS as exc:
                    write(refused_line(batch_id, line, exc), False)
                    queue.pop()
                    continue
                room[model] -= 1
                out[job.job_id] = line
                queue.pop()
            if out:
                ids = list(out)
                raws = producer.redis.mget([producer.keys.result(j) for j in ids])
                for job_id, raw in zip(ids, raws, strict=True):
                    if raw is None:
                        continue
                    result = decode_result(raw)
                    entry, ok = result_line(batch_id, out.pop(job_id), result)
                    progress.tokens += result.usage.completion_tokens
                    write(entry, ok)
            progress.in_flight = len(out)
            if on_progress is not None:
                on_progress(progress)
            if out or queue:  # waiting for results, or for room
                time.sleep(poll_s)
    return progress


__all__ = ["Progress", "run_batch"]
