"""Every admission reason is reachable, in order, with a message that names the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from tokenfleet.admission import (
    Admission,
    AdmissionReason,
    AdmissionRequest,
    NodeBudget,
)
from tokenfleet.kv import BlockManager, KVLayout

# 2 layers * 2 heads * 16 dim * 2 bytes * 2 (K,V) = 256 bytes/token, 4 KiB/block of 16.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=2, block_size=16)
MiB = 1 << 20


def make_budget(**overrides: object) -> NodeBudget:
    fields: dict[str, object] = dict(
        weight_bytes=100 * MiB,
        kv_budget_bytes=64 * LAYOUT.bytes_per_block,  # 64 blocks = 1,024 tokens
        scratch_per_session_bytes=1 * MiB,
        scratch_total_bytes=2 * MiB,
        max_active=2,
        max_waiting=2,
        max_batch_size=8,
        max_prefill_tokens_per_tick=64,
        layout=LAYOUT,
    )
    fields.update(overrides)
    return NodeBudget(**fields)  # type: ignore[arg-type]


def req(job_id: str = "j", prompt: int = 10, new: int = 10, scratch: int = 0) -> AdmissionRequest:
    return AdmissionRequest(job_id, prompt, new, scratch)


@pytest.fixture
def adm() -> Admission:
    return Admission(make_budget())


@pytest.fixture
def kv(adm: Admission) -> BlockManager:
    return adm.budget.new_block_manager()


def test_budget_derived_sizes() -> None:
    b = make_budget(kv_budget_bytes=64 * LAYOUT.bytes_per_block + 100)
    assert b.num_kv_blocks == 64
    assert b.max_tokens_per_session == 1024
    assert b.new_block_manager().num_blocks == 64


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"kv_budget_bytes": LAYOUT.bytes_per_block - 1}, "no whole KV block"),
        ({"max_active": 0}, "max_active"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_prefill_tokens_per_tick": 0}, "max_prefill_tokens_per_tick"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"scratch_per_session_bytes": 3 * MiB}, "exceeds"),
    ],
)
def test_budget_validated_on_construction(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_budget(**overrides)


def test_budget_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_budget().max_active = 3  # type: ignore[misc]


def decide(
    adm: Admission,
    kv: BlockManager,
    r: AdmissionRequest,
    *,
    active: tuple[str, ...] = (),
    waiting: tuple[str, ...] = (),
    scratch: int = 0,
) -> tuple[AdmissionReason, str]:
    d = adm.decide(r, active_ids=active, waiting_ids=waiting, kv=kv, scratch_in_use=scratch)
    assert d.accepted == d.reason.accepted
    return d.reason, d.message


@pytest.mark.parametrize("prompt, new", [(0, 5), (5, -1), (-1, 5)])
def test_invalid(adm: Admission, kv: BlockManager, prompt: int, new: int) -> None:
    reason, msg = decide(adm, kv, req(prompt=prompt, new=new))
    assert reason is AdmissionReason.REJECTED_INVALID
    assert f"({prompt:,})" in msg and f"({new:,})" in msg


def test_invalid_wins_over_duplicate(adm: Admission, kv: BlockManager) -> None:
    assert decide(adm, kv, req(prompt=0), active=("j",))[0] is AdmissionReason.REJECTED_INVALID


@pytest.mark.parametrize("where", ["active", "waiting"])
def test_duplicate(adm: Admission, kv: BlockManager, where: str) -> None:
    ids = {where: ("j",)}
    reason, msg = decide(adm, kv, req("j"), **ids)  # type: ignore[arg-type]
    assert reason is AdmissionReason.REJECTED_DUPLICATE
    assert "'j'" in msg and where in msg


def test_job_that_can_never_fit_is_refused_up_front(adm: Admission, kv: BlockManager) -> None:
    # An empty node: the refusal is about the whole budget, not the current load.
    reason, msg = decide(adm, kv, req(prompt=4000, new=96))
    assert reason is AdmissionReason.REJECTED_KV_BUDGET
    assert "4,096 KV tokens (1 MiB)" in msg
    assert "holds 1,024 (256 KiB)" in msg
    # Exactly the whole pool still fits.
    assert decide(adm, kv, req(prompt=1000, new=24))[0] is AdmissionReason.ADMITTED


def test_a_runner_session_cap_bounds_one_job_below_the_whole_pool() -> None:
    # a llama.cpp runner with a KV stream per session: one stream of 256 tokens
    capped = Admission(make_budget(session_cap=256))
    kv = capped.budget.new_block_manager()
    assert capped.budget.max_tokens_per_session == 256
    reason, msg = decide(capped, kv, req(prompt=200, new=57))
    assert reason is AdmissionReason.REJECTED_KV_BUDGET
    assert "needs 257 KV tokens" in msg and "one session may hold 256 on this runner" in msg
    assert decide(capped, kv, req(prompt=200, new=56))[0] is AdmissionReason.ADMITTED
    # a cap past the pool changes nothing
    assert make_budget(session_cap=10_000).max_tokens_per_session == 1024


def test_scratch_over_per_session_cap(adm: Admission, kv: BlockManager) -> None:
    reason, msg = decide(adm, kv, req(scratch=MiB + 1))
    assert reason is AdmissionReason.REJECTED_SCRATCH_BUDGET
    assert f"{MiB + 1:,}" in msg and f"{MiB:,} (1 MiB)" in msg


def test_admitted_then_queued_then_queue_full(adm: Admission, kv: BlockManager) -> None:
    reason, msg = decide(adm, kv, req("a"))
    assert reason is AdmissionReason.ADMITTED and "1/2 active" in msg
    reason, msg = decide(adm, kv, req("c"), active=("a", "b"))
    assert reason is AdmissionReason.QUEUED
    assert "queued at 1/2" in msg and "all 2 active slots" in msg
    reason, msg = decide(adm, kv, req("e"), active=("a", "b"), waiting=("c", "d"))
    assert reason is AdmissionReason.REJECTED_QUEUE_FULL
    assert "(2/2)" in msg and "waiting ahead" in msg


def test_queued_when_kv_is_reserved_by_others(adm: Admission, kv: BlockManager) -> None:
    kv.reserve("big", 1000)  # 63 of 64 blocks
    reason, msg = decide(adm, kv, req("j", prompt=10, new=10), active=("big",))
    assert reason is AdmissionReason.QUEUED
    assert "needs 2 KV blocks but 1 of 64 are unreserved" in msg


def test_queued_when_scratch_total_is_in_use(adm: Admission, kv: BlockManager) -> None:
    reason, msg = decide(adm, kv, req(scratch=MiB), active=("x",), scratch=MiB + 1)
    assert reason is AdmissionReason.QUEUED
    assert f"{MiB + 1:,} of {2 * MiB:,} are in use" in msg


def test_new_job_never_overtakes_the_waiting_list(adm: Admission, kv: BlockManager) -> None:
    # Room exists for the small job, but a job is already waiting: FIFO.
    reason, msg = decide(adm, kv, req("small"), waiting=("big",))
    assert reason is AdmissionReason.QUEUED and "1 job(s) already waiting ahead" in msg


def test_fits_now_for_promotion(adm: Admission, kv: BlockManager) -> None:
    r = req(prompt=500, new=12)  # 32 blocks
    assert adm.fits_now(r, active_count=0, kv=kv, scratch_in_use=0)
    assert not adm.fits_now(r, active_count=2, kv=kv, scratch_in_use=0)
    kv.reserve("other", 600)
    assert not adm.fits_now(r, active_count=1, kv=kv, scratch_in_use=0)


def test_room(adm: Admission, kv: BlockManager) -> None:
    assert adm.room(active_count=0, waiting_count=0, kv=kv) == 4
    assert adm.room(active_count=1, waiting_count=0, kv=kv) == 3
    assert adm.room(active_count=1, waiting_count=1, kv=kv) == 1, "active slots wait behind"
    assert adm.room(active_count=2, waiting_count=2, kv=kv) == 0
    assert adm.room(active_count=5, waiting_count=9, kv=kv) == 0, "never negative"
    kv.reserve("all", kv.capacity_tokens)
    assert adm.room(active_count=1, waiting_count=0, kv=kv) == 2, "no KV: only waiting slots"
