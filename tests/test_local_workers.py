"""`LocalWorkers` as a context manager: the workers a block started are stopped when it
ends, cleanly (drained) or on an exception, against a real Redis and real worker
processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.local import LocalWorkers

SIM = ("--runner", "sim", "--sim-tok-s", "2000")


def _fleet(url: str, tmp_path: Path) -> LocalWorkers:
    return LocalWorkers(url, worker_args=SIM, log_dir=tmp_path, env={"OMP_NUM_THREADS": "1"})


def test_leaving_the_block_drains_its_workers(redis_url: str, tmp_path: Path) -> None:
    with _fleet(redis_url, tmp_path) as fleet:
        names = fleet.start(2, name_prefix="ctx")
        fleet.wait_live(names, timeout=120)
        procs = [fleet.procs[n] for n in names]
        assert all(p.poll() is None for p in procs)
    # drained: each got SIGTERM, finished and exited cleanly
    assert [p.poll() for p in procs] == [0, 0], fleet.log_tail()


def test_an_exception_in_the_block_still_stops_its_workers(redis_url: str, tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="the block failed"),
        _fleet(redis_url, tmp_path) as fleet,
    ):
        name = fleet.start_one("ctx-failing")
        fleet.wait_live([name], timeout=120)
        proc = fleet.procs[name]
        raise RuntimeError("the block failed")
    assert proc.poll() == 0, fleet.log(name)
