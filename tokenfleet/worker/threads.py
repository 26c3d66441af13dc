"""Fit the forward's CPU thread count to the cores other processes leave free.

torch's OpenMP threads spin while they wait for each other. On cores of its own that is
the fastest setting, but beside one busy neighbour on 2 cores a 2-thread worker fell to
0.28x of its quiet speed (docs/benchmarks.md): one of its threads is descheduled while
the other spins at a barrier. One thread kept 0.68x. So a worker whose thread count was
not pinned watches how much CPU the rest of the machine uses, on the CPUs it may run on
(/proc/stat, less its own CPU time), and runs as many threads as cores are left free:
fewer when a neighbour arrives, back up when it leaves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PROC_STAT = "/proc/stat"
# /proc/stat counts in USER_HZ ticks
_HZ = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
# fields after "cpuN": user nice system idle iowait irq softirq steal (guest is in user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def busy_cpu_seconds(cpus: frozenset[int], path: str = PROC_STAT) -> float:
    """CPU seconds the given CPUs spent busy since boot (steal included: a vCPU the host
    took away is as lost to us as one a neighbour holds)."""
    total = 0
    with open(path, encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total / _HZ


@dataclass(frozen=True)
class Reading:
    at: float  # monotonic seconds
    busy_s: float  # the CPUs' busy seconds, everyone's
    own_s: float  # this process's CPU seconds


class ThreadGovernor:
    """Call `poll()` between ticks; it changes the thread count at most once a window.

    free = cores - (busy - own) / wall over the last window. Below `threads - 0.5` it
    lowers the count to round(free) (at least 1); at `threads + 0.75` or more it raises it
    to floor(free + 0.25) (at most `max_threads`). The gap between the two keeps it from
    flapping when a neighbour's share sits near a boundary.
    """

    def __init__(
        self,
        set_threads: Callable[[int], None],
        max_threads: int,
        *,
        cpus: frozenset[int] | None = None,
        window_s: float = 2.0,
        read_busy: Callable[[frozenset[int]], float] = busy_cpu_seconds,
        read_own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.max_threads = max(1, min(max_threads, len(self.cpus)))
        self.threads = self.max_threads
        self.changes = 0
        self.free_cores: float | None = None  # last window's estimate
        self._set = set_threads
        self._window_s = window_s
        self._read_busy = read_busy
        self._read_own = read_own
        self._clock = clock
        self._last = self._read()

    @classmethod
    def for_this_process(
        cls, get_threads: Callable[[], int], set_threads: Callable[[int], None]
    ) -> ThreadGovernor | None:
        """A governor starting from the current thread count, or None where there is
        nothing to govern (one thread, one CPU) or /proc/stat cannot be read."""
        if not hasattr(os, "sched_getaffinity") or get_threads() < 2:
            return None
        try:
            governor = cls(set_threads, get_threads())
        except (OSError, ValueError):
            return None
        return governor if governor.max_threads > 1 else None

    def _read(self) -> Reading:
        return Reading(self._clock(), self._read_busy(self.cpus), self._read_own())

    def poll(self) -> int | None:
        """The new thread count when it changed, else None."""
        now = self._clock()
        if now - self._last.at < self._window_s:
            return None
        try:
            reading = self._read()
        except (OSError, ValueError):
            return None
        last, self._last = self._last, reading
        wall = reading.at - last.at
        others = max(0.0, (reading.busy_s - last.busy_s) - (reading.own_s - last.own_s)) / wall
        free = len(self.cpus) - others
        self.free_cores = round(free, 2)
        target = self.threads
        if self.threads > 1 and free < self.threads - 0.5:
            target = max(1, round(free))
        elif self.threads < self.max_threads and free >= self.threads + 0.75:
            target = min(self.max_threads, int(free + 0.25))
        if target == self.threads:
            return None
        self.threads = target
        self.changes += 1
        self._set(target)
        return target

    def telemetry(self) -> dict[str, object]:
        return {
            "threads": self.threads,
            "threads_max": self.max_threads,
            "thread_changes": self.changes,
            "free_cores": self.free_cores,
        }


__all__ = ["ThreadGovernor", "busy_cpu_seconds"]
