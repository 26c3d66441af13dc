"""The continuous-batching scheduler driven directly, with a fake sampler and no model.

The scheduler never writes a sequence's `output_ids` nor decides its end: the
engine's session does (it appends each sampled token and ends a job at its
length). `complete` plays that part here.
"""

from __future__ import annotations

import pytest

from tokenfleet.kv import BlockManager
from tokenfleet.seam import SeqState, SeqStatus, TickPlan
from tokenfleet.worker.scheduler import Scheduler, SchedulerConfig


def make(batch: int = 4, prefill: int = 8, blocks: int = 64, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(batch, prefill), BlockManager(blocks, block_size))


def seq(sid: str, prompt_len: int = 5, new: int = 10, outputs: list[int] | None = None) -> SeqState:
    return SeqState(sid, list(range(100, 100 + prompt_len)), new, list(outputs or []))


def complete(s: Scheduler, plan: TickPlan, sampled: dict[str, int]) -> list[SeqState]:
    """What the engine does after a forward: append each live sampled session's token,
    finish the sessions that used their whole budget, then complete the tick."""
    done: list[SeqState] = []
    for sid, token in sampled.items():
        if sid in s:
            seq = s.get(sid)
            seq.output_ids.append(token)
            if seq.remaining_new_tokens <= 0:
                done.append(s.finish(sid))
    s.complete_tick(plan)
    return done


def run(s: Scheduler) -> tuple[TickPlan, list[SeqState]]:
    """One tick with a fake model: every sampling session gets token 7."""
    plan = s.schedule()
    return plan, complete(s, plan, {sid: 7 for sid in plan.sampling_ids})


def test_config_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(0, 1)
    with pytest.raises(ValueError, match="max_prefill_tokens_per_tick"):
        SchedulerConfig(1, 0)


def test_sequence_lifecycle_and_positions() -> None:
    s = make(prefill=3)
    a = seq("a", prompt_len=5, new=3)
    s.add(a)
    assert a.status is SeqStatus.WAITING and a.prefill_remaining == 5
    plan, _ = run(s)
    [c] = plan.prefill
    assert (c.start, c.length, c.context_len, c.samples) == (0, 3, 3, False)
    assert c.token_ids == [100, 101, 102]
    assert s.get("a").status is SeqStatus.PREFILL and a.num_computed == 3 and a.output_ids == []
    plan, _ = run(s)
    [c] = plan.prefill
    assert (c.start, c.length, c.samples) == (3, 2, True)
    assert s.get("a").status is SeqStatus.DECODE and a.output_ids == [7] and a.num_computed == 5
    plan, _ = run(s)
    [d] = plan.decode
    # Feeds the token sampled last tick at position 5; attends over 6 slots.
    assert (d.token_id, d.position, d.context_len) == (7, 5, 6)
    assert len(d.block_table) * 4 >= 6
    _, done = run(s)
    assert done == [a]
    assert a.status.value == "finished" and len(a.output_ids) == 3
    assert s.is_idle and s.blocks.num_reserved_blocks == 0


def test_decode_first_then_prefill_in_one_tick() -> None:
    s = make(prefill=4)
    s.add(seq("old", prompt_len=2))
    run(s)  # old is decoding now
    s.add(seq("new", prompt_len=6))
    plan = s.schedule()
    assert [d.seq.session_id for d in plan.decode] == ["old"]
    assert [c.seq.session_id for c in plan.prefill] == ["new"]
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 4
    assert plan.sampling_ids == ["old"]


def test_decoder_gets_a_token_every_tick_while_four_prompts_prefill() -> None:
    budget = 5
    s = make(batch=8, prefill=budget, blocks=256)
    s.add(seq("d", prompt_len=3, new=100))
    run(s)
    for i in range(4):
        s.add(seq(f"p{i}", prompt_len=7, new=100))
    ticks = 0
    while s.num_waiting:
        before = len(s.get("d").output_ids)
        plan, _ = run(s)
        ticks += 1
        assert "d" in [x.seq.session_id for x in plan.decode]
        assert len(s.get("d").output_ids) == before + 1
        assert 1 <= plan.num_prefill_tokens <= budget
    assert ticks == -(-4 * 7 // budget)  # prefill chunks never waste budget
    assert s.num_running == 5


def test_prefill_is_fifo_and_only_the_head_is_partial() -> None:
    s = make(prefill=6)
    for sid, n in (("a", 4), ("b", 4), ("c", 4)):
        s.add(seq(sid, prompt_len=n))
    plan = s.schedule()
    assert [(c.seq.session_id, c.start, c.length, c.samples) for c in plan.prefill] == [
        ("a", 0, 4, True),
        ("b", 0, 2, False),
    ]
    complete(s, plan, {"a": 1})
    plan = s.schedule()
    assert [(c.seq.session_id, c.start, c.length) for c in plan.prefill] == [
        ("b", 2, 2),
        ("c", 0, 4),
    ]


def test_prefill_budget_of_one_still_progresses() -> None:
    s = make(prefill=1)
    s.add(seq("a", prompt_len=3))
    for expected in (1, 2, 3):
        plan, _ = run(s)
        assert plan.num_prefill_tokens == 1
        assert s.get("a").num_computed == expected
    assert s.get("a").status is SeqStatus.DECODE


def test_rotation_when_decoders_exceed_batch() -> None:
    s = make(batch=2, prefill=100, blocks=256)
    for i in range(5):
        s.add(seq(f"s{i}", prompt_len=2, new=100))
    run(s)  # all five prefilled, each sampled once
    assert s.num_running == 5
    served: dict[str, int] = {f"s{i}": 0 for i in range(5)}
    for _ in range(10):
        plan, _ = run(s)
        assert len(plan.decode) == 2
        assert plan.num_decode_tokens / s.config.max_batch_size == 1.0  # full occupancy
        for d in plan.decode:
            served[d.seq.session_id] += 1
    assert set(served.values()) == {4}, served


def test_occupancy_reflects_partial_batch() -> None:
    s = make(batch=4)
    s.add(seq("a", prompt_len=2))
    run(s)
    plan = s.schedule()
    assert len(plan.decode) / s.config.max_batch_size == 0.25


def test_finish_frees_kv_to_zero_in_any_state() -> None:
    s = make(prefill=3)
    for sid in ("a", "b", "c"):
        s.add(seq(sid, prompt_len=4, new=20))
    for _ in range(3):
        run(s)
    assert s.blocks.num_in_use_blocks > 0
    assert s.finish("a").status is SeqStatus.FINISHED
    s.finish("b")  # partly prefilled or decoding: either way it goes
    assert s.finish("c").status is SeqStatus.FINISHED
    assert s.is_idle
    assert s.blocks.num_in_use_blocks == 0 and s.blocks.num_reserved_blocks == 0
    s.blocks.check_invariants()
    assert s.schedule().is_empty


def test_finish_while_plan_in_flight_is_skipped() -> None:
    s = make()
    s.add(seq("a", prompt_len=2))
    s.add(seq("b", prompt_len=2))
    plan = s.schedule()
    a = s.finish("a")
    complete(s, plan, {"a": 1, "b": 1})
    assert "a" not in s and a.num_computed == 0
    assert s.get("b").output_ids == [1] and s.get("b").status is SeqStatus.DECODE


def test_resumed_sequence_prefills_prompt_plus_outputs() -> None:
    s = make(prefill=100)
    r = seq("r", prompt_len=5, new=10, outputs=[201, 202, 203])
    s.add(r)
    assert s.blocks.reserved_tokens("r") >= 5 + 10
    plan = s.schedule()
    [c] = plan.prefill
    assert (c.start, c.length, c.samples) == (0, 8, True)
    assert c.token_ids == [100, 101, 102, 103, 104, 201, 202, 203]
    complete(s, plan, {"r": 204})
    assert r.output_ids == [201, 202, 203, 204]  # the next index continues at 3
    assert r.remaining_new_tokens == 6
    for _ in range(6):
        _, done = run(s)
    assert done == [r] and len(r.output_ids) == 10
    assert s.blocks.num_reserved_blocks == 0


def test_add_refuses_bad_sequences() -> None:
    s = make(blocks=2, block_size=4)
    with pytest.raises(ValueError, match="left to generate"):
        s.add(seq("done", new=2, outputs=[1, 2]))
    with pytest.raises(ValueError, match="prompt"):
        s.add(SeqState("empty", [], 3))
    with pytest.raises(ValueError, match="cannot reserve"):
        s.add(seq("big", prompt_len=5, new=10))  # needs 4 blocks of 4
    assert s.is_idle


def test_schedule_twice_without_completion_is_a_bug() -> None:
    s = make()
    s.add(seq("a"))
    plan = s.schedule()
    with pytest.raises(AssertionError):
        s.schedule()
    s.get("a").output_ids.append(7)  # the first plan is still the one to complete
    s.complete_tick(plan)
    assert s.get("a").num_computed == 5


def test_complete_tick_refuses_a_sampled_session_without_its_token() -> None:
    s = make()
    s.add(seq("a", prompt_len=2))
    plan = s.schedule()
    with pytest.raises(AssertionError, match="not appended"):
        s.complete_tick(plan)  # the session's token was never appended: a bug, loudly
