"""Redis key names: one prefix, one namespace per kind, and no two kinds meeting on one name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.keys import (
    CANCEL_TTL_S,
    DEAD_LETTERS_MAXLEN,
    DEFAULT_MODEL,
    DEFAULT_PREFIX,
    EVENTS_MAXLEN,
    EVENTS_TTL_S,
    GROUP,
    JOB_STATE_TTL_S,
    RESULT_TTL_S,
    WORKER_TTL_S,
    Keys,
)
from tokenfleet.protocol import (
    JOB_ID_PATTERN,
    MAX_NEW_TOKENS,
    MODEL_NAME_PATTERN,
    GenerationRequest,
    new_job_id,
)

job_ids = st.from_regex(JOB_ID_PATTERN, fullmatch=True)
model_names = st.from_regex(MODEL_NAME_PATTERN, fullmatch=True)
worker_names = st.text(min_size=1, max_size=40)
prefixes = st.sampled_from([DEFAULT_PREFIX, "fleet-b:", "x", "{tf}:", "a:b:"])

PER_JOB_KEYS = ("job", "events", "result", "cancel")  # Redis keys named after a job id


def every_key(keys: Keys, job_id: str, model: str | None, worker: str) -> dict[str, str]:
    """Every key (not channel) of one fleet, by kind."""
    return {
        "jobs": keys.jobs(model),
        "queue_cap": keys.queue_cap(model),
        "models": keys.models(),
        "job": keys.job(job_id),
        "events": keys.events(job_id),
        "result": keys.result(job_id),
        "cancel": keys.cancel(job_id),
        "worker": keys.worker(worker),
        "workers": keys.workers(),
        "dead_letters": keys.dead_letters(),
    }


def every_channel(keys: Keys, job_id: str) -> dict[str, str]:
    return {"channel": keys.channel(job_id), "telemetry": keys.telemetry_channel()}


@settings(max_examples=100, deadline=None)
@given(prefixes, job_ids, st.none() | model_names, worker_names)
def test_every_key_and_channel_is_under_the_prefix(
    prefix: str, job_id: str, model: str | None, worker: str
) -> None:
    keys = Keys(prefix)
    names = {**every_key(keys, job_id, model, worker), **every_channel(keys, job_id)}
    for kind, name in names.items():
        assert name.startswith(prefix), kind
        assert len(name) > len(prefix), kind


def test_default_prefix_and_exact_names() -> None:
    keys = Keys()
    assert keys.prefix == DEFAULT_PREFIX == "tokenfleet:"
    assert keys.jobs() == "tokenfleet:jobs:default"
    assert keys.queue_cap() == "tokenfleet:jobs:default:cap"
    assert keys.job("abc") == "tokenfleet:job:abc"
    assert keys.events("abc") == "tokenfleet:job:abc:events"
    assert keys.channel("abc") == "tokenfleet:job:abc:live"
    assert keys.result("abc") == "tokenfleet:job:abc:result"
    assert keys.cancel("abc") == "tokenfleet:job:abc:cancel"
    assert keys.worker("w1") == "tokenfleet:worker:w1"
    assert keys.workers() == "tokenfleet:workers"
    assert keys.models() == "tokenfleet:models"
    assert keys.telemetry_channel() == "tokenfleet:telemetry"
    assert keys.dead_letters() == "tokenfleet:dead"


def test_custom_prefix_is_honoured_and_fleets_do_not_share_keys() -> None:
    a, b = Keys("fleet-a:"), Keys("fleet-b:")
    assert a.job("j") == "fleet-a:job:j"
    assert a.jobs("llama") == "fleet-a:jobs:llama"
    names_a = set(every_key(a, "j", "m", "w").values()) | set(every_channel(a, "j").values())
    names_b = set(every_key(b, "j", "m", "w").values()) | set(every_channel(b, "j").values())
    assert not names_a & names_b


def test_jobs_stream_per_model_and_default() -> None:
    keys = Keys()
    assert keys.jobs(None) == keys.jobs() == keys.jobs(DEFAULT_MODEL) == keys.jobs("")
    assert keys.jobs("llama-3.1-8b") == "tokenfleet:jobs:llama-3.1-8b"
    assert keys.jobs("llama") != keys.jobs("qwen") != keys.jobs()
    assert keys.queue_cap("llama") == keys.jobs("llama") + ":cap"
    assert keys.queue_cap("llama") != keys.queue_cap("qwen") != keys.queue_cap()


def test_a_request_routes_to_its_model_stream() -> None:
    keys = Keys()
    assert keys.jobs(GenerationRequest(prompt="x").model) == keys.jobs(DEFAULT_MODEL)
    assert keys.jobs(GenerationRequest(prompt="x", model="qwen").model) == "tokenfleet:jobs:qwen"


def test_group_is_one_constant_name() -> None:
    assert GROUP == "workers"  # one group on every jobs stream, whatever the prefix


@pytest.mark.parametrize("kind", (*PER_JOB_KEYS, "channel"))
@settings(max_examples=60, deadline=None)
@given(a=job_ids, b=job_ids)
def test_distinct_jobs_get_distinct_keys(kind: str, a: str, b: str) -> None:
    make: Callable[[str], str] = getattr(Keys(), kind)
    assert (make(a) == make(b)) == (a == b)


@settings(max_examples=150, deadline=None)
@given(
    ids=st.tuples(job_ids, job_ids),
    models=st.tuples(st.none() | model_names, st.none() | model_names),
    workers=st.tuples(worker_names, worker_names),
)
def test_no_two_key_kinds_collide(
    ids: tuple[str, str], models: tuple[str | None, str | None], workers: tuple[str, str]
) -> None:
    """Across two jobs, models and workers, one name is only ever one (kind, argument)."""
    keys = Keys()
    owner: dict[str, tuple[str, str | None]] = {}
    for job_id, model, worker in zip(ids, models, workers, strict=True):
        named = [(kind, job_id, make(job_id)) for kind, make in _per_job(keys)]
        named += [
            ("jobs", model or DEFAULT_MODEL, keys.jobs(model)),
            ("queue_cap", model or DEFAULT_MODEL, keys.queue_cap(model)),
            ("worker", worker, keys.worker(worker)),
            ("models", None, keys.models()),
            ("workers", None, keys.workers()),
            ("dead_letters", None, keys.dead_letters()),
        ]
        for kind, arg, name in named:
            assert owner.setdefault(name, (kind, arg)) == (kind, arg), name


def _per_job(keys: Keys) -> list[tuple[str, Callable[[str], str]]]:
    return [(kind, getattr(keys, kind)) for kind in PER_JOB_KEYS]


def test_valid_job_ids_cannot_contain_the_key_separator() -> None:
    """The guard that keeps per-job keys apart: ':' is not allowed in a job id."""
    assert ":" not in new_job_id()
    with pytest.raises(ValueError, match="job_id"):
        GenerationRequest(job_id="x:events", prompt="hi")


@pytest.mark.parametrize("suffix_kind", ["events", "result", "cancel"])
def test_job_hash_never_equals_another_jobs_key(suffix_kind: str) -> None:
    keys = Keys()
    other = getattr(keys, suffix_kind)("x")
    with pytest.raises(ValueError, match="invalid job id"):
        keys.job(f"x:{suffix_kind}")  # the only id that could collide is refused
    assert other.endswith(f":{suffix_kind}") or suffix_kind == "events"


def test_lifetimes_are_consistent() -> None:
    assert EVENTS_MAXLEN >= MAX_NEW_TOKENS + 1  # every token event plus the finish event
    for ttl in (JOB_STATE_TTL_S, RESULT_TTL_S, EVENTS_TTL_S, CANCEL_TTL_S, WORKER_TTL_S):
        assert isinstance(ttl, int) and ttl > 0
    assert JOB_STATE_TTL_S >= RESULT_TTL_S  # idempotency outlives the stored result
    assert DEAD_LETTERS_MAXLEN > 0


def test_the_batch_apis_keys_keep_their_names() -> None:
    """Files and batches already stored, and docs/protocol.md, use these names."""
    keys = Keys()
    assert keys.file("file_1") == "tokenfleet:file:file_1"
    assert keys.file_content("file_1") == "tokenfleet:file:file_1:content"
    assert keys.files() == "tokenfleet:files"
    assert keys.files("acme") == "tokenfleet:files:by-tenant:acme"
    assert keys.batch("batch_1") == "tokenfleet:batch:batch_1"
    assert keys.batch_results("batch_1") == "tokenfleet:batch:batch_1:results"
    assert keys.batch_lease("batch_1") == "tokenfleet:batch:batch_1:lease"
    assert keys.batches() == "tokenfleet:batches"
    assert keys.batches("acme") == "tokenfleet:batches:by-tenant:acme"
    assert keys.open_batches() == "tokenfleet:batches:open"
    assert Keys("fleet-b:").batch("b") == "fleet-b:batch:b"
