"""bench/e2e.py's in-process side: the engine stepped in a process of its own, once per
code tree (bench/_trees.py), so an old checkout's engine is measured beside the new one
in the same run.

    PYTHONPATH=TREE python bench/e2e_inprocess.py MODEL_DIR      (cwd: TREE)

imports tokenfleet from TREE (PYTHONPATH comes before the installed package) and only
what every tree has: `load_model`, `Engine(loaded, EngineConfig(...))`, `submit`,
`step`, `has_work`, `stats.ticks` and `GenerationRequest`. It loads MODEL_DIR (fp32,
CPU), writes one JSON line {"tokenfleet": <the package's path>}, then answers each run
read from stdin, one JSON line each way:

    in:  {"engine": EngineConfig kwargs, "threads": t, "groups": [[request fields]]}
    out: a Trace (asdict)

Everything else the libraries print goes to stderr. `EngineProcess` is the other end
of that pipe. `Trace` and `BURST_AFTER` are shared with bench/e2e.py, which runs the
same scenarios through Redis. Nothing from tokenfleet is imported at module level: in
bench/e2e.py this module runs on this checkout, in its child on the tree's.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _trees import Tree

LONG = 4  # sessions in flight when the burst arrives
BURST_AFTER = 8  # tokens each of them has before the burst is submitted
HERE = Path(__file__).resolve()  # this script, run by EngineProcess from a tree's folder


@dataclass
class Trace:
    """perf_counter times of one run: when each job was submitted, when each token and
    the finish event arrived (at the client, or after the step that produced them)."""

    groups: list[list[str]]
    submitted: dict[str, float] = field(default_factory=dict)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    queued: dict[str, float | None] = field(default_factory=dict)  # FinishEvent queued_s
    worker: dict[str, str | None] = field(default_factory=dict)  # FinishEvent worker
    step_s: float = 0.0  # in process: time inside Engine.step
    ticks: int = 0

    @property
    def t0(self) -> float:
        return min(self.submitted.values())

    @property
    def wall_s(self) -> float:
        return max(self.finished_at.values()) - self.t0

    @property
    def useful_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def ttft_s(self, ids: Sequence[str] | None = None) -> list[float]:
        ids = list(self.submitted) if ids is None else ids
        return [self.arrivals[j][0] - self.submitted[j] for j in ids]

    def queued_s(self) -> list[float]:
        return [q for q in self.queued.values() if q is not None]

    def burst_gaps_s(self) -> list[float]:
        """Gaps between consecutive tokens of the first group's jobs that end inside the
        window from the burst's submit to the last burst job's first token."""
        if len(self.groups) < 2:
            return []
        start = min(self.submitted[j] for j in self.groups[1])
        end = max(self.arrivals[j][0] for j in self.groups[1])
        gaps = []
        for j in self.groups[0]:
            a = self.arrivals[j]
            gaps += [b - a_ for a_, b in itertools.pairwise(a) if start < b <= end]
        return gaps

    def all_gaps_s(self) -> list[float]:
        return [b - a for t in self.arrivals.values() for a, b in itertools.pairwise(t)]


# ---- in the engine process -----------------------------------------------------------


def run_inprocess(loaded: Any, engine_kwargs: dict[str, Any], groups: list[list[Any]]) -> Trace:
    """Submit the first group, step; submit the next once every job of the first has
    BURST_AFTER tokens. Event times are taken when the step that made them returns."""
    from tokenfleet.worker.engine import Engine, EngineConfig

    engine = Engine(loaded, EngineConfig(**engine_kwargs))
    trace = Trace([[r.job_id for r in g] for g in groups])
    for g in groups:
        for r in g:
            trace.arrivals[r.job_id], trace.tokens[r.job_id] = [], []
    waiting = list(groups)

    def submit_next() -> None:
        now = time.perf_counter()
        for r in waiting.pop(0):
            trace.submitted[r.job_id] = now
            assert engine.submit(r).accepted

    submit_next()
    while engine.has_work or waiting:
        if waiting and all(len(trace.tokens[j]) >= BURST_AFTER for j in trace.groups[0]):
            submit_next()
        start = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        trace.step_s += now - start
        for event in out.tokens:
            trace.arrivals[event.job_id].append(now)
            trace.tokens[event.job_id].append(event.token_id)
        for done in out.finished:
            trace.finished_at[done.job_id] = now
            trace.queued[done.job_id] = done.event.timings.queued_s
            trace.worker[done.job_id] = done.event.worker
    trace.ticks = engine.stats.ticks
    return trace


def serve(model_dir: str) -> None:
    import torch

    import tokenfleet
    from tokenfleet.model import load_model
    from tokenfleet.protocol import GenerationRequest

    # Answers go to the real stdout; anything printed by a library lands on stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    loaded = load_model(model_dir, dtype="float32", device="cpu")
    answers.write(json.dumps({"tokenfleet": tokenfleet.__file__}) + "\n")
    answers.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        torch.set_num_threads(ask["threads"])
        groups = [[GenerationRequest(**r) for r in g] for g in ask["groups"]]
        answers.write(json.dumps(asdict(run_inprocess(loaded, ask["engine"], groups))) + "\n")
        answers.flush()


# ---- in bench/e2e.py: the trees' engine processes -------------------------------------


class EngineProcess:
    """One tree's engine, in bench/e2e_inprocess.py as a child process (model loaded once)."""

    def __init__(self, tree: Tree, model_dir: str, log: Path) -> None:
        self.tree = tree
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE), model_dir],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=tree.path,
                env={**os.environ, **tree.env()},
                text=True,
            )
        self.log = log
        self.tokenfleet = self._read()["tokenfleet"]
        assert Path(self.tokenfleet).resolve().is_relative_to(tree.path), self.tokenfleet

    def run(self, engine: dict[str, Any], threads: int, groups: list[list[Any]]) -> Trace:
        """One run: EngineConfig(**engine), `threads` torch threads, the request groups
        (GenerationRequest of any tree: only their set fields cross)."""
        ask = {
            "engine": engine,
            "threads": threads,
            "groups": [[r.model_dump(exclude_unset=True) for r in g] for g in groups],
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return Trace(**self._read())

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {self.tree.name} engine process ended: {tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
