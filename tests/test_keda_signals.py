"""What an autoscaler reading a jobs stream sees, after each way the fleet deletes entries.

KEDA's `redis-streams` scaler (and any tool reading `XINFO GROUPS`) can scale on a
consumer group's `lag` (entries never delivered), its `pending` count, or `XLEN`. The
fleet's own measure of waiting jobs is exact: depth − pending (`fleet.waiting_jobs`),
because workers delete an entry when they finish it. These tests run every delete the
fleet performs on a jobs stream against a real redis-server (7.0), through the worker's
own Redis edge (`WorkerQueue`: the real Lua scripts) and the real producer, and compare
`lag` with that truth.

The fleet deletes jobs-stream entries in one place only, `ack_delete_entry` in
lua/owned_entry.lua (XACK then XDEL, of an entry pending to the caller, i.e. already
delivered): when a job finishes (tick.lua), is dead-lettered (dead_letter.lua), is put
back by a worker that held it too long (requeue.lua) or is deferred because its tenant is
at max_running (accept.lua). It never XDELs an undelivered entry, and never trims a jobs
stream (MAXLEN/XTRIM only touch the replay and dead-letter streams, which have no group).
`test_the_only_deletes_of_a_jobs_stream_are_ack_deletes` keeps that list honest.

The Redis 7.0 rule behind every result here (t_stream.c, `XINFO GROUPS`): lag is
entries-added − entries-read while no deleted id lies at or after the group's
last-delivered-id (Redis keeps only the largest deleted id, `max-deleted-entry-id`, and
ignores it once it is older than the stream's first entry). Otherwise Redis estimates the
group's read counter, which it can only when last-delivered-id is the stream's last id
(lag 0), or the stream is empty, or last-delivered-id and the largest deleted id both lie
before the stream's first entry; else lag is NULL ("can't be determined"). So deleting
the newest delivered entry while an older one is still in the stream (a job that started
earlier still running) and a newer one waits makes lag NULL, until the next delivery
moves last-delivered-id past the deleted id. Deleting an entry older than the last
delivered one never does. When lag is a number after our deletes, it is exact.
"""

from __future__ import annotations

import re
from typing import Any

import redis
import yaml

from tests.helpers.reads import queue_stats
from tests.helpers.support import KEYS, ROOT
from tests.helpers.ticks import finish, outcome, tick
from tests.helpers.workers import Fleet
from tokenfleet.fleet import waiting_jobs
from tokenfleet.keys import DEFAULT_MODEL, GROUP, Keys
from tokenfleet.producer import JobHandle, Producer
from tokenfleet.reasons import FinishReason
from tokenfleet.tenants import set_limits
from tokenfleet.worker.queue import Delivery, TickVerdict, TickWrite, Verdict, WorkerQueue

STREAM = KEYS.jobs()  # the default model's default band


def submit(r: redis.Redis, *ids: str, tenant: str = "default") -> list[JobHandle]:
    producer = Producer(r)
    return [producer.submit(prompt=f"prompt {i}", job_id=i, tenant=tenant) for i in ids]


def worker(r: redis.Redis, name: str = "w") -> WorkerQueue:
    queue = WorkerQueue(r, KEYS, name)
    queue.ensure_group()
    queue.load_scripts()
    return queue


def signals(r: redis.Redis) -> tuple[int | None, int, int]:
    """(lag, pending, waiting) of the stream: what XINFO GROUPS says, and the truth."""
    stats = queue_stats(r, KEYS)
    return stats["lag"], stats["pending"], waiting_jobs(stats)


def ids_of(held: list[Delivery]) -> list[str | None]:
    return [d.job_id for d in held]


def test_finishing_the_oldest_job_keeps_lag_exact(r: redis.Redis) -> None:
    submit(r, "a", "b", "c", "d", "e")
    w = worker(r)
    a, b = w.read(2)
    assert signals(r) == (3, 2, 3)
    # a finishes: its id is below last-delivered-id (b), so no deletion lies ahead of
    # the group and entries-added − entries-read still counts c, d, e
    assert finish(w, a) == [TickVerdict.DONE]
    assert signals(r) == (3, 1, 3)
    # b, the newest delivered, finishes with nothing older left in the stream: Redis
    # estimates the read counter (every entry left is after last-delivered-id): exact
    assert finish(w, b) == [TickVerdict.DONE]
    assert signals(r) == (3, 0, 3)


def test_finishing_the_newest_delivered_job_first_makes_lag_null(r: redis.Redis) -> None:
    submit(r, "a", "b", "c")
    w = worker(r)
    a, b = w.read(2)
    # b started after a and ends first (a shorter job): its id = last-delivered-id is now
    # a deleted id at the group's position, a is still in the stream before it and c
    # waits after it: the counter cannot be estimated
    assert finish(w, b) == [TickVerdict.DONE]
    assert signals(r) == (None, 1, 1)
    # the next delivery moves last-delivered-id past the deleted id: exact again
    (c,) = w.read(5)
    assert signals(r) == (0, 2, 0)
    submit(r, "d")
    assert signals(r) == (1, 2, 1)
    assert finish(w, a, c) == [TickVerdict.DONE, TickVerdict.DONE]
    assert signals(r) == (1, 0, 1)


def test_a_finish_with_nothing_waiting_hides_the_jobs_submitted_next(r: redis.Redis) -> None:
    submit(r, "a", "b")
    w = worker(r)
    a, b = w.read(2)
    assert finish(w, b) == [TickVerdict.DONE]
    # everything was delivered: last-delivered-id is the stream's last id, lag 0, exact
    assert signals(r) == (0, 1, 0)
    # ...until a job is submitted while a still runs: the fleet's waiting jobs are the
    # ones lag cannot count (the burst an autoscaler is there to see)
    submit(r, "c", "d")
    assert signals(r) == (None, 1, 2)
    # a's end leaves no entry before the deleted id: estimated again, exact
    assert finish(w, a) == [TickVerdict.DONE]
    assert signals(r) == (2, 0, 2)


def test_cancelling_a_queued_job_deletes_nothing_until_a_worker_ends_it(r: redis.Redis) -> None:
    w = worker(r)
    handles = submit(r, "a", "b", "c")
    assert handles[1].cancel()  # the producer sets the job's cancel flag, nothing more
    assert r.xlen(STREAM) == 3
    assert signals(r) == (3, 0, 3)  # the cancelled job counts as waiting until pulled
    held = w.read(3)
    accepted = w.accept(held)
    assert [(x.verdict, x.cancelled) for x in accepted] == [
        (Verdict.OK, False),
        (Verdict.OK, True),
        (Verdict.OK, False),
    ]
    # the worker ends the cancelled job at once (tick.lua): an ack+delete of a delivered
    # entry in the middle of the stream; the newest delivered is c, still there
    cancelled = held[1]
    assert cancelled.job_id is not None
    end = outcome(cancelled.job_id, FinishReason.CANCELLED)
    assert tick(w, TickWrite(cancelled, cancelled.job_id, [], end))[0].verdict == TickVerdict.DONE
    assert signals(r) == (0, 2, 0)
    submit(r, "d")
    assert signals(r) == (1, 2, 1)


def test_requeue_of_a_held_job_makes_lag_null_when_it_was_the_newest_delivered(
    r: redis.Redis,
) -> None:
    submit(r, "a", "b", "c")
    w = worker(r)
    a, b = w.read(2)
    assert [x.verdict for x in w.accept([a, b])] == [Verdict.OK, Verdict.OK]
    # b held too long unstarted (--hold-s): ack+delete, and a copy at the tail
    assert w.requeue(b) is not None
    assert r.xlen(STREAM) == 3  # a, c, b's copy
    assert signals(r) == (None, 1, 2)
    # putting back the oldest held job instead: no deletion ahead of the group
    (c,) = w.read(1)
    assert signals(r) == (1, 2, 1)  # b's copy waits
    assert w.accept([c])[0].verdict == Verdict.OK
    assert w.requeue(a) is not None
    assert signals(r) == (2, 1, 2)  # b's and a's copies


def test_a_deferral_at_max_running_makes_lag_null_until_the_next_pull(r: redis.Redis) -> None:
    set_limits(r, KEYS, "acme", max_running=1)
    submit(r, "a1", "a2", "a3", tenant="acme")
    w = worker(r)
    held = w.read(2)
    # a1 starts; a2 finds acme at its limit and goes back to the tail (accept.lua acks
    # and deletes the entry just delivered, the newest, while a1's is still there)
    assert [x.verdict for x in w.accept(held)] == [Verdict.OK, Verdict.DEFERRED]
    assert r.xlen(STREAM) == 3
    assert signals(r) == (None, 1, 2)
    (a3,) = w.read(1)
    assert ids_of([a3]) == ["a3"]
    assert signals(r) == (1, 2, 1)  # a2's new entry


def test_dead_lettering_the_newest_delivered_entry_makes_lag_null(r: redis.Redis) -> None:
    submit(r, "a", "b", "c", "d")
    w = worker(r)
    a, b = w.read(2)
    # dead_letter.lua ends b with the same ack+delete as a finish: b = last-delivered-id
    assert w.dead_letter(b, "test", "dead-lettered by the test") is True
    assert signals(r) == (None, 1, 2)
    # once c is delivered, dead-lettering a (older than last-delivered-id) leaves it exact
    (c,) = w.read(1)
    assert ids_of([c]) == ["c"]
    assert w.dead_letter(a, "test", "dead-lettered by the test") is True
    assert signals(r) == (1, 1, 1)


def test_pending_and_xlen_stay_exact_through_every_delete(r: redis.Redis) -> None:
    """What a scaler can rely on: XLEN (streamLength) is depth, pending is held jobs, and
    XLEN − pending is what lag should have been, whichever path deleted the entry."""
    set_limits(r, KEYS, "acme", max_running=1)
    submit(r, "j0", "j1", "j2", "j3", "j4")
    submit(r, "t0", "t1", tenant="acme")
    w = worker(r)
    held = w.read(7)
    accepted = {d.job_id: x.verdict for d, x in zip(held, w.accept(held), strict=True)}
    assert accepted["t1"] == Verdict.DEFERRED
    by_id = {d.job_id: d for d in held}
    assert finish(w, by_id["j4"]) == [TickVerdict.DONE]
    assert w.dead_letter(by_id["j3"], "test", "dead-lettered by the test") is True
    assert w.requeue(by_id["j2"]) is not None
    # held: j0, j1, t0; waiting: j2's and t1's copies
    assert r.xlen(STREAM) == 5
    lag, pending, waiting = signals(r)
    assert (pending, waiting) == (3, 2)
    assert lag is None  # the deletes above hit the newest delivered entries
    rows = r.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert sorted(row["message_id"].decode() for row in rows) == sorted(
        by_id[job].entry_id for job in ("j0", "j1", "t0")
    )


def test_a_real_worker_drains_a_cancelled_queued_job_and_lag_ends_exact(
    r: redis.Redis, fleet: Fleet
) -> None:
    """Through the producer and a real worker process: the cancelled job is deleted by the
    worker that pulls it (the same ack+delete as any finish), and once the burst worker
    has drained the stream every signal agrees."""
    worker(r, "an-earlier-worker")  # the group exists (a worker has run before)
    handles = submit(r, "x0", "x1", "x2", "x3")
    assert handles[2].cancel()
    assert signals(r) == (4, 0, 4)
    done = fleet.start("keda-burst")
    assert done.wait(timeout=120) == 0, done.output()
    assert handles[2].status().finish_reason == "cancelled"
    assert r.xlen(STREAM) == 0
    assert signals(r) == (0, 0, 0)


def test_the_only_deletes_of_a_jobs_stream_are_ack_deletes() -> None:
    """Every XDEL, XTRIM and MAXLEN/MINID trim the package sends, by file, with the stream
    it names. A new one fails this test: redo the analysis above (and the autoscaling
    section of docs/operations.md) before adding it to the list."""
    # a call's first argument and the rest of it, up to its closing parenthesis (one
    # level of nested calls: `keys.dead_letters()`, `unpack(fields)`)
    args = r"\s*((?:[^(),]|\([^()]*\))+)((?:[^()]|\([^()]*\))*)\)"
    lua_call = re.compile(
        r"(?:redis\.p?call|try)\((?:\s*'\w+'\s*,)?\s*'(XADD|XDEL|XTRIM)'\s*," + args
    )
    py_call = re.compile(r"\.(xadd|xdel|xtrim)\(" + args)
    found: dict[str, list[tuple[str, str]]] = {}
    package = ROOT / "tokenfleet"
    for path in sorted([*package.rglob("*.lua"), *package.rglob("*.py")]):
        lua = path.suffix == ".lua"
        lines = path.read_text().splitlines()
        code = "\n".join(line.split("--")[0] if lua else line.split("#")[0] for line in lines)
        for command, key, rest in (lua_call if lua else py_call).findall(code):
            trim = re.search(r"MAXLEN|MINID", rest, re.IGNORECASE)
            if command.upper() != "XADD" or trim:
                what = trim.group(0).upper() if trim else command.upper()
                found.setdefault(path.relative_to(package).as_posix(), []).append(
                    (what, key.strip())
                )
    assert found == {
        # the one delete of a jobs-stream entry, right after its XACK, of an entry pending
        # to the caller (ack_delete_entry: tick.lua, dead_letter.lua, requeue.lua and
        # accept.lua call it); and the trim of a job's replay stream (no group)
        "lua/owned_entry.lua": [("MAXLEN", "t.events"), ("XDEL", "stream")],
        "lua/tick.lua": [("MAXLEN", "events")],
        # the dead-letter stream (KEYS[2]), which has no group
        "lua/dead_letter.lua": [("MAXLEN", "KEYS[2]")],
        # the worker's start-up permission check, on its own throwaway stream
        "lua/probe.lua": [("XDEL", "KEYS[1]"), ("XDEL", "KEYS[1]")],
        # `tokenfleet dead-letters requeue`: a record of the dead-letter stream
        "deadletters.py": [("XDEL", "stream_of_letter")],  # the letter's partition's stream
    }


# --- the KEDA example (compose/keda/scaledobject.yaml) ----------------------------------

KEDA_EXAMPLE = ROOT / "compose" / "keda" / "scaledobject.yaml"
CLUSTER_MARKER = "# --- redis-cluster-streams"


def keda_examples() -> dict[str, dict[str, Any]]:
    """The file's ScaledObject, and the redis-cluster-streams one commented out below it
    (its YAML lines start at '# apiVersion:')."""
    text = KEDA_EXAMPLE.read_text()
    (active,) = [doc for doc in yaml.safe_load_all(text) if doc]
    tail = text[text.index(CLUSTER_MARKER) :]
    block = tail[tail.index("# apiVersion:") :].splitlines()
    assert all(line.startswith("#") for line in block), "the cluster block is all comments"
    cluster = yaml.safe_load("\n".join(line[2:] for line in block))
    return {"redis-streams": active, "redis-cluster-streams": cluster}


def test_the_keda_example_has_one_stream_length_trigger_per_band_of_the_code() -> None:
    bands = Keys().bands(DEFAULT_MODEL)  # the default prefix, as the example's workers use
    examples = keda_examples()
    for kind, doc in examples.items():
        assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
        spec = doc["spec"]
        triggers = spec["triggers"]
        assert [t["type"] for t in triggers] == [kind] * len(bands), kind
        # one trigger per band, highest first, on exactly the streams Keys.bands builds
        assert [t["metadata"]["stream"] for t in triggers] == [b.stream for b in bands]
        assert [t["name"] for t in triggers] == [f"band_{b.name}" for b in bands]
        for trigger in triggers:
            meta = trigger["metadata"]
            # XLEN, the exact signal; a consumerGroup (the workers' is keys.GROUP) would
            # switch KEDA to pending or lag, which the tests above show blind or NULL
            assert "streamLength" in meta and int(meta["streamLength"]) > 0, trigger
            assert not {"consumerGroup", "lagCount", "pendingEntriesCount"} & set(meta), trigger
        # the bands are summed (HPA alone would take the largest band's count)
        modifiers = spec["advanced"]["scalingModifiers"]
        terms = re.findall(r"[A-Za-z_]\w*", modifiers["formula"])
        assert sorted(terms) == sorted(t["name"] for t in triggers)
        assert "+" in modifiers["formula"] and int(modifiers["target"]) > 0
        assert spec["scaleTargetRef"]["name"] == "tokenfleet-worker"
