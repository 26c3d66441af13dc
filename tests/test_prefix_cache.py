"""Prefix caching (issue 13): jobs that share a prefix share its KV blocks.

Outputs never change (greedy tokens equal with the cache on and off, fp32), shared
blocks are counted once and come back when the last session lets go, different
`cache_salt`s never share, and admission fits more shared-prefix sessions into the
same KV budget without ever admitting one it cannot finish.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.models import make_hf_llama, save_hf_llama
from tokenfleet.kv import BlockManager
from tokenfleet.kv.prefix import chain_hashes, root_hash
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.protocol import GenerationRequest
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig

MiB = 1024 * 1024
BLOCK = 16
SYSTEM = [(13 * k) % 200 + 5 for k in range(40)]  # 2.5 blocks: ends mid-block


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tmp_path_factory.mktemp("llama")
    save_hf_llama(make_hf_llama(seed=3), Path(folder))
    return load_model(str(folder), dtype="float32")


def shared_prefix_jobs(
    n: int, *, prefix: list[int] = SYSTEM, **extra: object
) -> list[GenerationRequest]:
    """n jobs: the same prefix, then a unique tail of 1..3 blocks' worth; varied budgets."""
    return [
        GenerationRequest(
            job_id=f"job-{i}",
            prompt_ids=prefix + [(7 * i + 3 * k) % 250 + 1 for k in range(3 + 9 * i)],
            max_new_tokens=4 + 5 * (i % 4),  # some finish while others still read the prefix
            ignore_eos=True,
            **extra,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


def run_all(
    engine: Engine, requests: list[GenerationRequest], *, stagger: bool = False
) -> dict[str, list[int]]:
    """Submit (all at once, or one per tick with `stagger`) and run to the end."""
    tokens: dict[str, list[int]] = defaultdict(list)
    pending = list(requests)
    if not stagger:
        for r in pending:
            assert engine.submit(r).accepted
        pending = []
    steps = 0
    while pending or engine.has_work:
        if pending:
            assert engine.submit(pending.pop(0)).accepted
        out = engine.step()
        for event in out.tokens:
            tokens[event.job_id].append(event.token_id)
        for done in out.finished:
            assert done.result.finish_reason is FinishReason.LENGTH, done.result.error
        steps += 1
        assert steps < 5000
    return dict(tokens)


def engine(loaded: LoadedModel, *, prefix_cache: bool, max_batch: int = 8) -> Engine:
    return Engine(
        loaded,
        EngineConfig(
            kv_budget_bytes=8 * MiB,
            max_active=max_batch,
            max_batch_size=max_batch,
            max_prefill_tokens_per_tick=48,
            max_waiting=64,
            block_size=BLOCK,
            prefix_cache=prefix_cache,
        ),
    )


def assert_pool_whole(eng: Engine) -> None:
    blocks = eng.blocks
    blocks.check_invariants()
    assert blocks.num_in_use_blocks == 0 and eng.kv_used_bytes == 0
    assert blocks.num_free_blocks == blocks.num_blocks  # cached + empty: the whole pool
    assert blocks.available_blocks == blocks.num_blocks


@pytest.mark.parametrize("model", ["tiny", "random_llama"])
@pytest.mark.parametrize("concurrency", [1, 2, 4, 8])
def test_greedy_tokens_are_the_same_with_the_cache_on_and_off(
    model: str, concurrency: int, request: pytest.FixtureRequest
) -> None:
    loaded: LoadedModel = request.getfixturevalue(model)
    assert loaded.dtype == torch.float32
    jobs = shared_prefix_jobs(8)
    off = run_all(engine(loaded, prefix_cache=False, max_batch=concurrency), jobs)
    on_engine = engine(loaded, prefix_cache=True, max_batch=concurrency)
    # staggered: later jobs arrive while earlier ones hold (or just released) the prefix
    on = run_all(on_engine, jobs, stagger=True)
    assert on == off
    stats = on_engine.blocks.stats
    # every job after the first finds the prefix's 2 full blocks (its 3rd is partial)
    assert stats.hits_blocks >= 2 * (len(jobs) - 1)
    assert stats.hits_tokens >= 2 * BLOCK * (len(jobs) - 1)
    assert_pool_whole(on_engine)
    # a second wave reuses what the first left cached, and still agrees
    again = run_all(on_engine, [j.model_copy(update={"job_id": j.job_id + "-b"}) for j in jobs])
    assert {k.removesuffix("-b"): v for k, v in again.items()} == off
    assert_pool_whole(on_engine)


def test_jobs_admitted_together_find_the_blocks_the_first_one_computed(
    tiny: LoadedModel,
) -> None:
    """All admitted in one go, before any block is cached: each one looks the cache up
    again just before its first prefill chunk, and finds what earlier ones computed in
    the ticks since (48 prefill tokens a tick, a 4-block shared prefix)."""
    prefix = [(11 * k) % 230 + 3 for k in range(4 * BLOCK)]
    jobs = shared_prefix_jobs(6, prefix=prefix)
    off = run_all(engine(tiny, prefix_cache=False), jobs)
    eng = engine(tiny, prefix_cache=True)
    on = run_all(eng, jobs)  # all submitted before the first step
    assert on == off
    stats = eng.blocks.stats
    assert stats.queries_tokens == sum(len(j.prompt_ids or []) for j in jobs)
    # in tick 2 job 0 computes its 4th block: the others wait for it rather than compute
    # it beside job 0 (tests/test_prefix_fork.py), so each finds all 4
    assert stats.hits_blocks == 5 * 4
    assert_pool_whole(eng)


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(tiny: LoadedModel) -> None:
    """Two identical prompts of exactly two blocks: the second reuses only the first
    block (the last token must be computed for logits) and samples the same tokens."""
    prompt = [(5 * k) % 240 + 1 for k in range(2 * BLOCK)]
    jobs = [
        GenerationRequest(job_id=f"same-{i}", prompt_ids=prompt, max_new_tokens=8, ignore_eos=True)
        for i in range(2)
    ]
    eng = engine(tiny, prefix_cache=True)
    got = run_all(eng, jobs, stagger=True)
    assert got["same-0"] == got["same-1"]
    assert eng.blocks.stats.hits_blocks == 1  # block 0 only: block 1 holds the last token
    assert_pool_whole(eng)


def test_a_resumed_job_finds_its_prompt_and_emitted_tokens_cached(tiny: LoadedModel) -> None:
    job = GenerationRequest(
        job_id="r", prompt_ids=SYSTEM + [9] * 30, max_new_tokens=40, ignore_eos=True
    )
    eng = engine(tiny, prefix_cache=True)
    whole = run_all(eng, [job])["r"]
    # the job "crashed" after 25 tokens on another worker; this one resumes it
    eng.submit(job, resume_ids=whole[:25])
    rest: list[int] = []
    while eng.has_work:
        rest += [e.token_id for e in eng.step().tokens]
    assert whole[:25] + rest == whole
    known = len(job.prompt_ids or []) + 25
    assert eng.blocks.stats.hits_tokens >= (known - 1) // BLOCK * BLOCK  # all full blocks
    assert_pool_whole(eng)


def test_different_salts_never_share_and_the_same_salt_does(tiny: LoadedModel) -> None:
    eng = engine(tiny, prefix_cache=True)
    salted = [
        GenerationRequest(
            job_id=f"{salt}-{i}",
            prompt_ids=[*SYSTEM, i + 1],
            max_new_tokens=3,
            ignore_eos=True,
            cache_salt=salt,
        )
        for salt in ("tenant-a", "tenant-b")
        for i in range(2)
    ]
    unsalted = GenerationRequest(
        job_id="none", prompt_ids=[*SYSTEM, 7], max_new_tokens=3, ignore_eos=True
    )
    out = run_all(eng, [*salted, unsalted], stagger=True)
    assert set(out) == {"tenant-a-0", "tenant-a-1", "tenant-b-0", "tenant-b-1", "none"}
    # hits: the second job of each salt only (2 full blocks each); "none" finds nothing
    assert eng.blocks.stats.hits_blocks == 2 * 2
    # and the addresses differ per salt, so no lookup could cross
    a, b, none = (
        chain_hashes(SYSTEM, BLOCK, root_hash("m", "tenant:default", salt))
        for salt in ("a", "b", None)
    )
    assert not set(a) & set(b) and not set(a) & set(none)
    assert_pool_whole(eng)


def test_admission_fits_more_shared_prefix_sessions_and_never_too_many(tiny: LoadedModel) -> None:
    """A KV budget of 24 blocks; each job = 4 shared blocks + 1 own block of prompt +
    1 block of new tokens (6 blocks alone). Without the cache 4 fit at once; with it,
    the prefix is charged once: 4 + 2 * k <= 24 -> 10."""
    prefix = [(3 * k) % 200 + 2 for k in range(4 * BLOCK)]
    jobs = [
        GenerationRequest(
            job_id=f"s{i}", prompt_ids=prefix + [i + 1] * 8, max_new_tokens=BLOCK, ignore_eos=True
        )
        for i in range(16)
    ]

    def admitted_at_peak(prefix_cache: bool) -> tuple[int, Engine]:
        probe = Engine(tiny, EngineConfig(block_size=BLOCK))
        per_block = probe.budget.layout.bytes_per_block
        eng = Engine(
            tiny,
            EngineConfig(
                kv_budget_bytes=24 * per_block,
                max_active=64,
                max_batch_size=64,
                max_prefill_tokens_per_tick=4096,
                max_waiting=64,
                block_size=BLOCK,
                prefix_cache=prefix_cache,
            ),
        )
        # the first job computes (and registers) the prefix
        assert eng.submit(jobs[0]).reason is AdmissionReason.ADMITTED
        eng.step()
        peak = 1
        for job in jobs[1:]:
            eng.submit(job)
        peak = max(peak, len(eng.sessions))
        finished = []
        while eng.has_work:
            finished += [f.result.finish_reason for f in eng.step().finished]
            peak = max(peak, len(eng.sessions))
            eng.blocks.check_invariants()
            assert eng.blocks.num_reserved_blocks <= eng.blocks.num_blocks
        assert finished == [FinishReason.LENGTH] * len(jobs)  # every admitted one finished
        assert_pool_whole(eng)
        return peak, eng

    without, _ = admitted_at_peak(False)
    with_cache, eng = admitted_at_peak(True)
    assert without == 4
    assert with_cache == 10
    assert with_cache > without
    assert eng.blocks.stats.hits_blocks >= 4 * 15


# ---- the allocator alone: random interleavings keep the invariants ------------------

TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=70)  # few distinct ids: shared prefixes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "lookup", "append", "finish", "cancel"]),
            TOKENS,
            st.integers(1, 40),
        ),
        min_size=1,
        max_size=60,
    ),
    num_blocks=st.integers(4, 40),
    salt=st.sampled_from([None, "x"]),
)
def test_random_interleavings_keep_refcounts_and_bytes(
    ops: list[tuple[str, list[int], int]], num_blocks: int, salt: str | None
) -> None:
    """admit (reserve + find the cached prefix), append (compute and register tokens),
    finish/cancel (free): invariants after every step; at the end in use = 0 and
    cached + empty = the pool. A session never allocates outside what it reserved."""
    size = 4
    blocks = BlockManager(num_blocks, size, prefix_cache=True)
    root = root_hash("model", "tenant:default", salt)
    live: dict[str, tuple[list[int], int, int]] = {}  # sid -> (tokens so far, computed, reserved)
    serial = 0
    for op, tokens, new in ops:
        if op == "admit":
            hashes = chain_hashes(tokens[:-1], size, root)
            total = len(tokens) + new
            if blocks.can_reserve(total, hashes):
                sid = f"s{serial}"
                serial += 1
                before, cost = blocks.available_blocks, blocks.cost(total, hashes)
                cached = blocks.reserve(sid, total, hashes)
                assert cached % size == 0 and cached < len(tokens)
                assert before - blocks.available_blocks == cost
                table = blocks.block_table(sid)
                assert len(table) == cached // size
                live[sid] = (list(tokens), cached, total)
            else:
                assert blocks.cost(total, hashes) > blocks.available_blocks
        elif live:
            sid = sorted(live)[len(tokens) % len(live)]
            toks, computed, total = live[sid]
            if op == "append" and len(toks) < total:
                grow = min(new, total - len(toks))
                toks = toks + [1] * grow
                computed = len(toks) - 1
                blocks.ensure(sid, computed + 1)
                full = computed // size
                for index, address in enumerate(chain_hashes(toks[: full * size], size, root)):
                    blocks.register(sid, index, address)
                live[sid] = (toks, computed, total)
            elif op == "lookup":  # again, before its prefill: what others registered since
                table, committed = blocks.block_table(sid), blocks.num_reserved_blocks
                appended = blocks.used_tokens(sid) > blocks.cached_tokens(sid)
                got = blocks.extend_prefix(sid, chain_hashes(toks[:-1], size, root))
                assert got % size == 0 and got < len(toks)
                assert blocks.num_reserved_blocks <= committed  # never commits more
                now = blocks.block_table(sid)
                assert now[: len(table)] == table
                if appended:  # it has blocks of its own: too late to adopt any
                    assert now == table
                live[sid] = (toks, max(computed, got), total)
            elif op in ("finish", "cancel"):
                blocks.free(sid)
                del live[sid]
        blocks.check_invariants()
        assert blocks.num_reserved_blocks <= blocks.num_blocks
    for sid in list(live):
        blocks.free(sid)
    blocks.check_invariants()
    assert blocks.num_in_use_blocks == 0
    assert blocks.num_free_blocks == blocks.num_blocks
    assert blocks.available_blocks == blocks.num_blocks


def test_cached_blocks_are_reclaimed_tail_first_and_never_from_a_session() -> None:
    size = 2
    blocks = BlockManager(6, size, prefix_cache=True)
    root = root_hash("m", "tenant:default")
    a = [1, 2, 3, 4, 5, 6, 7]
    ha = chain_hashes(a[:-1], size, root)  # 3 full blocks before the last token
    assert blocks.reserve("a", 8, ha) == 0
    table_a = blocks.ensure("a", 7)
    for i, h in enumerate(ha):
        blocks.register("a", i, h)
    blocks.free("a")
    assert blocks.num_cached_blocks == 3 and blocks.num_in_use_blocks == 0
    assert blocks.match(ha) == table_a[:3]

    # b shares a's first block; c then needs 4 fresh blocks: 3 empty + 1 reclaimed
    assert blocks.reserve("b", 4, ha[:1]) == size
    assert blocks.available_blocks == 4 and not blocks.can_reserve(4 * size + 1)
    blocks.reserve("c", 4 * size)
    table_c = blocks.ensure("c", 4 * size)
    assert blocks.stats.evictions == 1
    assert blocks.match(ha) == table_a[:2]  # the chain's tail went first
    blocks.ensure("b", 4)  # b's own second block: the last free one, reclaimed
    assert blocks.stats.evictions == 2 and blocks.match(ha) == table_a[:1]
    assert not set(blocks.block_table("b")) & set(table_c)
    assert blocks.num_free_blocks == 0 and blocks.available_blocks == 0
    blocks.check_invariants()
    blocks.free("b")
    blocks.free("c")
    assert blocks.num_cached_blocks == 1  # a's first block, shared by b, cached again
    blocks.check_invariants()
