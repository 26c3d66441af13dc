"""Every Lua script in the package is declared in one place (tokenfleet.lua.SCRIPTS), and
each one's call (tokenfleet.lua.calls) runs it on a real redis-server: the slots it fills
are the ones the script reads, and its parse reads the reply by name."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import redis

import tokenfleet.lua as lua
from tests.helpers.support import KEYS
from tests.helpers.ticks import outcome
from tokenfleet.keys import GROUP, STARVATION_GUARD
from tokenfleet.lua.calls import (
    AcceptCall,
    Accepted,
    AcceptEntry,
    Candidate,
    ClaimOrphansCall,
    DeadLetterCall,
    Finish,
    JobTarget,
    LeaseCall,
    ProbeCall,
    PullBand,
    PullCall,
    Pulled,
    RedeliverCall,
    RequeueCall,
    ScriptCall,
    SubmitAnswer,
    SubmitCall,
    Terminal,
    TickCall,
    TickJob,
    TickReply,
    TickVerdict,
    TokenWrite,
    Verdict,
    timestamp,
)
from tokenfleet.producer import Producer
from tokenfleet.protocol import TokenEvent, decode_events, encode
from tokenfleet.worker.queue import Delivery, TickWrite, WorkerQueue

TENANT = "default"
MODEL = "default"


def test_every_lua_file_is_declared_and_every_declaration_has_its_file() -> None:
    folder = Path(lua.__file__).parent
    files = {p.stem for p in folder.glob("*.lua")}
    # owned_entry.lua holds shared functions, prepended to the scripts that act on an entry.
    assert files - {"owned_entry"} == set(lua.SCRIPTS)
    for name in ("accept", "tick", "dead_letter", "redeliver", "requeue"):
        assert lua.SCRIPTS[name].startswith((folder / "owned_entry.lua").read_text())


def run(r: redis.Redis, call: ScriptCall) -> object:
    return r.register_script(lua.SCRIPTS[call.SCRIPT])(keys=call.keys(), args=call.args())


def submit(r: redis.Redis, job_id: str, band: str = "default") -> SubmitAnswer:
    call = SubmitCall(
        stream=KEYS.jobs(None, band),
        cap=KEYS.queue_cap(),
        hash=KEYS.job(job_id),
        models=KEYS.models(),
        queued=KEYS.tenant_queued(TENANT, None),
        limits=KEYS.tenant_limits(TENANT),
        default_limits=KEYS.tenant_limits(None),
        tenants=KEYS.tenants(),
        job_id=job_id,
        payload=f'{{"v":1,"job_id":"{job_id}","prompt":"hi","priority":"{band}"}}',
        default_cap=2,
        now=timestamp(),
        model=MODEL,
        tenant=TENANT,
        band=band,
    )
    return SubmitCall.parse(run(r, call))


def groups(r: redis.Redis) -> None:
    for band in KEYS.bands():
        r.xgroup_create(band.stream, GROUP, id="0", mkstream=True)


def pull(r: redis.Redis, worker: str, count: int) -> list[Pulled]:
    bands = [PullBand(stream=b.stream, name=b.name) for b in KEYS.bands()]
    call = PullCall(
        worker=worker, bands=bands, pulls=KEYS.pulls(), count=count, guard=STARVATION_GUARD
    )
    return PullCall.parse(run(r, call))


def stream_of(p: Pulled) -> str:
    return KEYS.bands()[p.band].stream


def job_of(p: Pulled) -> str:
    return str(p.fields[b"job_id"].decode())


def accept(r: redis.Redis, worker: str, pulled: Sequence[Pulled]) -> list[Accepted]:
    entries = [
        AcceptEntry(
            stream=stream_of(p),
            hash=KEYS.job(job_of(p)),
            cancel=KEYS.cancel(job_of(p)),
            queued=KEYS.tenant_queued(TENANT, None),
            running=KEYS.tenant_running(TENANT, None),
            limits=KEYS.tenant_limits(TENANT),
            default_limits=KEYS.tenant_limits(None),
            entry_id=p.entry_id,
            job_id=job_of(p),
        )
        for p in pulled
    ]
    return AcceptCall.parse(run(r, AcceptCall(worker=worker, now=timestamp(), entries=entries)))


def target(job_id: str) -> JobTarget:
    return JobTarget(
        result=KEYS.result(job_id),
        hash=KEYS.job(job_id),
        events=KEYS.events(job_id),
        queued=KEYS.tenant_queued(TENANT, None),
        running=KEYS.tenant_running(TENANT, None),
        channel=KEYS.channel(job_id),
        job_id=job_id,
    )


def ending(job_id: str) -> Finish:
    result, finish = outcome(job_id)
    return Finish(
        reason=str(result.finish_reason), result_data=encode(result), finish_data=encode(finish)
    )


def tokens(job_id: str, indices: range) -> list[TokenWrite]:
    return [
        TokenWrite(index=i, data=encode(TokenEvent(job_id=job_id, index=i, token_id=i, text="t")))
        for i in indices
    ]


def held(p: Pulled, writes: list[TokenWrite], end: Finish | None = None) -> TickJob:
    return TickJob(
        stream=stream_of(p),
        cancel=KEYS.cancel(job_of(p)),
        entry_id=p.entry_id,
        job=target(job_of(p)),
        tokens=writes,
        end=end,
    )


def test_submit_answers_ok_dup_and_full_by_name(r: redis.Redis) -> None:
    first = submit(r, "a")
    assert first.verdict == "ok" and first.entry_id
    assert submit(r, "a") == SubmitAnswer("dup", first.entry_id, "queued")
    assert submit(r, "b").verdict == "ok"
    assert submit(r, "c") == SubmitAnswer("full", held=2, limit=2)


def test_pull_accept_and_tick_serve_and_end_jobs_through_their_calls(r: redis.Redis) -> None:
    groups(r)
    submit(r, "slow", "batch")
    submit(r, "fast", "interactive")
    pulled = pull(r, "w1", 5)
    assert [(job_of(p), p.band) for p in pulled] == [("fast", 0), ("slow", 2)]
    assert [a.verdict for a in accept(r, "w1", pulled)] == [Verdict.OK, Verdict.OK]
    fast, slow = pulled
    call = TickCall(
        worker="w1",
        now=timestamp(),
        held=[
            held(fast, tokens("fast", range(2)), ending("fast")),
            held(slow, tokens("slow", range(1))),
        ],
    )
    assert TickCall.parse(run(r, call)) == [
        TickReply(TickVerdict.DONE, 2),
        TickReply(TickVerdict.OK, 1),
    ]
    assert r.hget(KEYS.job("fast"), "status") == b"finished"
    assert r.exists(KEYS.result("fast"))
    # its two tokens and its finish: one entry, one message (encodings back to back)
    (entry,) = r.xrange(KEYS.events("fast"))
    assert [e.type for e in decode_events(entry[1][b"m"])] == ["token", "token", "finish"]
    assert r.xlen(stream_of(fast)) == 0 and r.xlen(stream_of(slow)) == 1
    # Another worker's tick for the job this one holds writes nothing: the fence.
    stolen = TickCall(worker="w2", now=timestamp(), held=[held(slow, tokens("slow", range(1, 3)))])
    assert TickCall.parse(run(r, stolen)) == [TickReply(TickVerdict.LOST, 0)]
    assert r.xlen(KEYS.events("slow")) == 1


def dead_letter(r: redis.Redis, p: Pulled, worker: str) -> DeadLetterCall:
    job = job_of(p)
    return DeadLetterCall(
        stream=stream_of(p),
        dead_letters=KEYS.dead_letters(),
        worker=worker,
        entry_id=p.entry_id,
        now=timestamp(),
        job_id=job,
        reason="bad_payload",
        message="no",
        deliveries=1,
        payload=b"",
        terminal=Terminal(job=target(job), finish=ending(job)),
    )


def test_dead_letter_ends_the_job_only_for_its_owner(r: redis.Redis) -> None:
    groups(r)
    submit(r, "j")
    (p,) = pull(r, "w1", 1)
    accept(r, "w1", [p])
    assert DeadLetterCall.parse(run(r, dead_letter(r, p, "w2"))) is False
    assert r.xlen(KEYS.dead_letters()) == 0 and r.hget(KEYS.job("j"), "status") == b"running"
    assert DeadLetterCall.parse(run(r, dead_letter(r, p, "w1"))) is True
    assert r.xlen(KEYS.dead_letters()) == 1 and r.hget(KEYS.job("j"), "status") == b"finished"
    assert r.exists(KEYS.result("j")) and r.zcard(KEYS.tenant_running(TENANT, None)) == 0


def test_redeliver_and_requeue_act_only_for_the_owner(r: redis.Redis) -> None:
    groups(r)
    submit(r, "j")
    (p,) = pull(r, "w1", 1)
    accept(r, "w1", [p])
    stream = stream_of(p)

    def redeliver(worker: str) -> RedeliverCall:
        return RedeliverCall(stream=stream, worker=worker, entry_id=p.entry_id, now=timestamp())

    assert RedeliverCall.parse(run(r, redeliver("w2"))) is None
    assert RedeliverCall.parse(run(r, redeliver("w1"))) == 2

    def requeue(worker: str) -> RequeueCall:
        return RequeueCall(
            stream=stream,
            hash=KEYS.job("j"),
            queued=KEYS.tenant_queued(TENANT, None),
            running=KEYS.tenant_running(TENANT, None),
            worker=worker,
            entry_id=p.entry_id,
            now=timestamp(),
            job_id="j",
        )

    assert RequeueCall.parse(run(r, requeue("w2"))) is None
    again = RequeueCall.parse(run(r, requeue("w1")))
    assert again is not None and again != p.entry_id
    assert r.hget(KEYS.job("j"), "entry") == again.encode()
    assert RequeueCall.parse(run(r, requeue("w1"))) is None  # the old entry is no one's


def test_claim_orphans_takes_a_dead_workers_entries(r: redis.Redis) -> None:
    groups(r)
    submit(r, "j")
    (p,) = pull(r, "gone", 1)
    r.hset(KEYS.worker("alive"), "worker", '"alive"')
    call = ClaimOrphansCall(
        stream=stream_of(p),
        worker="new",
        candidates=[Candidate(hash=KEYS.worker(name), name=name) for name in ("alive", "gone")],
        min_idle_ms=0,
        most=5,
    )
    (claimed,) = ClaimOrphansCall.parse(run(r, call))
    assert (claimed.entry_id, claimed.deliveries) == (p.entry_id, 2)
    assert claimed.fields is not None and claimed.fields[b"job_id"] == b"j"
    assert r.xpending(stream_of(p), GROUP)["consumers"] == [{"name": b"new", "pending": 1}]


def test_probe_finds_nothing_refused_for_the_default_user(r: redis.Redis) -> None:
    probe = KEYS.probe("w")
    call = ProbeCall(
        stream=f"{probe}:stream",
        hash=f"{probe}:hash",
        string=f"{probe}:string",
        zset=f"{probe}:zset",
        worker="w",
        channel=KEYS.telemetry_channel(),
    )
    assert ProbeCall.parse(run(r, call)) == []
    assert not r.exists(call.stream, call.hash, call.string, call.zset)


def test_lease_is_held_renewed_and_released_by_its_owner_only(r: redis.Redis) -> None:
    def lease(owner: str, action: Literal["take", "release"]) -> bool:
        call = LeaseCall(lease=KEYS.batch_lease("b"), owner=owner, ms=10_000, action=action)
        return LeaseCall.parse(run(r, call))

    assert lease("a", "take") and lease("a", "take")
    assert not lease("b", "take") and not lease("b", "release")
    assert lease("a", "release") and lease("b", "take")


# --- worker/queue.py maps a held job onto the calls' fields as the headers say -----


def _sent(pipe: redis.client.Pipeline) -> tuple[list[object], list[object]]:
    """KEYS and ARGV of the one EVALSHA queued on `pipe`."""
    ((command, *rest), _options) = pipe.command_stack[0]
    assert command == "EVALSHA"
    _sha, numkeys, *flat = rest
    return list(flat[:numkeys]), list(flat[numkeys:])


def test_tick_and_pull_calls_match_what_the_worker_queue_sends(r: redis.Redis) -> None:
    groups(r)
    submit(r, "a")
    submit(r, "b", "interactive")
    queue = WorkerQueue(r, KEYS, "w1")
    a, b = sorted(pull(r, "w1", 2), key=job_of)
    result, finish = outcome("b")
    writes = [
        TickWrite(Delivery(a.entry_id, "a", None, band=KEYS.bands()[a.band]), "a", []),
        TickWrite(
            Delivery(b.entry_id, "b", None, band=KEYS.bands()[b.band]),
            "b",
            [TokenEvent(job_id="b", index=0, token_id=7, text="x")],
            (result, finish),
        ),
    ]
    pipe = r.pipeline(transaction=False)
    queue.tick(writes, pipe)
    sent_keys, sent_args = _sent(pipe)
    call = TickCall(
        worker="w1",
        now=str(sent_args[3]),
        held=[
            held(a, []),
            held(b, [TokenWrite(index=0, data=encode(writes[1].events[0]))], ending("b")),
        ],
    )
    assert (call.keys(), call.args()) == (sent_keys, sent_args)

    pipe = r.pipeline(transaction=False)
    queue.pull(3, pipe, extra=1, floor=("batch",))
    bands = [PullBand(stream=x.stream, name=x.name, floor=x.name == "batch") for x in KEYS.bands()]
    call_pull = PullCall(
        worker="w1", bands=bands, pulls=KEYS.pulls(), count=3, guard=STARVATION_GUARD, extra=1
    )
    assert (call_pull.keys(), call_pull.args()) == _sent(pipe)


def test_the_producer_submits_through_its_call(r: redis.Redis) -> None:
    handle = Producer(r).submit(prompt="hi", job_id="p1", priority="batch")
    assert r.hget(KEYS.job("p1"), "entry") == handle.entry_id.encode()
    assert r.hget(KEYS.job("p1"), "band") == b"batch"
    assert abs(float(r.hget(KEYS.job("p1"), "submitted_at") or 0) - time.time()) < 60
