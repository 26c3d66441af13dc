"""`tokenfleet worker ...` with wall-clock totals of its loop's phases, for
bench/redis_overhead.py: run as `python bench/_timed_worker.py worker ARGS`. At exit
(SIGTERM drains, then the process ends) it writes {phase: [seconds, calls]} as JSON to
$TIMED_WORKER_OUT, counting only turns that start with work in the engine (an idle
turn blocks on its read); and the same phases' CPU time on the loop's own thread
(`time.thread_time`) as {"cpu " + phase: [seconds, calls]}: wall minus CPU is time the
thread was off a core (waiting on the kernel, or descheduled for another process).
llama.cpp's `llama_decode` computes on this thread too, so `tick`'s CPU includes its
share of the forward pass. The phases: `Worker.iteration` (all of one loop turn), `tick`
(`Engine.step` within it), `_send` / `_receive` (building, sending and applying the
tick's Redis round trip), `pull` (admitting what the last round trip read)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from tokenfleet.worker import loop

_seconds: defaultdict[str, float] = defaultdict(float)
_calls: Counter[str] = Counter()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: loop.Worker, *args: Any, **kwargs: Any) -> Any:
        if not self.engine.has_work:  # an idle turn (a blocking read): not a tick's cost
            return fn(self, *args, **kwargs)
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            _seconds[name] += time.perf_counter() - started
            _seconds[f"cpu {name}"] += time.thread_time() - cpu
            _calls[name] += 1
            _calls[f"cpu {name}"] += 1

    return wrapper


def _write() -> None:
    with open(os.environ["TIMED_WORKER_OUT"], "w") as f:
        json.dump({k: [_seconds[k], _calls[k]] for k in _seconds}, f)


def main() -> None:
    for phase in ("iteration", "tick", "_send", "_receive", "pull"):
        setattr(loop.Worker, phase, _timed(phase, getattr(loop.Worker, phase)))
    atexit.register(_write)
    from tokenfleet.cli import main as cli

    sys.argv = ["tokenfleet", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
