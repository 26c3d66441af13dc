"""Repeated measurements on a shared machine: the order each round runs its systems in,
the clocks they read, and waiting for a condition with a deadline.

Systems are interleaved round by round (ABBA, or a rotating first) so that drift and a
neighbour's burst of load hit each of them alike; from the rounds the reports take
min / median / max (report.py's `spread`) or, where other load only ever adds time,
the best (`Best`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def abba(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: as given in even rounds, reversed in odd ones (ABBA over rounds)."""
    return list(items) if r % 2 == 0 else list(items)[::-1]


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: each item goes first in turn."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds `fn()` took, and what it returned."""
    start = time.perf_counter()
    got = fn()
    return time.perf_counter() - start, got


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median of `reps` timed calls of `fn`."""
    return statistics.median(timed(fn)[0] for _ in range(reps))


class Best:
    """Best (minimum) seconds per key over interleaved rounds, and each key's last result.

    The minimum, not the median: the machine is shared, and other load only ever adds
    time; interleaving the systems spreads a burst of it over all of them.
    """

    def __init__(self) -> None:
        self.s: dict[object, float] = {}
        self.last: dict[object, Any] = {}

    def add(self, key: object, seconds: float) -> None:
        self.s[key] = min(self.s.get(key, float("inf")), seconds)

    def time(self, key: object, fn: Callable[[], Any]) -> None:
        seconds, self.last[key] = timed(fn)
        self.add(key, seconds)


def wait_until(done: Callable[[], object], timeout_s: float, every_s: float = 0.01) -> bool:
    """Poll `done()` every `every_s` until it is true (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
