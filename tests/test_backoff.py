"""The one backoff every Redis retry loop waits with (tokenfleet.backoff), on a clock
the test moves by hand."""

from __future__ import annotations

import random

import pytest

from tokenfleet.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_a_success_starts_over() -> None:
    backoff = Backoff(first_s=0.05, max_s=0.3, jitter=0.0)
    assert [backoff.failed(float(t)) for t in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert backoff.since == 0.0 and backoff.lasted(4.0) == 4.0
    assert not backoff.over(1e9)  # no bound: never over
    backoff.succeeded()
    assert backoff.since is None and backoff.lasted(5.0) == 0.0
    assert backoff.failed(10.0) == 0.05 and backoff.since == 10.0


def test_jitter_cuts_each_pause_by_up_to_its_share() -> None:
    random.seed(7)
    backoff = Backoff(first_s=1.0, max_s=1.0, jitter=0.5)
    pauses = [backoff.failed(0.0) for _ in range(200)]
    assert all(0.5 <= p <= 1.0 for p in pauses)
    assert max(pauses) - min(pauses) > 0.3  # spread, not one value


def test_an_outage_is_over_at_its_limit_and_no_pause_runs_past_it() -> None:
    backoff = Backoff(first_s=1.0, max_s=4.0, jitter=0.0, limit_s=5.0)
    assert backoff.failed(100.0) == 1.0  # the outage starts at the first failure
    assert backoff.failed(101.0) == 2.0
    assert backoff.failed(103.0) == 2.0  # 4 s would run past 105: the last try is at it
    assert not backoff.over(104.9)
    assert backoff.over(105.0)
    backoff.succeeded()
    assert not backoff.over(105.0)  # a new outage starts with its whole limit


def test_a_deadline_bounds_every_outage_and_the_tighter_bound_wins() -> None:
    backoff = Backoff(first_s=1.0, max_s=1.0, jitter=0.0, deadline=10.0)
    assert backoff.failed(9.5) == 0.5
    assert backoff.over(10.0)
    both = Backoff(first_s=1.0, max_s=1.0, jitter=0.0, limit_s=60.0, deadline=10.0)
    both.failed(0.0)
    assert both.over(10.0)
    assert Backoff(first_s=1.0, max_s=1.0, limit_s=0.0).over(3.0)  # no retry at all


@pytest.mark.parametrize(
    "args", [{"first_s": 0.0, "max_s": 1.0}, {"first_s": 1.0, "max_s": 1.0, "jitter": 1.0}]
)
def test_a_backoff_that_cannot_wait_is_refused(args: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**args)
