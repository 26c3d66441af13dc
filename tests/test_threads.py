"""The thread governor: fewer forward threads while a neighbour holds a core, back up
when it leaves (issue 12, speed that survives neighbours), and niced neighbours weighed by
what the kernel lets them keep (issue 21)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.support import wait_for
from tokenfleet.worker.threads import (
    CpuSeconds,
    NicedTask,
    ThreadGovernor,
    counted_share,
    cpu_seconds,
    niced_tasks,
)

BACKUP = 1001  # a fake neighbour's pid


class FakeCpu:
    """/proc/stat's busy and niced seconds, the niced tasks, the worker's own CPU seconds
    and nice, and a clock the test advances."""

    def __init__(self, nice: int = 0) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.niced = 0.0
        self.own = 0.0
        self.nice = nice
        self.tasks: dict[int, NicedTask] = {}

    def run(
        self,
        seconds: float,
        *,
        own_cores: float,
        other_cores: float = 0.0,
        niced_cores: float = 0.0,
        niced_at: int = 19,
        in_group: bool = True,
    ) -> None:
        """The worker, an un-niced neighbour and a niced one (task BACKUP) ran this much."""
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores + niced_cores) * seconds
        self.niced += niced_cores * seconds
        if self.nice > 0:
            self.niced += own_cores * seconds  # a niced worker's time lands in `nice` too
        if niced_cores:
            before = self.tasks.get(BACKUP)
            user_s = (before.user_s if before else 0.0) + niced_cores * seconds
            self.tasks[BACKUP] = NicedTask(niced_at, user_s, 0, in_group)


def governor(cpu: FakeCpu, cores: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(
        calls.append,
        cores,
        cpus=frozenset(range(cores)),
        window_s=1.0,
        read_cpu=lambda cpus: CpuSeconds(cpu.busy, cpu.niced),
        read_niced=lambda: dict(cpu.tasks),
        read_own=lambda: cpu.own,
        read_nice=lambda: cpu.nice,
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


def test_counted_share_follows_cfs_weights() -> None:
    assert counted_share(19, 0) == pytest.approx(0.028, abs=0.002)  # 15 vs 1024
    assert counted_share(10, 0) == pytest.approx(0.19, abs=0.01)  # `nice`'s default
    assert counted_share(1, 0) == pytest.approx(0.89, abs=0.01)
    assert counted_share(19, 19) == 1.0  # equals
    assert counted_share(0, 19) == 1.0  # an un-niced task beside a niced worker
    assert counted_share(19, 10) == pytest.approx(0.24, abs=0.01)


@pytest.mark.parametrize(
    ("worker_nice", "neighbour_nice", "in_group", "threads"),
    [
        (0, 19, True, 2),  # a backup at nice 19 keeps 3 % of a core a worker thread wants
        (0, 10, True, 2),  # at `nice`'s default 10: 19 %
        (0, 1, True, 1),  # at nice 1 it keeps 44 %: as costly as an equal's half
        (0, 19, False, 1),  # another session or cgroup: nice does not weigh across groups
        (19, 19, True, 1),  # niced alike: equals
        (10, 19, True, 2),  # a worker at nice 10 still outweighs nice 19 (110 vs 15)
    ],
)
def test_a_niced_neighbour_counts_by_its_nice_against_the_workers(
    worker_nice: int, neighbour_nice: int, in_group: bool, threads: int
) -> None:
    cpu = FakeCpu(nice=worker_nice)
    gov, _ = governor(cpu)
    cpu.run(1.0, own_cores=1.0, niced_cores=1.0, niced_at=neighbour_nice, in_group=in_group)
    gov.poll()
    assert gov.threads == threads, f"free {gov.free_cores}"


def test_a_niced_worker_takes_its_own_niced_time_for_its_own() -> None:
    """A niced worker's time lands in /proc/stat's `nice` column: it is not a neighbour's,
    and an un-niced neighbour beside the niced worker counts in full."""
    cpu = FakeCpu(nice=19)
    gov, calls = governor(cpu)
    cpu.run(1.0, own_cores=1.9)  # alone: all of the niced time is its own
    assert gov.poll() is None and gov.free_cores == 2.0
    cpu.run(1.0, own_cores=1.0, other_cores=1.0)  # an un-niced neighbour
    assert gov.poll() == 1
    assert calls == [1]


def test_a_niced_backup_does_not_hold_a_thread_down() -> None:
    """The bug this rule mends: a nice-19 backup soaks up the core a worker leaves idle
    (at one thread, or between ticks), and counted in full it kept the worker at one
    thread for as long as it ran, though the kernel gives the worker that core back."""
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    cpu.run(1.0, own_cores=1.0, other_cores=1.0)  # an un-niced neighbour: down to 1
    assert gov.poll() == 1
    cpu.run(1.0, own_cores=1.0, niced_cores=1.0)  # it left; the backup took the idle core
    assert gov.poll() == 2
    cpu.run(1.0, own_cores=1.97, niced_cores=0.03)  # both threads busy: the backup yields
    assert gov.poll() is None
    cpu.run(1.0, own_cores=0.1, niced_cores=1.9)  # the worker idles: still not a neighbour
    assert gov.poll() is None
    assert calls == [1, 2] and gov.free_cores is not None and gov.free_cores > 1.9


def test_niced_time_is_never_explained_beyond_what_the_cpus_show() -> None:
    """The niced tasks' user time since the last look may include time on other CPUs:
    what it explains away is capped by the `nice` column of the governor's CPUs."""
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    cpu.run(1.0, own_cores=1.0, other_cores=1.0, niced_cores=0.2)
    cpu.tasks[BACKUP] = NicedTask(19, 2.0, 0, True)  # 2 s, mostly on a CPU outside
    assert gov.poll() == 1  # the un-niced neighbour's core still counts
    assert calls == [1]


def test_a_niced_task_on_other_cpus_or_in_another_group_counts_in_full() -> None:
    cpu = FakeCpu()
    gov, _ = governor(cpu)
    cpu.run(1.0, own_cores=1.0, niced_cores=1.0)
    cpu.tasks[BACKUP] = NicedTask(19, 1.0, 7, True)  # last ran on CPU 7, not ours
    assert gov.poll() == 1


def test_cpu_seconds_reads_the_busy_and_nice_columns(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  900 900 900 900 900 900 900 900 0 0\n"
        "cpu0 100 50 20 1000 5 1 2 3 40 7\n"
        "cpu1 200 0 10 1000 5 0 0 0 0 0\n"
        "cpu2 999 999 999 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    got = cpu_seconds(frozenset({0, 1}), str(stat))
    # guest and guest_nice are already in user and nice; idle and iowait are not busy
    assert got.busy_s == pytest.approx((100 + 50 + 20 + 1 + 2 + 3 + 200 + 10) / hz)
    assert got.niced_s == pytest.approx(50 / hz)


def _fake_task(proc: Path, name: str, *, nice: int, cgroup: str, autogroup: str) -> None:
    fields = ["0"] * 40  # after "(comm)": state ppid ... utime=11 ... nice=16 ... cpu=36
    fields[0], fields[11], fields[16], fields[36] = "R", "250", str(nice), "1"
    (proc / name).mkdir()
    (proc / name / "stat").write_text(f"{name} (a) tricky) name) " + " ".join(fields) + "\n")
    (proc / name / "cgroup").write_text(cgroup)
    (proc / name / "autogroup").write_text(autogroup)


@pytest.mark.parametrize("autogroup", [True, False])
def test_niced_tasks_finds_niced_processes_and_their_group(tmp_path: Path, autogroup: bool) -> None:
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "sys/kernel/sched_autogroup_enabled").write_text("1\n" if autogroup else "0\n")
    root, mine, other = "1:cpu,cpuacct:/\n0::/\n", "/autogroup-7 nice 0\n", "/autogroup-8 nice 0\n"
    _fake_task(tmp_path, "self", nice=0, cgroup=root, autogroup=mine)
    _fake_task(tmp_path, str(os.getpid()), nice=19, cgroup=root, autogroup=mine)  # itself
    _fake_task(tmp_path, "100", nice=19, cgroup=root, autogroup=mine)
    _fake_task(tmp_path, "101", nice=19, cgroup=root, autogroup=other)  # another session
    _fake_task(tmp_path, "102", nice=0, cgroup=root, autogroup=mine)  # not niced
    _fake_task(tmp_path, "103", nice=5, cgroup="1:cpu,cpuacct:/docker/x\n0::/\n", autogroup=mine)
    (tmp_path / "104").mkdir()  # exited while we looked: no stat
    (tmp_path / "net").mkdir()
    hz = os.sysconf("SC_CLK_TCK")
    assert niced_tasks(str(tmp_path)) == {
        100: NicedTask(19, 250 / hz, 1, True),
        101: NicedTask(19, 250 / hz, 1, not autogroup),  # sessions matter only under it
        103: NicedTask(5, 250 / hz, 1, False),  # another cpu cgroup
    }


def test_nothing_to_govern_with_one_thread() -> None:
    assert ThreadGovernor.for_this_process(lambda: 1, lambda n: None) is None


def _spin_on(cpu: int, *, nice: int = 0, new_session: bool = False) -> subprocess.Popen[bytes]:
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}}); os.nice({nice})\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=new_session)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _cpu_s(proc: subprocess.Popen[bytes]) -> float:
    """A child's user + system seconds so far."""
    with open(f"/proc/{proc.pid}/stat", encoding="utf-8") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spinning(proc: subprocess.Popen[bytes]) -> None:
    wait_for(lambda: _cpu_s(proc) > 0.05, 20, "the neighbour to spin")


def _threads_become(gov: ThreadGovernor, threads: int) -> None:
    def reached() -> bool:
        gov.poll()
        return gov.threads == threads

    wait_for(reached, 30, f"{threads} threads (now {gov.threads}, free {gov.free_cores})")


def _quiet_pair() -> list[int]:
    """Two CPUs of this process's, if they are nearly idle; else the test has no premise."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert cpu_seconds(frozenset(cpus)).busy_s > 0
    probe = ThreadGovernor(lambda n: None, 2, cpus=frozenset(cpus), window_s=0.5)
    wait_for(lambda: probe.poll() or probe.free_cores is not None, 10, "a first window")
    if probe.free_cores is None or probe.free_cores < 1.6:
        pytest.skip(f"CPUs {cpus} are busy already (free {probe.free_cores}): no premise")
    return cpus


def _autogroup_on() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled", encoding="ascii") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to share",
)


@needs_two_cpus
def test_a_real_neighbour_on_a_real_cpu() -> None:
    """/proc/stat as it is: a process spinning on one of the governor's two CPUs takes a
    thread away; killing it gives the thread back."""
    cpus = _quiet_pair()
    calls: list[int] = []
    gov = ThreadGovernor(calls.append, 2, cpus=frozenset(cpus), window_s=0.5)
    neighbour = _spin_on(cpus[0])
    try:
        _threads_become(gov, 1)
    finally:
        _stop(neighbour)
    _threads_become(gov, 2)
    assert calls[0] == 1 and calls[-1] == 2


@needs_two_cpus
def test_a_real_niced_neighbour_leaves_the_threads() -> None:
    """A `nice -n 19` process in this process's session and cgroup spinning on one of
    the governor's two CPUs: it has the core while the test idles, and the kernel would
    give a worker thread 97 % of it, so the governor keeps both threads (the same spinner
    un-niced takes one away: test_a_real_neighbour_on_a_real_cpu)."""
    cpus = _quiet_pair()
    neighbour = _spin_on(cpus[0], nice=19)
    try:
        _spinning(neighbour)
        assert niced_tasks()[neighbour.pid].in_group
        windows = 0

        def own_s() -> float:  # the governor reads it once a window
            nonlocal windows
            windows += 1
            return time.process_time()

        calls: list[int] = []
        gov = ThreadGovernor(calls.append, 2, cpus=frozenset(cpus), window_s=0.5, read_own=own_s)
        started, spun, seen = time.monotonic(), _cpu_s(neighbour), cpu_seconds(gov.cpus)
        own_started = time.process_time()
        wait_for(lambda: gov.poll() is not None or windows > 5, 30, "five windows")
        wall = time.monotonic() - started
        share = (_cpu_s(neighbour) - spun) / wall
        own = time.process_time() - own_started
        now = cpu_seconds(gov.cpus)
    finally:
        _stop(neighbour)
    # premises: the spinner held its core, and no un-niced load came to the other one
    if share < 0.75:
        pytest.skip(f"the niced neighbour got {share:.2f} of CPU {cpus[0]}: others ran there")
    unniced = (now.busy_s - now.niced_s) - (seen.busy_s - seen.niced_s) - own
    if gov.threads != 2 and unniced / wall > 0.4:
        pytest.skip(f"un-niced load came to CPUs {cpus} ({unniced / wall:.2f} cores)")
    assert gov.threads == 2 and calls == [], f"free {gov.free_cores}, {share:.2f} spun"


@needs_two_cpus
@pytest.mark.skipif(not _autogroup_on(), reason="autogroup is off: nice weighs across sessions")
def test_a_real_niced_neighbour_in_another_session_takes_a_thread() -> None:
    """Under autogroup each session is a scheduling group, and groups share a core
    equally whatever their tasks' nice: a `nice -n 19` spinner in a session of its own
    (as cron or another terminal starts one) takes half of a core a worker thread wants,
    and a thread away like an un-niced one."""
    cpus = _quiet_pair()
    calls: list[int] = []
    gov = ThreadGovernor(calls.append, 2, cpus=frozenset(cpus), window_s=0.5)
    neighbour = _spin_on(cpus[0], nice=19, new_session=True)
    try:
        _spinning(neighbour)
        assert not niced_tasks()[neighbour.pid].in_group
        _threads_become(gov, 1)
    finally:
        _stop(neighbour)
    _threads_become(gov, 2)
    assert calls[0] == 1 and calls[-1] == 2
