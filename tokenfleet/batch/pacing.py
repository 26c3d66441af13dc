"""How fast a batch's lines go out: the one submit-pacing rule of both batch runners.

A batch may hold thousands of lines; the fleet's queue is shared with interactive
work. So a round of submits takes the next lines, in order, only while

* the batch has fewer than `max_in_flight` jobs out (submitted, no result yet), and
* the band its jobs wait in is under `queue_share` of its cap (each band of a model has
  the model's cap), counted per model as the lines name them;

and the band at its cap or the tenant at its limit (`QueueFull`, `TenantQueueFull`)
ends the round too: the batch waits for the next one, it never fails a line for that.
A line the fleet refuses for good (`format.SUBMIT_REFUSALS`) is an error line and the
round goes on.

The rule is written once, as a plan (as the producer's are, producer/ops.py): a
generator that yields what it needs, `Room` (the model's cap and its band's depth) or
`Send` (submit this line), and is sent the answer. `batch/offline.py` carries it out
on the sync producer, `batch/driver.py` on the asyncio one.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Container, Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

from tokenfleet.batch.format import BatchLine


@dataclass(frozen=True)
class Pacing:
    max_in_flight: int = 64  # jobs one batch may have out at once
    queue_share: float = 0.5  # submit only while the band is under this much of its cap

    def room(self, cap: int, depth: int) -> int:
        """How many more jobs a band of `cap` holding `depth` takes before it is
        `queue_share` full (≤ 0: none)."""
        return math.ceil(cap * self.queue_share) - depth


class Sent(Enum):
    """What became of a line the runner was told to `Send`."""

    OUT = "out"  # submitted: a job out
    REFUSED = "refused"  # refused for good: the runner wrote its error line
    FULL = "full"  # QueueFull: the band or the tenant's limit is full, try next round


@dataclass(frozen=True)
class Room:
    """Answer (cap, depth): the cap of `model`'s bands and its band's depth now."""

    model: str


@dataclass(frozen=True)
class Send:
    """Submit `line`'s job; answer with what became of it (`Sent`)."""

    line: BatchLine


@dataclass(frozen=True)
class Invalid:
    """`line` has no request to submit (it failed validation); no answer."""

    line: BatchLine


Need: TypeAlias = Room | Send | Invalid
Round: TypeAlias = Generator[Need, Any, int]


def submit_round(
    pacing: Pacing,
    lines: Sequence[BatchLine],
    start: int,
    in_flight: int,
    done: Container[int] = (),
) -> Round:
    """One round over `lines[start:]` with `in_flight` jobs out already; returns where
    the next round starts (the first line not handled). Lines whose index is in `done`
    are passed over; each invalid one is handed out once (`Invalid`)."""
    room: dict[str, int] = {}  # jobs each model's band takes this round
    at = start
    while at < len(lines) and in_flight < pacing.max_in_flight:
        line = lines[at]
        if line.index in done:
            at += 1
            continue
        if line.body is None:
            yield Invalid(line)
            at += 1
            continue
        model = line.body.model
        if model not in room:
            cap, depth = yield Room(model)
            room[model] = pacing.room(cap, depth)
        if room[model] <= 0:
            break  # the band is busy: wait, leave room for interactive work
        sent = yield Send(line)
        if sent is Sent.FULL:
            break  # not the batch's fault: the next round tries again
        at += 1
        if sent is Sent.OUT:
            room[model] -= 1
            in_flight += 1
    return at


def carry_out(plan: Round, answer: Callable[[Need], Any]) -> int:
    """Run a round, answering each need with `answer` (sync runners); where the next
    round starts."""
    reply: Any = None
    while True:
        try:
            need = plan.send(reply)
        except StopIteration as stop:
            return int(stop.value)
        reply = answer(need)


async def carry_out_async(plan: Round, answer: Callable[[Need], Awaitable[Any]]) -> int:
    """`carry_out`, awaiting each answer (asyncio runners)."""
    reply: Any = None
    while True:
        try:
            need = plan.send(reply)
        except StopIteration as stop:
            return int(stop.value)
        reply = await answer(need)


__all__ = [
    "Invalid",
    "Need",
    "Pacing",
    "Room",
    "Round",
    "Send",
    "Sent",
    "carry_out",
    "carry_out_async",
    "submit_round",
]
