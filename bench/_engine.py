"""The engine in process, through the API every code tree has: `Engine(model or runner,
EngineConfig(...))`, `submit`, then `step` while `has_work`. Sized as the engine
benchmark sizes it: KV room for every job at once at the longest job's length.

bench/ab_engine.py runs this module under other checkouts' tokenfleet, so it imports
nothing newer than that API.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from _common import Job

from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import EngineConfig

MiB = 1024 * 1024


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_budget_bytes(per_token: int, jobs: Sequence[Job], batch: int) -> int:
    """Twice the room for `batch` sequences of the longest job (prompt + new + a block of
    slack), at least 16 MiB."""
    longest = max(len(j.prompt_ids) + j.max_new for j in jobs) + 16
    return max(16 * MiB, 2 * per_token * longest * batch)


def engine_config(loaded: Any, jobs: Sequence[Job], batch: int) -> EngineConfig:
    """`batch` sessions at once, every job waiting meanwhile, K/V in the model's dtype."""
    cfg = loaded.config
    dtype_bytes = torch.empty((), dtype=loaded.dtype).element_size()
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype_bytes)
    return EngineConfig(
        kv_budget_bytes=kv_budget_bytes(per_token, jobs, batch),
        max_batch_size=batch,
        max_active=batch,
        max_waiting=len(jobs),
    )


def submit_all(engine: Any, reqs: Sequence[GenerationRequest]) -> None:
    """Submit every request; each must be accepted."""
    for req in reqs:
        if not engine.submit(req).accepted:
            raise RuntimeError(f"the engine did not accept {req.job_id}")


def steps(engine: Any) -> Iterator[Any]:
    """Step until the engine is idle: each step's output."""
    while engine.has_work:
        yield engine.step()


def generate(engine: Any, reqs: Sequence[GenerationRequest]) -> list[list[int]]:
    """Submit every request, step until done: every request's tokens, in their order."""
    out: dict[str, list[int]] = {r.job_id: [] for r in reqs}
    submit_all(engine, reqs)
    for step in steps(engine):
        for event in step.tokens:
            out[event.job_id].append(event.token_id)
    return [out[r.job_id] for r in reqs]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels, so a clock read after it covers them (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
