"""The thread governor: fewer forward threads while a neighbour holds a core, back up
when it leaves (issue 12, speed that survives neighbours)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import wait_for

from tokenfleet.worker.threads import ThreadGovernor, busy_cpu_seconds


class FakeCpu:
    """Busy and own CPU seconds and a clock the test advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, *, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def governor(cpu: FakeCpu, cores: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(
        calls.append,
        cores,
        cpus=frozenset(range(cores)),
        window_s=1.0,
        read_busy=lambda cpus: cpu.busy,
        read_own=lambda: cpu.own,
        clock=lambda: cpu.now,
    )
    return gov, calls


def test_a_neighbour_lowers_the_count_and_leaving_raises_it() -> None:
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    assert gov.threads == 2
    cpu.run(1.0, own_cores=1.9, other_cores=0.05)  # alone: stays
    assert gov.poll() is None and gov.threads == 2
    cpu.run(1.0, own_cores=1.33, other_cores=0.67)  # a spinning neighbour's fair share
    assert gov.poll() == 1
    cpu.run(1.0, own_cores=1.0, other_cores=1.0)  # still there: free = 1 core, stays at 1
    assert gov.poll() is None
    cpu.run(1.0, own_cores=1.0, other_cores=0.0)  # gone
    assert gov.poll() == 2
    assert calls == [1, 2] and gov.changes == 2
    assert gov.telemetry()["threads"] == 2


def test_it_waits_a_window_and_does_not_flap_near_a_boundary() -> None:
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    cpu.run(0.5, own_cores=0.0, other_cores=2.0)  # a burst, half a window long
    assert gov.poll() is None  # no reading before a whole window
    cpu.run(1.5, own_cores=2.0, other_cores=0.0)  # averaged over 2 s: 1.5 free, keep 2
    assert gov.poll() is None and gov.threads == 2
    cpu.run(1.0, own_cores=1.2, other_cores=0.4)  # a light neighbour: 1.6 free, keep 2
    assert gov.poll() is None and gov.threads == 2
    cpu.run(1.0, own_cores=1.0, other_cores=0.8)  # 1.2 free: down to 1
    assert gov.poll() == 1
    cpu.run(1.0, own_cores=1.0, other_cores=0.5)  # 1.5 free: not enough to go back up
    assert gov.poll() is None
    assert calls == [1]


def test_many_cores_follow_the_free_share() -> None:
    cpu = FakeCpu()
    gov, calls = governor(cpu, cores=8)
    cpu.run(1.0, own_cores=5.0, other_cores=3.0)  # 5 free
    assert gov.poll() == 5
    cpu.run(1.0, own_cores=5.0, other_cores=1.0)  # 7 free
    assert gov.poll() == 7
    cpu.run(1.0, own_cores=1.0, other_cores=8.0)  # overcommitted: never below 1
    assert gov.poll() == 1
    assert calls == [5, 7, 1]


def test_nothing_to_govern_with_one_thread() -> None:
    assert ThreadGovernor.for_this_process(lambda: 1, lambda n: None) is None


def _spin_on(cpu: int) -> subprocess.Popen[bytes]:
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _threads_become(gov: ThreadGovernor, threads: int) -> None:
    def reached() -> bool:
        gov.poll()
        return gov.threads == threads

    wait_for(reached, 30, f"{threads} threads (now {gov.threads}, free {gov.free_cores})")


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to share",
)
def test_a_real_neighbour_on_a_real_cpu() -> None:
    """/proc/stat as it is: a process spinning on one of the governor's two CPUs takes a
    thread away; killing it gives the thread back."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert busy_cpu_seconds(frozenset(cpus)) > 0
    probe = ThreadGovernor(lambda n: None, 2, cpus=frozenset(cpus), window_s=0.5)
    wait_for(lambda: probe.poll() or probe.free_cores is not None, 10, "a first window")
    if probe.free_cores is None or probe.free_cores < 1.6:
        pytest.skip(f"CPUs {cpus} are busy already (free {probe.free_cores}): no premise")
    calls: list[int] = []
    gov = ThreadGovernor(calls.append, 2, cpus=frozenset(cpus), window_s=0.5)
    neighbour = _spin_on(cpus[0])
    try:
        _threads_become(gov, 1)
    finally:
        neighbour.kill()
        neighbour.wait()
    _threads_become(gov, 2)
    assert calls[0] == 1 and calls[-1] == 2
