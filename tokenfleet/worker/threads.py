"""Fit the forward's CPU thread count to the cores other processes leave free.

torch's OpenMP threads spin while they wait for each other. On cores of its own that is
the fastest setting, but beside one busy neighbour on 2 cores a 2-thread worker fell to
0.28x of its quiet speed (docs/benchmarks-history.md): one of its threads is descheduled while
the other spins at a barrier. One thread kept 0.68x. So a worker whose thread count was
not pinned watches how much CPU the rest of the machine uses, on the CPUs it may run on
(/proc/stat, less its own CPU time), and runs as many threads as cores are left free:
fewer when a neighbour arrives, back up when it leaves.

Neighbours count by what the kernel would let them keep. /proc/stat's `nice` column is
the user time of tasks at nice > 0, whatever the worker's own nice. CFS gives a task at
nice n sharing a core with a worker thread at nice w the share W(n) / (W(n) + W(w)),
W = 1024 / 1.25^nice (1024 at 0, 15 at 19); an equal's half already costs the worker a
whole core (its barrier waits on the descheduled thread), so a neighbour's time counts
2 W(n) / (W(n) + W(w)), at most 1. Beside a worker at nice 0 a `nice -n 19` neighbour
counts 3 % of its time, one at nice 10 19 %, one at nice 1 89 %; beside a niced worker
an un-niced neighbour or one at the same nice counts in full. The worker's own time is
subtracted wherever it landed (in `nice` when the worker is niced).

Nice only weighs tasks against each other inside one scheduling group, though: with
autogroup (sched(7); on by default in many distributions) each session is a group, and
so is each cgroup with the cpu controller, and groups share a core equally. A
`nice -n 19` backup started by cron, from another terminal or in another container
takes half of a core it contests. So when other tasks' niced time shows, the governor
looks for the niced tasks (/proc/PID/stat) and weighs by nice only the time of those
in its own cgroup and autogroup that ran on its CPUs; everything else counts in full.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PROC = "/proc"
PROC_STAT = "/proc/stat"
# /proc/stat and /proc/PID/stat count in USER_HZ ticks
_HZ = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
# fields after "cpuN": user nice system idle iowait irq softirq steal (guest is in user,
# guest_nice in nice)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_NICE_FIELD = 1
# fields of /proc/PID/stat after "PID (comm)", 0-based: state=0 ... utime=11, nice=16,
# processor (the CPU it last ran on)=36
_UTIME, _NICE, _PROCESSOR = 11, 16, 36


@dataclass(frozen=True)
class CpuSeconds:
    """CPU seconds some CPUs spent since boot."""

    busy_s: float  # everyone's, steal included
    niced_s: float  # of which user time of tasks at nice > 0 (the `nice` column)


def cpu_seconds(cpus: frozenset[int], path: str = PROC_STAT) -> CpuSeconds:
    """The given CPUs' busy and niced seconds (steal counts as busy: a vCPU the host took
    away is as lost to us as one a neighbour holds)."""
    busy = niced = 0
    with open(path, encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                busy += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
                niced += int(fields[_NICE_FIELD])
    return CpuSeconds(busy / _HZ, niced / _HZ)


def counted_share(nice: int, worker_nice: int) -> float:
    """How much of a neighbour's CPU time at `nice` takes cores from a worker at
    `worker_nice` when they share a scheduling group (the rule in the module docstring)."""
    theirs, mine = 1.25**-nice, 1.25**-worker_nice  # CFS weights over 1024, within 2 %
    return min(1.0, 2 * theirs / (theirs + mine))


def own_nice() -> int:
    """The calling thread's nice (Linux keeps one per thread; its OpenMP threads inherit
    the nice of the thread that started them)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


@dataclass(frozen=True)
class NicedTask:
    nice: int
    user_s: float  # user seconds since it started: what /proc/stat puts in `nice`
    cpu: int  # the CPU it last ran on
    in_group: bool  # shares this process's cgroup and autogroup: CFS weighs the two by nice


def niced_tasks(proc: str = PROC) -> dict[int, NicedTask]:
    """Processes at nice > 0 other than this one, by pid (each by its main thread's nice),
    leaving out any that exit, or that this process may not read, while it looks."""
    autogroup = _read(f"{proc}/sys/kernel/sched_autogroup_enabled", "0").strip() == "1"
    own = _sched_group(f"{proc}/self", autogroup)
    tasks: dict[int, NicedTask] = {}
    with os.scandir(proc) as entries:
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"{entry.path}/stat", encoding="utf-8", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # comm may hold ") "
                nice = int(fields[_NICE])
                if nice > 0:
                    group = _sched_group(entry.path, autogroup)
                    user_s = int(fields[_UTIME]) / _HZ
                    in_group = group == own
                    tasks[int(entry.name)] = NicedTask(
                        nice, user_s, int(fields[_PROCESSOR]), in_group
                    )
            except (OSError, ValueError, IndexError):
                continue
    return tasks


def _sched_group(task: str, autogroup: bool) -> tuple[str, str]:
    """Where CFS weighs a task: its cpu cgroup (cgroup v1's cpu line, else v2's), and its
    autogroup where autogroup is on. Two tasks that differ here may still share a group (a
    cgroup without the cpu controller); taking them for strangers only counts in full."""
    # lines: "ID:CONTROLLERS:PATH", v2's as "0::PATH"
    lines = [line.split(":", 2) for line in _read(f"{task}/cgroup", "").splitlines()]
    v1 = [path for _, controllers, path in lines if "cpu" in controllers.split(",")]
    v2 = [path for id_, _, path in lines if id_ == "0"]
    cgroup = (v1 or v2 or [""])[0]
    session = _read(f"{task}/autogroup", "").split(" ")[0] if autogroup else ""
    return cgroup, session


def _read(path: str, missing: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return missing


@dataclass(frozen=True)
class Reading:
    at: float  # monotonic seconds
    cpu: CpuSeconds  # the CPUs', everyone's
    own_s: float  # this process's CPU seconds
    nice: int  # this thread's nice


class ThreadGovernor:
    """Call `poll()` between ticks; it changes the thread count at most once a window.

    free = cores - (busy - own - yielded) / wall over the last window, where yielded is
    the part of others' niced time the kernel would have given the worker (the module
    docstring's rule). Below `threads - 0.5` it lowers the count to round(free) (at least
    1); at `threads + 0.75` or more it raises it to floor(free + 0.25) (at most
    `max_threads`). The gap between the two keeps it from flapping when a neighbour's
    share sits near a boundary.
    """

    def __init__(
        self,
        set_threads: Callable[[int], None],
        max_threads: int,
        *,
        cpus: frozenset[int] | None = None,
        window_s: float = 2.0,
        read_cpu: Callable[[frozenset[int]], CpuSeconds] = cpu_seconds,
        read_niced: Callable[[], dict[int, NicedTask]] = niced_tasks,
        read_own: Callable[[], float] = time.process_time,
        read_nice: Callable[[], int] = own_nice,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.max_threads = max(1, min(max_threads, len(self.cpus)))
        self.threads = self.max_threads
        self.changes = 0
        self.free_cores: float | None = None  # last window's estimate
        self._set = set_threads
        self._window_s = window_s
        self._read_cpu = read_cpu
        self._read_niced = read_niced
        self._read_own = read_own
        self._read_nice = read_nice
        self._clock = clock
        self._last = self._read()
        self._niced = self._scan()  # the niced tasks as the last look found them

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
        return Reading(
            self._clock(), self._read_cpu(self.cpus), self._read_own(), self._read_nice()
        )

    def _scan(self) -> dict[int, NicedTask]:
        try:
            return self._read_niced()
        except (OSError, ValueError):
            return {}

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
        own = reading.own_s - last.own_s
        niced = reading.cpu.niced_s - last.cpu.niced_s
        if reading.nice > 0:
            niced -= own  # its user time is in `nice`; its system time is not (counted)
        busy = reading.cpu.busy_s - last.cpu.busy_s - own
        others = max(0.0, busy - self._yielded(niced, reading.nice)) / wall
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

    def _yielded(self, niced_s: float, worker_nice: int) -> float:
        """Of `niced_s`, others' niced seconds on these CPUs since the last window, the
        part the kernel would have given a worker thread that wanted it: of each niced
        task in the worker's group that last ran here, the user time since the last look
        (all of it if it is new) times 1 - counted_share. It looks only when there is
        niced time to explain, and never explains more than there is."""
        if niced_s <= 0:
            return 0.0
        seen, self._niced = self._niced, self._scan()
        yielded = 0.0
        for pid, task in self._niced.items():
            if not task.in_group or task.cpu not in self.cpus:
                continue
            before = seen.get(pid)
            ran = task.user_s
            if before is not None and before.user_s <= task.user_s:
                ran -= before.user_s
            yielded += ran * (1 - counted_share(task.nice, worker_nice))
        return min(niced_s, yielded)

    def telemetry(self) -> dict[str, object]:
        return {
            "threads": self.threads,
            "threads_max": self.max_threads,
            "thread_changes": self.changes,
            "free_cores": self.free_cores,
        }


__all__ = [
    "CpuSeconds",
    "NicedTask",
    "ThreadGovernor",
    "counted_share",
    "cpu_seconds",
    "niced_tasks",
    "own_nice",
]
