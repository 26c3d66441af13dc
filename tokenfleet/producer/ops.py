"""What a producer call asks of Redis, as data, and how a transport drives it.

Each producer call is written once, as a plan (tokenfleet.producer.core): a generator
that yields the ops below and is sent each op's reply; it returns the call's result.
A transport carries the ops out: `client.py` on redis-py, `aio.py` on redis.asyncio.
So the sync and async clients run the same code for every decision (what to send,
how to read the reply, when to reconnect) and differ only in how they wait.

An op that fails is thrown into the plan at its `yield`: the plan decides whether
that is worth a retry (see `follow.reconnect_pause`) or propagates it to the caller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from tokenfleet.keys import Keys
from tokenfleet.lua.calls import ScriptArg
from tokenfleet.protocol import TokenEvent

T = TypeVar("T")


class Command:
    """One Redis command, as redis-cli would type it: `Command("HGET", key, "status")`.
    Its reply is redis-py's for `execute_command` (the same as the named method's)."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __repr__(self) -> str:
        return f"Command{self.args!r}"


@dataclass(frozen=True)
class Submit:
    """submit.lua (registered once per producer) with these KEYS and ARGV (a
    `calls.SubmitCall`'s); its reply."""

    keys: list[str]
    args: list[ScriptArg]
    # (replicas, timeout ms): a durable submit, followed by WAIT on the same connection;
    # fewer replicas than asked raise NotReplicated (tokenfleet/producer/durable.py)
    wait: tuple[int, int] | None = None


@dataclass(frozen=True)
class Batch:
    """One round trip: a non-transactional pipeline; the list of the replies in order.
    With `errors_as_replies`, a command Redis refused has its error as its reply."""

    commands: tuple[Command | Submit, ...]
    errors_as_replies: bool = False


@dataclass(frozen=True)
class ReadFleet:
    """The live workers (`tokenfleet.fleet`): a dict of name → WorkerInfo."""

    keys: Keys


@dataclass(frozen=True)
class Subscribe:
    """Open the plan's subscription to `channel` (closing any it had)."""

    channel: str


@dataclass(frozen=True)
class Listen:
    """Wait up to `timeout` seconds for a message on the subscription: the message, or None."""

    timeout: float


@dataclass(frozen=True)
class Disconnect:
    """The connection was lost: close the plan's subscription (quietly, its connection
    may be broken), then pause `seconds` (the plan's backoff) before it tries again."""

    seconds: float


@dataclass(frozen=True)
class Emit:
    """Hand `event` to the caller (stream plans); the plan resumes when it asks for more."""

    event: TokenEvent


Op: TypeAlias = Command | Submit | Batch | ReadFleet | Subscribe | Listen | Disconnect | Emit
Plan: TypeAlias = Generator[Op, Any, T]


class Step(Generic[T]):
    """A plan, driven from outside: iterate it for the ops to carry out, and settle each
    before the next (`settle` calls what carries it out, `settle_async` awaits it): its
    reply is sent into the plan, or what it raised is thrown in. Once the plan returned,
    what it returned is `value`. A transport's whole loop:

        for op in step:
            if isinstance(op, Emit):
                yield op.event
            else:
                step.settle(do, op)
    """

    def __init__(self, plan: Plan[T]) -> None:
        self._plan = plan
        self._reply: Any = None
        self._error: Exception | None = None
        self._done = False
        self._value: T | None = None

    def __iter__(self) -> Iterator[Op]:
        while True:
            reply, error = self._reply, self._error
            self._reply, self._error = None, None
            try:
                yield self._plan.throw(error) if error is not None else self._plan.send(reply)
            except StopIteration as stop:
                self._done, self._value = True, stop.value
                return

    def settle(self, do: Callable[[Op], Any], op: Op) -> None:
        try:
            self._reply = do(op)
        except Exception as exc:
            self._error = exc

    async def settle_async(self, reply: Awaitable[Any]) -> None:
        try:
            self._reply = await reply
        except Exception as exc:
            self._error = exc

    @property
    def value(self) -> T:
        assert self._done, "the plan has not returned"
        return self._value  # type: ignore[return-value]  # T itself may include None

    def close(self) -> None:
        self._plan.close()
