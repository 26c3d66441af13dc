"""Benchmarks that go through Redis: a redis-server with groups of local
`tokenfleet worker`s on it (this checkout's or another tree's), and clients that follow
jobs' token streams the way a user's client does (`JobHandle.stream()`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis
from _common import Stream
from _rounds import wait_until
from _trees import Tree

from tokenfleet.local import LocalWorkers, RedisServer
from tokenfleet.producer import Producer


class Fleet:
    """A redis-server of this process's own (a free port, nothing saved) and the worker
    groups started on it. Closing drains every group (SIGTERM: in-flight jobs finish),
    then stops the server."""

    def __init__(self) -> None:
        self.redis = RedisServer.launch()
        self.groups: list[LocalWorkers] = []

    @property
    def url(self) -> str:
        return self.redis.url

    def workers(
        self,
        prefix: str,
        args: Sequence[str],
        tree: Tree | None = None,
        log_dir: Path | None = None,
    ) -> LocalWorkers:
        """A group of workers with `args` on key prefix `prefix`, importing `tree`'s
        tokenfleet (default: this checkout's), logs in `log_dir`; none started yet."""
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        group = LocalWorkers(
            self.url,
            prefix,
            list(args),
            log_dir=log_dir,
            env={} if tree is None else tree.env(),
            cwd=None if tree is None else tree.path,
        )
        self.groups.append(group)
        return group

    def sides(
        self, prefix: str, args: Sequence[str], baseline: Path | None, log_dir: Path
    ) -> dict[str, LocalWorkers]:
        """The groups an A/B run compares: "this tree", this checkout's workers on
        `prefix`, and with `baseline` (another checkout's path) "baseline", that tree's
        on a prefix of its own (PREFIX-base:)."""
        sides = {"this tree": self.workers(prefix, args, log_dir=log_dir)}
        if baseline is not None:
            tree = Tree.parse(str(baseline), "baseline")
            base = prefix.removesuffix(":") + "-base:"
            sides["baseline"] = self.workers(base, args, tree, log_dir)
        return sides

    def producer(self, workers: LocalWorkers, queue_cap: int = 10_000) -> Producer:
        """A producer on the group's key prefix, on a connection of its own (`queue_cap`:
        the cap it assumes while none is set)."""
        client = redis.Redis.from_url(self.url)
        return Producer(client, keys=workers.keys, default_cap=queue_cap)

    def close(self) -> None:
        try:
            for group in self.groups:
                group.drain()
        finally:
            self.redis.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Follower(threading.Thread):
    """Follows one job with `JobHandle.stream()`, timing every token as it arrives."""

    def __init__(
        self, producer: Producer, job_id: str, timeout_s: float, notify_after: int = 0
    ) -> None:
        super().__init__(daemon=True)
        self.handle = producer.handle(job_id)
        self.timeout_s = timeout_s
        self.notify_after = notify_after
        self.arrivals: list[float] = []  # perf_counter time of each token
        self.tokens: list[int] = []
        self.finished_at = 0.0
        self.reached = threading.Event()  # notify_after tokens seen (or the job ended)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for event in self.handle.stream(timeout=self.timeout_s):
                self.arrivals.append(time.perf_counter())
                self.tokens.append(event.token_id)
                if len(self.tokens) == self.notify_after:
                    self.reached.set()
            self.finished_at = time.perf_counter()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.reached.set()

    def result(self) -> Follower:
        """This follower, once its job finished (RuntimeError if it did not)."""
        self.join(self.timeout_s)
        if self.error is not None or self.is_alive() or self.handle.finish is None:
            raise RuntimeError(f"job {self.handle.id} did not finish: {self.error!r}")
        return self

    def stream(self, submitted: float, prompt_tokens: int) -> Stream:
        """The finished job's timeline, submitted at `submitted` (perf_counter)."""
        self.result()
        out = Stream(submitted=submitted, tokens=self.tokens, prompt_tokens=prompt_tokens)
        if self.arrivals:
            out.first, out.last = self.arrivals[0], self.arrivals[-1]
        return out


def follow(
    producer: Producer, job_ids: Sequence[str], timeout_s: float, notify_after: int = 0
) -> dict[str, Follower]:
    """A started follower per job, returned once each is subscribed to its job's channel
    (so no token is published before its client listens)."""
    followers = {j: Follower(producer, j, timeout_s, notify_after) for j in job_ids}
    for f in followers.values():
        f.start()
    channels = [producer.keys.channel(j) for j in job_ids]

    def subscribed() -> bool:
        return all(n >= 1 for _, n in producer.redis.pubsub_numsub(*channels))

    if not wait_until(subscribed, 30, every_s=0.005):
        raise TimeoutError("followers did not subscribe")
    return followers
