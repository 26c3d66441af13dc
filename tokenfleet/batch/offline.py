"""`tokenfleet batch run`: an OpenAI batch input file straight through a producer.

No gateway and no upload: lines are read from disk, submitted as the queue has room
(`batch/pacing.py`, the gateway's driver's rule: at most `max_in_flight` out, and only
while the band they wait in, `priority`, is under `queue_share` of its cap; a tenant at
its limit means wait too), for `tenant`, and each result is appended to the output
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from redis.cluster import RedisCluster

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
from tokenfleet.batch.pacing import Invalid, Need, Pacing, Room, Sent, carry_out, submit_round
from tokenfleet.errors import QueueFull
from tokenfleet.fleet import FleetCache, FleetView, read_workers
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
    done_ids = _already_done(output)
    todo = [line for line in lines if line.custom_id not in done_ids]
    ok_before = sum(done_ids.values())
    progress = Progress(total=len(lines), done=ok_before, failed=len(done_ids) - ok_before)
    pacing = Pacing(max_in_flight=max_in_flight, queue_share=queue_share)
    with output.open("a", encoding="utf-8") as sink:
        run = _Run(
            producer,
            batch_id_for_file(content),
            sink,
            progress,
            chat_max_tokens=chat_max_tokens,
            tenant=tenant,
            priority=priority,
        )
        at = 0  # the first line of `todo` neither submitted nor written yet
        while at < len(todo) or run.out:
            fleet = run.fleet()
            at = carry_out(submit_round(pacing, todo, at, len(run.out)), partial(run.answer, fleet))
            run.collect()
            progress.in_flight = len(run.out)
            if on_progress is not None:
                on_progress(progress)
            if run.out or at < len(todo):  # waiting for results, or for room
                time.sleep(poll_s)
    return progress


class _Run:
    """One `run_batch`: the jobs out, the output file, the fleet as last read."""

    def __init__(
        self,
        producer: Producer,
        batch_id: str,
        sink: TextIO,
        progress: Progress,
        *,
        chat_max_tokens: int,
        tenant: str,
        priority: Priority,
    ) -> None:
        self.producer = producer
        self.batch_id = batch_id
        self.sink = sink
        self.progress = progress
        self.chat_max_tokens = chat_max_tokens
        self.tenant = tenant
        self.priority = priority
        self.out: dict[str, BatchLine] = {}  # job id -> line, submitted, not in the output yet
        self._fleet = FleetCache(ttl_s=1.0)

    def fleet(self) -> FleetView:
        now = time.monotonic()
        cached = self._fleet.get(now)
        if cached is not None:
            return cached
        return self._fleet.put(
            now, FleetView(read_workers(self.producer.redis, self.producer.keys))
        )

    def answer(self, fleet: FleetView, need: Need) -> Any:
        """What a round of `submit_round` needs, done on the sync producer."""
        if isinstance(need, Room):
            model = None if need.model == DEFAULT_MODEL else need.model
            return self.producer.queue_cap(model), self.producer.depth(model, self.priority)
        line = need.line
        if isinstance(need, Invalid):
            self.write(error_line(self.batch_id, line, "invalid_request", line.error or ""), False)
            return None
        assert line.body is not None
        try:
            job = to_request(
                self.batch_id,
                line,
                fleet.models.get(line.body.model),
                chat_max_tokens=self.chat_max_tokens,
                tenant=self.tenant,
                priority=self.priority,
            )
            self.producer.submit(job)
        except QueueFull:  # the band, or the tenant's limit
            return Sent.FULL
        except SUBMIT_REFUSALS as exc:
            self.write(refused_line(self.batch_id, line, exc), False)
            return Sent.REFUSED
        self.out[job.job_id] = line
        return Sent.OUT

    def collect(self) -> None:
        """Write the lines whose jobs ended (one MGET of their results, per slot on a
        cluster)."""
        if not self.out:
            return
        ids = list(self.out)
        keys = [self.producer.keys.result(j) for j in ids]
        client = self.producer.redis
        # one MGET, or on a cluster one per slot (MGET refuses keys of several slots there)
        cluster = isinstance(client, RedisCluster)
        raws = client.mget_nonatomic(keys) if cluster else client.mget(keys)
        for job_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            result = decode_result(raw)
            line = self.out.pop(job_id)
            model = line.body.model if line.body is not None else None
            served = self.fleet().models.get(model) if model else None  # its tool format
            entry, ok = result_line(self.batch_id, line, result, served=served)
            self.progress.tokens += result.usage.completion_tokens
            self.write(entry, ok)

    def write(self, entry: dict[str, Any], ok: bool) -> None:
        self.sink.write(json.dumps(entry) + "\n")
        self.sink.flush()
        if ok:
            self.progress.done += 1
        else:
            self.progress.failed += 1


__all__ = ["Progress", "run_batch"]
