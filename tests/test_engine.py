"""The engine in process: batching never mixes outputs, decode is never starved,
admission refuses up front, sampling is reproducible, and every block comes back."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.protocol import GenerationRequest, SamplingParams
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig, Finished, StepOutput
from tokenfleet.worker.session import Session

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def jobs(n: int = 8, **extra: object) -> list[GenerationRequest]:
    """n jobs with different prompt lengths and budgets (ignore_eos: fixed lengths)."""
    return [
        GenerationRequest(
            job_id=f"job-{i}",
            prompt_ids=[(7 * i + 3 * k) % 250 + 1 for k in range(1 + 5 * i)],
            max_new_tokens=6 + 3 * i,
            ignore_eos=True,
            **extra,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


class Run:
    """Drive an engine to completion, collecting every output."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.indices: dict[str, list[int]] = defaultdict(list)
        self.texts: dict[str, list[str]] = defaultdict(list)
        self.finished: dict[str, Finished] = {}
        self.steps: list[StepOutput] = []

    def step(self) -> StepOutput:
        out = self.engine.step()
        self.steps.append(out)
        for event in out.tokens:
            self.tokens[event.job_id].append(event.token_id)
            self.indices[event.job_id].append(event.index)
            self.texts[event.job_id].append(event.text)
        for done in out.finished:
            assert done.job_id not in self.finished, "two terminal events for one job"
            self.finished[done.job_id] = done
        return out

    def drain(self, limit: int = 10_000) -> Run:
        for _ in range(limit):
            if not self.engine.has_work:
                return self
            self.step()
        raise AssertionError("engine did not finish")


def run_jobs(model: LoadedModel, requests: list[GenerationRequest], **config: int) -> Run:
    engine = Engine(model, EngineConfig(**{"kv_budget_bytes": 16 * MiB, **config}))  # type: ignore[arg-type]
    for request in requests:
        assert engine.submit(request).accepted
    return Run(engine).drain()


def test_same_jobs_at_any_concurrency_give_identical_tokens(tiny: LoadedModel) -> None:
    requests = jobs(8)
    runs = {
        c: run_jobs(tiny, requests, max_active=c, max_batch_size=c, max_waiting=8)
        for c in (1, 2, 4, 8)
    }
    for c, run in runs.items():
        assert run.tokens == runs[1].tokens, f"concurrency {c} changed some session's tokens"
        for request in requests:
            n = request.max_new_tokens
            assert run.indices[request.job_id] == list(range(n))
            assert run.finished[request.job_id].event.reason == FinishReason.LENGTH
        assert run.engine.kv_used_bytes == 0 and run.engine.blocks.num_reserved_blocks == 0
    ticks = [runs[c].engine.stats.ticks for c in (1, 2, 4, 8)]
    occupancy = [runs[c].engine.telemetry()["batch_size_mean"] for c in (1, 2, 4, 8)]
    assert ticks == sorted(ticks, reverse=True) and ticks[0] > ticks[-1]
    assert occupancy == sorted(occupancy) and occupancy[0] < occupancy[-1]  # type: ignore[operator]


def test_decoding_session_gets_a_token_every_tick_while_prompts_prefill(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB, max_prefill_tokens_per_tick=8))
    run = Run(engine)
    engine.submit(
        GenerationRequest(job_id="first", prompt_ids=[1, 2, 3], max_new_tokens=40, ignore_eos=True)
    )
    run.step()  # prefill + first token
    assert run.indices["first"] == [0]
    for i in range(4):  # a burst of long prompts: 4 x 30 tokens at 8 prefill tokens per tick
        engine.submit(
            GenerationRequest(
                job_id=f"new-{i}", prompt_ids=list(range(1, 31)), max_new_tokens=4, ignore_eos=True
            )
        )
    for tick in range(1, 16):
        plan_before = engine.scheduler.num_waiting
        out = run.step()
        first = [e.index for e in out.tokens if e.job_id == "first"]
        assert first == [tick], f"tick {tick}: the in-flight session got {first}"
        assert out.prefill_tokens <= 8
        if plan_before:
            assert out.prefill_tokens >= 1
    run.drain()
    assert engine.kv_used_bytes == 0


def test_decode_comes_before_prefill_in_one_tick(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB, max_prefill_tokens_per_tick=4))
    engine.submit(GenerationRequest(job_id="a", prompt_ids=[5], max_new_tokens=5, ignore_eos=True))
    engine.step()
    engine.submit(
        GenerationRequest(
            job_id="b", prompt_ids=list(range(1, 11)), max_new_tokens=2, ignore_eos=True
        )
    )
    engine._expire(engine.clock())
    engine._promote(engine.clock())
    plan = engine.scheduler.schedule()
    assert [d.seq.session_id for d in plan.decode] == ["a"]
    assert [(c.seq.session_id, c.start, c.length) for c in plan.prefill] == [("b", 0, 4)]


def test_every_admission_reason_is_reachable_and_explained(tiny: LoadedModel) -> None:
    # A pool of 4 blocks x 16 tokens = 64 tokens; 1 active slot; 1 local waiting slot.
    layout_bytes = Engine(
        tiny, EngineConfig(kv_budget_bytes=16 * MiB)
    ).budget.layout.bytes_per_block
    engine = Engine(
        tiny,
        EngineConfig(kv_budget_bytes=4 * layout_bytes, max_active=1, max_waiting=1),
    )
    ok = engine.submit(GenerationRequest(job_id="ok", prompt_ids=[1] * 10, max_new_tokens=10))
    assert ok.reason == AdmissionReason.ADMITTED
    dup = engine.submit(GenerationRequest(job_id="ok", prompt_ids=[1], max_new_tokens=1))
    assert dup.reason == AdmissionReason.REJECTED_DUPLICATE
    big = engine.submit(GenerationRequest(job_id="big", prompt_ids=[1] * 60, max_new_tokens=10))
    assert big.reason == AdmissionReason.REJECTED_KV_BUDGET and "64" in big.message
    queued = engine.submit(GenerationRequest(job_id="q", prompt_ids=[1] * 3, max_new_tokens=3))
    assert queued.reason == AdmissionReason.QUEUED
    full = engine.submit(GenerationRequest(job_id="f", prompt_ids=[1] * 3, max_new_tokens=3))
    assert full.reason == AdmissionReason.REJECTED_QUEUE_FULL
    bad = engine.submit(GenerationRequest(job_id="bad", prompt_ids=[10**6], max_new_tokens=3))
    assert bad.reason == AdmissionReason.REJECTED_INVALID and "vocabulary" in bad.message

    small_scratch = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB, scratch_budget_bytes=1000))
    scratch = small_scratch.submit(GenerationRequest(job_id="s", prompt_ids=[1], max_new_tokens=1))
    assert (
        scratch.reason == AdmissionReason.REJECTED_SCRATCH_BUDGET and "scratch" in scratch.message
    )

    run = Run(engine).drain()
    rejected = {
        j: f.event for j, f in run.finished.items() if f.event.reason == FinishReason.REJECTED
    }
    assert {e.error.reason for e in rejected.values() if e.error} == {
        "rejected_kv_budget",
        "rejected_queue_full",
        "rejected_invalid",
    }
    assert run.finished["ok"].event.reason != FinishReason.REJECTED
    assert run.finished["q"].event.usage.completion_tokens >= 1  # waited, then ran
    assert engine.kv_used_bytes == 0 and engine.blocks.num_reserved_blocks == 0
    assert engine.telemetry()["rejected_total"] == 4  # the duplicate counts, unanswered


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny: LoadedModel) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    target = GenerationRequest(
        job_id="target",
        prompt_ids=[3, 1, 4, 1, 5],
        max_new_tokens=24,
        sampling=sampling,
        ignore_eos=True,
    )
    alone = run_jobs(tiny, [target]).tokens["target"]
    others = [
        GenerationRequest(
            job_id=f"other-{i}",
            prompt_ids=[9, 2, 6][: i + 1],
            max_new_tokens=30,
            sampling=SamplingParams(temperature=1.2, seed=i),
            ignore_eos=True,
        )
        for i in range(3)
    ]
    crowded = run_jobs(tiny, [*others[:2], target, others[2]]).tokens["target"]
    assert alone == crowded
    other_seed = target.model_copy(update={"sampling": sampling.model_copy(update={"seed": 99})})
    assert run_jobs(tiny, [other_seed]).tokens["target"] != alone


def test_resumed_job_continues_exactly_where_it_stopped(tiny: LoadedModel) -> None:
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.95, seed=5)):
        request = GenerationRequest(
            job_id="r", prompt="resume me", max_new_tokens=20, sampling=sampling, ignore_eos=True
        )
        full = run_jobs(tiny, [request])
        engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
        engine.submit(request, resume_ids=full.tokens["r"][:7])
        resumed = Run(engine).drain()
        assert resumed.indices["r"] == list(range(7, 20))
        assert full.tokens["r"][:7] + resumed.tokens["r"] == full.tokens["r"]
        assert resumed.finished["r"].result.text == full.finished["r"].result.text


def test_cancel_takes_effect_within_a_tick_and_frees_kv(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
    run = Run(engine)
    engine.submit(
        GenerationRequest(job_id="c", prompt_ids=[1, 2], max_new_tokens=100, ignore_eos=True)
    )
    engine.submit(
        GenerationRequest(job_id="keep", prompt_ids=[3], max_new_tokens=10, ignore_eos=True)
    )
    for _ in range(3):
        run.step()
    assert engine.kv_used_bytes > 0
    assert engine.cancel("c")
    out = run.step()
    assert [f.event.reason for f in out.finished if f.job_id == "c"] == [FinishReason.CANCELLED]
    assert not [e for e in out.tokens if e.job_id == "c"]
    run.drain()
    assert run.finished["keep"].event.reason == FinishReason.LENGTH
    assert engine.kv_used_bytes == 0


def test_deadline_passed_while_waiting_spends_no_prefill(tiny: LoadedModel) -> None:
    now = [1000.0]
    engine = Engine(
        tiny, EngineConfig(kv_budget_bytes=16 * MiB, max_active=1), clock=lambda: now[0]
    )
    engine.submit(
        GenerationRequest(job_id="busy", prompt_ids=[1], max_new_tokens=50, ignore_eos=True)
    )
    engine.submit(
        GenerationRequest(job_id="late", prompt_ids=[1] * 30, max_new_tokens=5, deadline=1001.0)
    )
    run = Run(engine)
    run.step()
    prefill_before = engine.stats.snapshot(
        active=0, waiting=0, kv_used_bytes=0, kv_budget_bytes=1, scratch_used=0, scratch_budget=1
    )["prefill_tokens_total"]
    now[0] = 1002.0
    out = run.step()
    assert [f.event.reason for f in out.finished] == [FinishReason.DEADLINE]
    assert sum(s.prefill_tokens for s in run.steps[1:]) == 0 and prefill_before == 1
    assert run.finished["late"].event.usage.completion_tokens == 0


def test_queue_deadline_ends_an_unstarted_job_before_any_prefill(tiny: LoadedModel) -> None:
    now = [1000.0]
    engine = Engine(
        tiny, EngineConfig(kv_budget_bytes=16 * MiB, max_active=1), clock=lambda: now[0]
    )
    engine.submit(
        GenerationRequest(job_id="busy", prompt_ids=[1], max_new_tokens=50, ignore_eos=True)
    )
    # Started in time: its queue deadline no longer matters once it runs.
    run = Run(engine)
    run.step()
    engine.submit(GenerationRequest(job_id="stale", prompt_ids=[2] * 9, queue_deadline=999.0))
    engine.submit(GenerationRequest(job_id="wait", prompt_ids=[3] * 9, queue_deadline=1001.0))
    now[0] = 1001.5  # "wait" is still queued behind "busy"
    run.drain()
    for job_id in ("stale", "wait"):
        done = run.finished[job_id]
        assert done.event.reason == FinishReason.DEADLINE
        assert done.event.error is not None and done.event.error.reason == "queue_deadline"
        assert done.event.usage.completion_tokens == 0
    assert run.finished["busy"].event.reason == FinishReason.LENGTH
    assert sum(s.prefill_tokens for s in run.steps[1:]) == 0  # only "busy"'s first tick


def test_a_dropped_job_frees_its_kv_and_ends_without_a_terminal_event(
    tiny: LoadedModel,
) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
    run = Run(engine)
    for job_id in ("lost", "kept"):
        engine.submit(
            GenerationRequest(job_id=job_id, prompt_ids=[5, 6], max_new_tokens=40, ignore_eos=True)
        )
    for _ in range(3):
        run.step()
    before = len(run.tokens["lost"])
    assert before > 0
    assert engine.drop("lost") and not engine.drop("lost")
    run.drain()
    assert set(run.finished) == {"kept"}
    assert len(run.tokens["lost"]) == before  # nothing computed for it after the drop
    assert engine.kv_used_bytes == 0
    assert engine.telemetry()["lost_total"] == 1


def test_room_is_what_the_next_tick_can_start_plus_the_waiting_list(tiny: LoadedModel) -> None:
    config = EngineConfig(
        kv_budget_bytes=16 * MiB, max_active=64, max_waiting=2, max_prefill_tokens_per_tick=64
    )
    engine = Engine(tiny, config)
    # 64 free slots, but one tick prefills 64 tokens: 2 prompts of the assumed 32 tokens,
    # plus the 2 places of the waiting list.
    assert engine.room() == 4
    for i in range(4):
        request = GenerationRequest(job_id=f"r{i}", prompt_ids=[i + 1] * 32, max_new_tokens=4)
        assert engine.submit(request).accepted
    assert engine.room() == 0  # 128 prompt tokens wait for prefill: nothing more now
    engine.step()  # 64 of them prefilled
    assert engine.room() == 0
    engine.step()
    assert engine.room() == 4  # all started: the next tick's prefill is free again


def test_stop_strings_and_stop_ids_end_the_job_with_text_cut(tiny: LoadedModel) -> None:
    base = run_jobs(
        tiny, [GenerationRequest(job_id="s", prompt="abc", max_new_tokens=30, ignore_eos=True)]
    )
    tokens, text = base.tokens["s"], base.finished["s"].result.text
    stop_token = tokens[10]
    by_id = run_jobs(
        tiny,
        [
            GenerationRequest(
                job_id="s",
                prompt="abc",
                max_new_tokens=30,
                stop_token_ids=[stop_token],
                ignore_eos=True,
            )
        ],
    )
    first = tokens.index(stop_token)
    assert by_id.tokens["s"] == tokens[:first]
    assert by_id.finished["s"].event.reason == FinishReason.STOP
    # a stop string made of text the model really produces
    visible = [i for i, ch in enumerate(text) if ch.isprintable() and ch != "\ufffd"]
    if len(visible) >= 2:
        cut = visible[len(visible) // 2]
        stop = text[cut : cut + 1]
        by_text = run_jobs(
            tiny,
            [
                GenerationRequest(
                    job_id="s", prompt="abc", max_new_tokens=30, stop=[stop], ignore_eos=True
                )
            ],
        )
        result = by_text.finished["s"].result
        assert result.finish_reason == FinishReason.STOP
        assert result.text == text[: text.index(stop)]
        assert "".join(by_text.texts["s"]) == result.text


def test_text_deltas_concatenate_to_the_result(tiny: LoadedModel) -> None:
    run = run_jobs(tiny, jobs(4))
    for job_id, done in run.finished.items():
        assert "".join(run.texts[job_id]) == done.result.text
        assert done.result.token_ids == run.tokens[job_id]


def test_failure_inside_the_forward_fails_only_that_job(tiny: LoadedModel) -> None:
    def poison(session: Session) -> None:
        if session.request.metadata.get("poison"):
            raise RuntimeError("injected fault")

    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB), fault=poison)
    requests = jobs(4)
    requests[2] = requests[2].model_copy(update={"metadata": {"poison": True}})
    for request in requests:
        engine.submit(request)
    run = Run(engine).drain()
    assert run.finished["job-2"].event.reason == FinishReason.ERROR
    error = run.finished["job-2"].event.error
    assert error is not None and "injected fault" in error.message
    clean = run_jobs(tiny, [r for i, r in enumerate(jobs(4)) if i != 2])
    for job_id in ("job-0", "job-1", "job-3"):
        assert run.tokens[job_id] == clean.tokens[job_id]
    assert engine.kv_used_bytes == 0


def test_engine_matches_transformers_generate(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
        tie_word_embeddings=False,
    )
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    prompts = [
        [(13 * i + 7 * k) % 255 + 1 for k in range(n)]
        for i, n in enumerate([1, 3, 7, 12, 18, 25, 33, 40])
    ]
    requests = [
        GenerationRequest(job_id=f"p{i}", prompt_ids=p, max_new_tokens=16, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    run = run_jobs(model, requests)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = ref.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                min_new_tokens=16,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
        assert run.tokens[f"p{i}"] == expected, f"prompt {i} (length {len(prompt)})"


def test_the_outbox_holds_what_to_publish_and_the_outcome_the_moment_it_is_decided(
    tiny: LoadedModel,
) -> None:
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=16 * MiB))
    full = run_jobs(tiny, [GenerationRequest(job_id="r", prompt="abc", max_new_tokens=10)])
    resumed = GenerationRequest(job_id="r", prompt="abc", max_new_tokens=10)
    engine.submit(resumed, resume_ids=full.tokens["r"][:4])
    box = engine.outbox("r")
    assert box is not None and box.sent == 4 and box.unsent() == []  # published before
    engine.step()
    assert [e.index for e in box.unsent()] == [4]  # this tick's token, not yet confirmed
    box.confirm(5)
    assert not box.dirty
    engine.cancel("r")
    assert box.end is not None and box.end.event.reason is FinishReason.CANCELLED
    assert engine.outbox("r") is box  # until step() hands the outcome out
    engine.step()
    assert engine.outbox("r") is None
    # refused at submit: an outbox all the same, its outcome already in it
    bad = GenerationRequest(job_id="bad", prompt_ids=[10**9], max_new_tokens=4)
    engine.submit(bad)
    refused = engine.outbox("bad")
    assert refused is not None and refused.unsent() == []
    assert refused.end is not None and refused.end.event.reason is FinishReason.REJECTED
    box.rewind()
    assert [e.index for e in box.unsent()] == [0, 1, 2, 3, 4]  # resent after a reconnect
