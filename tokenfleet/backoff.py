"""Waiting Redis out: capped exponential backoff over one outage, and when to give up.

The one rule for every loop that retries Redis: the worker loop, the producer's
followers (`producer/follow.py`), the gateway's pub/sub shards (`gateway/subscriber.py`),
its replay reads and its background cancels (`gateway/jobs.py`). Each says how fast it
retries and how long it waits; what is worth retrying at all is for
`redis_errors.fault_of` to say. The clock is the caller's (`time.monotonic()`), so the
rule is tested without sleeping.

A loop that retries:

    backoff = Backoff(first_s=0.05, max_s=1.0)
    while True:
        try:
            reply = attempt()
        except redis.ConnectionError:
            pause = backoff.failed(time.monotonic())
            if backoff.over(time.monotonic()):
                raise
            time.sleep(pause)
            continue
        backoff.succeeded()
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Pauses start at `first_s` and double with each failure, capped at `max_s`; each
    is cut by a random part of up to `jitter` of it (clients cut off together don't all come
    back in the same millisecond; 0: exact pauses).

    An outage starts at the first failure and ends at the next success (`succeeded`,
    which also resets the pause). It is over, and the caller gives up, once it has
    lasted `limit_s` or the monotonic `deadline` has passed (None: no bound); no pause
    runs past that moment, so the last try is made at it."""

    first_s: float
    max_s: float
    jitter: float = 0.5
    limit_s: float | None = None
    deadline: float | None = None
    since: float | None = field(default=None, init=False)  # the outage's start; None: none
    delay: float = field(init=False)  # the next pause, before jitter

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s <= 0 or not 0 <= self.jitter < 1:
            raise ValueError(
                f"backoff needs first_s > 0, max_s > 0 and 0 <= jitter < 1, got "
                f"first_s={self.first_s}, max_s={self.max_s}, jitter={self.jitter}"
            )
        self.delay = self.first_s

    def give_up_at(self, now: float) -> float:
        """When the outage under way (or one starting at `now`) is over; inf: never."""
        at = math.inf if self.deadline is None else self.deadline
        if self.limit_s is not None:
            at = min(at, (now if self.since is None else self.since) + self.limit_s)
        return at

    def failed(self, now: float) -> float:
        """A try failed at `now`: the pause before the next one (the first failure
        starts the outage)."""
        if self.since is None:
            self.since = now
        pause = self.delay * (1 - self.jitter * random.random())
        self.delay = min(self.delay * 2, self.max_s)
        return max(0.0, min(pause, self.give_up_at(now) - now))

    def over(self, now: float) -> bool:
        """The outage has lasted its bound: give up instead of pausing."""
        return now >= self.give_up_at(now)

    def lasted(self, now: float) -> float:
        """How long the outage under way has lasted (0 when there is none)."""
        return 0.0 if self.since is None else now - self.since

    def succeeded(self) -> None:
        self.since = None
        self.delay = self.first_s
