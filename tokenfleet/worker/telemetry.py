"""Engine telemetry: counters and bounded windows, turned into a JSON-safe snapshot.

The worker calls `record_*` as things happen and publishes `snapshot()` about
once a second. Everything is bounded: tick times and batch sizes keep the last
`tick_window` ticks, token rates look back `rate_window_s` seconds.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from tokenfleet.reasons import AdmissionReason, FinishReason

JSONValue: TypeAlias = str | int | float | bool | list["JSONValue"] | dict[str, "JSONValue"] | None


@dataclass(frozen=True)
class _TickSample:
    start: float  # clock time the tick began (end - duration)
    end: float
    prefill_tokens: int
    decode_tokens: int


def _percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


class EngineStats:
    def __init__(
        self,
        max_batch_size: int,
        *,
        tick_window: int = 1024,
        rate_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1 or tick_window < 1 or rate_window_s <= 0:
            raise ValueError("max_batch_size, tick_window and rate_window_s must be positive")
        self.max_batch_size = max_batch_size
        self.rate_window_s = rate_window_s
        self._clock = clock
        self._started = clock()
        self.ticks = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self._tick_s: deque[float] = deque(maxlen=tick_window)
        self._batch: deque[int] = deque(maxlen=tick_window)
        self._recent: deque[_TickSample] = deque()  # pruned to rate_window_s
        self.rejected: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.lost = 0  # jobs dropped because another worker owns them now
        self.preempted = 0  # sessions put back to wait for a job of a higher band
        self.returned = 0  # jobs not started here in time, given back to their stream
        self.step_s = 0.0  # seconds inside Engine.step (every call, idle ones included)
        self.runner_s = 0.0  # seconds inside ModelRunner.execute (forward + sampling)

    def record_tick(
        self,
        duration_s: float,
        decode_batch: int,
        prefill_tokens: int,
        decode_tokens: int,
    ) -> None:
        """One forward pass that just ended and took `duration_s`."""
        now = self._clock()
        self.ticks += 1
        self.prefill_tokens_total += prefill_tokens
        self.decode_tokens_total += decode_tokens
        self._tick_s.append(duration_s)
        self._batch.append(decode_batch)
        self._recent.append(_TickSample(now - duration_s, now, prefill_tokens, decode_tokens))
        self._prune(now)

    def record_step(self, duration_s: float, runner_s: float) -> None:
        """One `Engine.step` call: its whole time and the part the model runner took."""
        self.step_s += duration_s
        self.runner_s += runner_s

    def record_rejection(self, reason: AdmissionReason) -> None:
        assert not reason.accepted, f"{reason} is not a rejection"
        self.rejected[reason.value] += 1

    def record_finish(self, reason: FinishReason) -> None:
        self.finished[reason.value] += 1

    def record_lost(self) -> None:
        self.lost += 1

    def record_preemption(self) -> None:
        self.preempted += 1

    def record_returned(self) -> None:
        self.returned += 1

    def rates(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second of wall time over the recent window.

        The span starts at the earliest recent tick's start (so a fresh worker is
        not diluted by the full window) and ends now (so rates decay when idle).
        """
        now = self._clock()
        self._prune(now)
        if not self._recent:
            return 0.0, 0.0
        span = min(self.rate_window_s, now - self._recent[0].start)
        prefill = sum(s.prefill_tokens for s in self._recent)
        decode = sum(s.decode_tokens for s in self._recent)
        return _ratio(prefill, span), _ratio(decode, span)

    def snapshot(
        self,
        *,
        active: int,
        waiting: int,
        kv_used_bytes: int,
        kv_budget_bytes: int,
        scratch_used: int,
        scratch_budget: int,
    ) -> dict[str, JSONValue]:
        """A flat, JSON-safe view (plus two small reason->count maps); never NaN."""
        prefill_rate, decode_rate = self.rates()
        ticks_sorted = sorted(self._tick_s)
        batch = list(self._batch)
        last = batch[-1] if batch else 0
        mean = _ratio(sum(batch), len(batch))
        peak = max(batch, default=0)
        return {
            "uptime_s": self._clock() - self._started,
            "ticks": self.ticks,
            "active": active,
            "waiting": waiting,
            "max_batch_size": self.max_batch_size,
            "batch_size_last": last,
            "batch_size_mean": mean,
            "batch_size_max": peak,
            "occupancy_last": last / self.max_batch_size,
            "occupancy_mean": mean / self.max_batch_size,
            "occupancy_max": peak / self.max_batch_size,
            "kv_used_bytes": kv_used_bytes,
            "kv_budget_bytes": kv_budget_bytes,
            "kv_pressure": _ratio(kv_used_bytes, kv_budget_bytes),
            "scratch_used_bytes": scratch_used,
            "scratch_budget_bytes": scratch_budget,
            "scratch_pressure": _ratio(scratch_used, scratch_budget),
            "prefill_tokens_total": self.prefill_tokens_total,
            "decode_tokens_total": self.decode_tokens_total,
            "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
            "tick_ms_p50": 1000 * _percentile(ticks_sorted, 50),
            "tick_ms_p99": 1000 * _percentile(ticks_sorted, 99),
            "step_s": self.step_s,
            "runner_s": self.runner_s,
            "rejected_total": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
            "finished_by_reason": dict(self.finished),
            "lost_total": self.lost,
            "preempted_total": self.preempted,
            "returned_total": self.returned,
        }

    def _prune(self, now: float) -> None:
        horizon = now - self.rate_window_s
        while self._recent and self._recent[0].end < horizon:
            self._recent.popleft()
