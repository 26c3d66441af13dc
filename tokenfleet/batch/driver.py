"""Drives batches: validate, feed lines to the fleet under backpressure, collect, finish.

Every gateway runs one `BatchDriver`. About once a second it looks for batches that
are not finished and takes the lease of each one nobody holds (`BatchStore.take_lease`),
so a batch whose gateway died is picked up by another (or by the same one restarted)
within the lease time. Driving a batch is a loop of small steps, each of them safe to
repeat after a crash:

    validating   parse the input file: unusable -> failed (with the lines' errors);
                 else in_progress, every request counted, invalid bodies already failed
    in_progress  submit the next lines, in the batch priority band for the batch's
                 tenant, while the batch has fewer than `max_in_flight` jobs out and the
                 model's batch band is under `queue_share` of its cap (a full band or a
                 tenant at its limit means wait, never fail: batch/pacing.py, the rule
                 `tokenfleet batch run` follows too); read the results of jobs out
                 (one MGET), write each line's output as it ends; all done -> finalizing
    finalizing   write the output and error files in line order -> completed
    cancelling   cancel the jobs out, wait for their ends; every line that did not
                 finish (its job cut short, or never submitted) is an error line coded
                 `batch_cancelled` -> cancelled (the files hold every line)
    expiry       past `expires_at` the batch is cancelled the same way, the lines coded
                 `batch_expired` -> expired

A line's job that ended `stop` or `length` before the cancel took effect is a success
like any other (`format.result_line` holds the rule). A finished batch's
`request_counts` are counted from its lines' results, so `total == completed + failed`.

A line's job id is the batch id and the line number, so a line submitted again after a
restart is the fleet's duplicate (refused by the submit script, never run twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenfleet.batch.format import (
    SUBMIT_REFUSALS,
    BatchInputError,
    BatchLine,
    BatchStop,
    error_line,
    job_id_for,
    parse_input,
    refused_line,
    result_line,
    succeeded,
    to_request,
    unrun_line,
)
from tokenfleet.batch.pacing import (
    Invalid,
    Need,
    Pacing,
    Room,
    Sent,
    carry_out_async,
    submit_round,
)
from tokenfleet.batch.store import TERMINAL, BatchStore, NotFound, get_many, new_id, tenant_of
from tokenfleet.errors import QueueFull
from tokenfleet.fleet import FleetView, read_workers_async
from tokenfleet.keys import DEFAULT_MODEL
from tokenfleet.producer import AsyncProducer
from tokenfleet.protocol import Priority, decode_result

log = logging.getLogger(__name__)
BATCH_BAND: Priority = "batch"  # the band every line of a /v1/batches batch waits in


@dataclass(frozen=True)
class DriverConfig:
    max_in_flight: int = 64  # jobs one batch may have out at once
    queue_share: float = 0.5  # submit only while the batch band is under this much of its cap
    poll_s: float = 0.25  # between steps of a batch
    scan_s: float = 1.0  # between looks for batches to drive
    chat_max_tokens: int = 256

    @property
    def pacing(self) -> Pacing:
        return Pacing(max_in_flight=self.max_in_flight, queue_share=self.queue_share)


def now() -> int:
    return int(time.time())


def _stop_of(doc: dict[str, Any]) -> BatchStop:
    """Why a cancelling batch stops: its expiry, or a cancel request."""
    return BatchStop.EXPIRED if doc.get("tokenfleet_expiring") else BatchStop.CANCELLED


class BatchDriver:
    def __init__(
        self,
        store: BatchStore,
        producer: AsyncProducer,
        config: DriverConfig | None = None,
        *,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.producer = producer
        self.config = config or DriverConfig()
        self.owner = owner or new_id("gateway")
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Forever: pick up batches nobody drives (cancel the task to stop)."""
        try:
            while True:
                try:
                    await self.scan()
                except Exception:  # Redis down, a bad batch: log, keep scanning
                    log.exception("batch scan failed")
                await asyncio.sleep(self.config.scan_s)
        finally:
            for task in self._tasks.values():
                task.cancel()
            for task in list(self._tasks.values()):
                with contextlib.suppress(BaseException):
                    await task

    async def scan(self) -> None:
        for batch_id, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[batch_id]
        for batch_id in await self.store.open_batch_ids():
            if batch_id in self._tasks:
                continue
            if await self.store.take_lease(batch_id, self.owner):
                self._tasks[batch_id] = asyncio.create_task(self._drive(batch_id))

    async def _drive(self, batch_id: str) -> None:
        try:
            await Run(self, batch_id).run()
        except Exception:
            log.exception("driving batch %s failed; another scan retries it", batch_id)
        finally:
            with contextlib.suppress(Exception):
                await self.store.release_lease(batch_id, self.owner)


class Run:
    """One driver's hold on one batch, until it ends or the lease is lost."""

    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self.d = driver
        self.store = driver.store
        self.producer = driver.producer
        self.config = driver.config
        self.id = batch_id
        self.lines: list[BatchLine] = []
        self.done: set[int] = set()
        self.out: set[int] = set()  # submitted, no result yet
        self.cancelled: set[int] = set()  # jobs out this run has asked to cancel
        self.next = 0  # the first line not submitted yet
        self.fleet: FleetView | None = None
        self.fleet_at = 0.0

    async def run(self) -> None:
        doc = await self.store.batch(self.id)
        if doc["status"] in TERMINAL:  # ended, still open: a cluster's save cut short
            await self.store.save_batch(doc)  # (store.py); it leaves the open batches
            return
        while doc["status"] not in TERMINAL:
            if not await self.store.take_lease(self.id, self.d.owner):
                return  # someone else drives it now
            step = getattr(self, "_" + doc["status"])
            doc = await step(doc)
            await self.store.save_batch(doc)
            if doc["status"] in ("in_progress", "cancelling"):
                await asyncio.sleep(self.config.poll_s)

    # ---- states ---------------------------------------------------------------------

    async def _validating(self, doc: dict[str, Any]) -> dict[str, Any]:
        try:
            content = await self.store.content(doc["input_file_id"])
            lines = parse_input(content, doc["endpoint"])
        except NotFound as exc:
            return self._failed(
                doc, [{"code": "file_not_found", "message": str(exc), "line": None}]
            )
        except BatchInputError as exc:
            return self._failed(doc, exc.errors)
        bad = {
            line.index: error_line(self.id, line, "invalid_request", line.error or "")
            for line in lines
            if line.body is None
        }
        await self.store.put_results(self.id, bad)
        doc["request_counts"] = {"total": len(lines), "completed": 0, "failed": len(bad)}
        doc["status"] = "in_progress"
        doc["in_progress_at"] = now()
        return doc

    async def _in_progress(self, doc: dict[str, Any]) -> dict[str, Any]:
        await self._load(doc)
        if await self.store.cancel_requested(self.id):
            doc["status"], doc["cancelling_at"] = "cancelling", now()
            return doc
        if now() >= doc["expires_at"]:
            doc["tokenfleet_expiring"] = True
            doc["status"], doc["cancelling_at"] = "cancelling", now()
            return doc
        await self._collect(doc)
        await self._submit_more(doc)
        if len(self.done) == len(self.lines):
            doc["status"], doc["finalizing_at"] = "finalizing", now()
        return doc

    async def _cancelling(self, doc: dict[str, Any]) -> dict[str, Any]:
        await self._load(doc)
        for index in self.out - self.cancelled:  # each job out is cancelled once
            await self.producer.handle(job_id_for(self.id, index)).cancel()
        self.cancelled |= self.out
        stop = _stop_of(doc)
        await self._collect(doc, stop)
        if self.out:
            return doc
        unrun = {
            line.index: unrun_line(self.id, line, stop)
            for line in self.lines
            if line.index not in self.done
        }
        await self.store.put_results(self.id, unrun)
        self.done |= unrun.keys()
        return await self._finish(doc, "expired" if stop is BatchStop.EXPIRED else "cancelled")

    async def _finalizing(self, doc: dict[str, Any]) -> dict[str, Any]:
        return await self._finish(doc, "completed")

    # ---- steps ------------------------------------------------------------------------

    async def _load(self, doc: dict[str, Any]) -> None:
        """The lines and what is done, once per run (after a restart: from Redis)."""
        if self.lines:
            return
        content = await self.store.content(doc["input_file_id"])
        self.lines = parse_input(content, doc["endpoint"])
        self.done = set(await self.store.results(self.id))
        self.next = int(doc.get("tokenfleet_submitted", 0))
        self.out = {i for i in range(self.next) if i not in self.done}

    async def _view(self) -> FleetView:
        if self.fleet is None or time.monotonic() - self.fleet_at > 1.0:
            self.fleet = FleetView(
                await read_workers_async(self.producer.redis, self.producer.keys)
            )
            self.fleet_at = time.monotonic()
        return self.fleet

    async def _collect(self, doc: dict[str, Any], stopped: BatchStop | None = None) -> None:
        """Write the lines whose jobs ended (`stopped`: the batch's cancel or expiry
        stopped the jobs out)."""
        if not self.out:
            return
        pending = sorted(self.out)
        keys = [self.producer.keys.result(job_id_for(self.id, i)) for i in pending]
        raws = await get_many(self.producer.redis, keys)
        ended: dict[int, dict[str, Any]] = {}
        counts = doc["request_counts"]
        view = await self._view()
        for index, raw in zip(pending, raws, strict=True):
            if raw is None:
                continue
            body = self.lines[index].body
            served = view.models.get(body.model) if body is not None else None
            line, ok = result_line(self.id, self.lines[index], decode_result(raw), stopped, served)
            ended[index] = line
            counts["completed" if ok else "failed"] += 1
        await self.store.put_results(self.id, ended)
        self.done |= ended.keys()
        self.out -= ended.keys()

    async def _submit_more(self, doc: dict[str, Any]) -> None:
        """One round of submits (batch/pacing.py); the lines refused for good are failed."""
        failed: dict[int, dict[str, Any]] = {}
        plan = submit_round(self.config.pacing, self.lines, self.next, len(self.out), self.done)
        answer = partial(self._answer, await self._view(), tenant_of(doc), failed)
        self.next = await carry_out_async(plan, answer)
        await self.store.put_results(self.id, failed)
        doc["request_counts"]["failed"] += len(failed)
        self.done |= failed.keys()
        doc["tokenfleet_submitted"] = self.next

    async def _answer(
        self, view: FleetView, tenant: str, failed: dict[int, dict[str, Any]], need: Need
    ) -> Any:
        """What a round of `submit_round` needs, done on the asyncio producer. Lines that
        failed validation have their error line already (they are `done`)."""
        if isinstance(need, Room):  # the model's cap (each band's) and its batch band's depth
            model = None if need.model == DEFAULT_MODEL else need.model
            raw = await self.producer.redis.get(self.producer.keys.queue_cap(model))
            cap = int(raw) if raw is not None else self.producer.default_cap
            return cap, await self.producer.depth(model, BATCH_BAND)
        if isinstance(need, Invalid):
            return None
        line = need.line
        assert line.body is not None
        served = view.models.get(line.body.model)
        try:
            job = to_request(
                self.id,
                line,
                served,
                chat_max_tokens=self.config.chat_max_tokens,
                tenant=tenant,
                priority=BATCH_BAND,
            )
            await self.producer.submit(job, capacity=served.max_job_tokens if served else None)
        except QueueFull:  # the band, or the tenant's limit (TenantQueueFull)
            return Sent.FULL
        except SUBMIT_REFUSALS as exc:
            failed[line.index] = refused_line(self.id, line, exc)
            return Sent.REFUSED
        self.out.add(line.index)
        return Sent.OUT

    async def _finish(self, doc: dict[str, Any], status: str) -> dict[str, Any]:
        results = await self.store.results(self.id)
        ordered = [results[i] for i in sorted(results)]
        good = [entry for entry in ordered if succeeded(entry)]
        bad = [entry for entry in ordered if not succeeded(entry)]
        counts = doc["request_counts"]
        assert len(ordered) == counts["total"], (self.id, len(ordered), counts)
        counts["completed"], counts["failed"] = len(good), len(bad)  # the lines' own word
        if good:
            doc["output_file_id"] = (await self._file(good, "output", doc))["id"]
        if bad:
            doc["error_file_id"] = (await self._file(bad, "error", doc))["id"]
        doc["status"] = status
        doc[f"{status}_at"] = now()
        if status == "completed":
            doc.setdefault("finalizing_at", now())
        await self.store.drop_results(self.id)
        return doc

    async def _file(
        self, lines: list[dict[str, Any]], what: str, doc: dict[str, Any]
    ) -> dict[str, Any]:
        """A result file, owned by the batch's tenant."""
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        name = f"{self.id}_{what}.jsonl"
        return await self.store.put_file(data, name, "batch_output", tenant_of(doc))

    def _failed(self, doc: dict[str, Any], errors: list[dict[str, Any]]) -> dict[str, Any]:
        doc["status"], doc["failed_at"] = "failed", now()
        doc["errors"] = {"object": "list", "data": errors}
        return doc


__all__ = ["BatchDriver", "DriverConfig"]
