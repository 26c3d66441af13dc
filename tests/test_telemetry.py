"""EngineStats accumulates ticks and rejections into a bounded, JSON-safe snapshot."""

from __future__ import annotations

import json

import pytest

from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.telemetry import EngineStats, JSONValue


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def snap(stats: EngineStats, **overrides: int) -> dict[str, JSONValue]:
    kwargs = dict(
        active=3,
        waiting=1,
        kv_used_bytes=256,
        kv_budget_bytes=1024,
        scratch_used=10,
        scratch_budget=40,
    )
    kwargs.update(overrides)
    return stats.snapshot(**kwargs)


def tick(stats: EngineStats, clock: FakeClock, dur: float, batch: int, prefill: int) -> None:
    clock.t += dur
    stats.record_tick(dur, decode_batch=batch, prefill_tokens=prefill, decode_tokens=batch)


def test_empty_snapshot_is_zeros_and_json_safe() -> None:
    s = snap(EngineStats(8, clock=FakeClock()), kv_budget_bytes=0, scratch_budget=0)
    assert s["ticks"] == 0 and s["tick_ms_p50"] == 0.0 and s["decode_tokens_per_s"] == 0.0
    assert s["kv_pressure"] == 0.0 and s["scratch_pressure"] == 0.0
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_batch_occupancy_last_mean_max() -> None:
    clock = FakeClock()
    stats = EngineStats(8, clock=clock)
    for batch in (2, 8, 4):
        tick(stats, clock, 0.01, batch, 0)
    s = snap(stats)
    assert (s["batch_size_last"], s["batch_size_max"], s["batch_size_mean"]) == (4, 8, 14 / 3)
    assert s["occupancy_last"] == 0.5 and s["occupancy_max"] == 1.0
    assert s["occupancy_mean"] == pytest.approx(14 / 24)
    assert s["ticks"] == 3 and s["max_batch_size"] == 8


def test_pressures_and_passthrough_counts() -> None:
    s = snap(EngineStats(4, clock=FakeClock()))
    assert (s["active"], s["waiting"]) == (3, 1)
    assert s["kv_pressure"] == 0.25 and s["scratch_pressure"] == 0.25
    assert s["kv_used_bytes"] == 256 and s["scratch_budget_bytes"] == 40


def test_token_totals_and_rates_over_sliding_window() -> None:
    clock = FakeClock()
    stats = EngineStats(4, rate_window_s=10.0, clock=clock)
    for _ in range(10):  # 10 ticks of 0.5 s back to back: 5 s of work
        tick(stats, clock, 0.5, batch=4, prefill=100)
    s = snap(stats)
    assert s["prefill_tokens_total"] == 1000 and s["decode_tokens_total"] == 40
    assert s["prefill_tokens_per_s"] == pytest.approx(1000 / 5)
    assert s["decode_tokens_per_s"] == pytest.approx(40 / 5)
    clock.t += 5.0  # idle: the same tokens now spread over the full 10 s window
    assert stats.rates() == pytest.approx((100.0, 4.0))
    clock.t += 20.0  # everything has left the window
    assert stats.rates() == (0.0, 0.0)
    assert snap(stats)["prefill_tokens_total"] == 1000, "totals never decay"


def test_tick_time_percentiles_use_a_bounded_window() -> None:
    clock = FakeClock()
    stats = EngineStats(4, tick_window=100, clock=clock)
    for _ in range(50):
        tick(stats, clock, 10.0, 1, 0)  # slow ticks that fall out of the window
    for i in range(1, 101):
        tick(stats, clock, i / 1000, 1, 0)  # 1..100 ms
    s = snap(stats)
    assert s["tick_ms_p50"] == pytest.approx(50.0)
    assert s["tick_ms_p99"] == pytest.approx(99.0)
    assert s["ticks"] == 150


def test_rejections_by_reason_and_finishes() -> None:
    stats = EngineStats(4, clock=FakeClock())
    stats.record_rejection(AdmissionReason.REJECTED_KV_BUDGET)
    stats.record_rejection(AdmissionReason.REJECTED_KV_BUDGET)
    stats.record_rejection(AdmissionReason.REJECTED_QUEUE_FULL)
    stats.record_finish(FinishReason.LENGTH)
    with pytest.raises(AssertionError):
        stats.record_rejection(AdmissionReason.ADMITTED)
    s = snap(stats)
    assert s["rejected_total"] == 3
    assert s["rejected_by_reason"] == {"rejected_kv_budget": 2, "rejected_queue_full": 1}
    assert s["finished_by_reason"] == {"length": 1}


def test_snapshot_round_trips_through_json() -> None:
    clock = FakeClock()
    stats = EngineStats(4, clock=clock)
    tick(stats, clock, 0.02, 3, 17)
    stats.record_rejection(AdmissionReason.REJECTED_INVALID)
    s = snap(stats)
    text = json.dumps(s, allow_nan=False)
    assert json.loads(text) == s
    assert all(isinstance(k, str) for k in s)
