"""Building a worker: what `tokenfleet worker` runs, without the command line.

`build_worker` turns settings and already-parsed flags into a ready `Worker`:
the model loaded onto its device, an `Engine` holding the node's budget (with
the fault hook the fault tests use), a Redis client, and the loop around them.
It reads no environment variable and no flag itself, so a test builds a worker
the way the command does. A flag left as None takes the setting of the same
name (`$TOKENFLEET_MODEL`, `$TOKENFLEET_DEVICE`, `$TOKENFLEET_DTYPE`).

Process-wide set-up stays with the caller: logging, signal handlers
(`Worker.install_signal_handlers`) and the exit code of `Worker.run()`.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis
import torch

from tokenfleet.config import Settings
from tokenfleet.errors import ModelLoadError, TokenfleetError
from tokenfleet.keys import Keys
from tokenfleet.model.loader import load_model
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.loop import Worker, WorkerOptions
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.session import Session
from tokenfleet.worker.threads import ThreadGovernor

__all__ = ["InvalidBudget", "build_worker", "fault_on_metadata"]

logger = logging.getLogger(__name__)


class InvalidBudget(TokenfleetError, ValueError):
    """The engine's flags do not fit the model (e.g. a KV budget smaller than one block)."""


def fault_on_metadata(key: str) -> Callable[[Session], None]:
    """Tests only: a hook that fails the forward of every job whose metadata has `key`."""

    def inject(session: Session) -> None:
        if key in session.request.metadata:
            raise RuntimeError(f"injected fault (metadata key {key!r})")

    return inject


def build_worker(
    settings: Settings,
    *,
    checkpoint: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    compile_model: bool | None = None,
    engine: EngineConfig | None = None,
    options: WorkerOptions | None = None,
    threads: int | None = None,
    metrics_port: int | None = None,
    fault_key: str | None = None,
) -> Worker:
    """A worker ready to `run()` on `settings.redis_url` under `settings.prefix`.

    checkpoint    preset name (tiny-random) or checkpoint folder; None: `settings.model`
    device        cpu, cuda, cuda:N or auto (cuda when available); None: `settings.device`
    dtype         auto, float32, bfloat16 or float16; None: `settings.dtype`
    quant         int8 or int4 weights ("none": dense); None: `settings.quant`
    compile_model compile the forward's row-wise parts and warm them up before serving;
                  None: `settings.compile`, and where that is unset too: only for
                  quantized weights (measured faster there, not for dense ones)
    engine        the node's budget knobs (default `EngineConfig()`)
    options       the loop's options: name, jobs stream (`model`), burst, drain, ...;
                  its heartbeat `info` gets the model, device, dtype and host added
    threads       torch CPU threads (process-wide), set before the model loads and kept;
                  None: start at torch's default (one per core) and fit the count to the
                  cores other processes leave free (`worker.threads.ThreadGovernor`)
    metrics_port  serve Prometheus metrics on this port from now on
    fault_key     tests only: fail the forward of jobs whose metadata has this key

    Raises `ModelLoadError` when the model cannot be loaded onto the device, and
    `InvalidBudget` when the engine's budget does not fit it.
    """
    options = options or WorkerOptions()
    checkpoint = checkpoint or settings.model
    if threads:
        torch.set_num_threads(threads)
    quant = quant or settings.quant
    loaded = load_model(
        checkpoint,
        dtype=dtype or settings.dtype,
        device=device or settings.device,
        quant=None if quant in (None, "none") else quant,
    )
    compile_info: dict[str, object] = {}
    if compile_model is None:
        compile_model = settings.compile
    explicit = compile_model is not None
    if compile_model is None:  # auto: where it pays (docs/benchmarks.md, issue 12)
        compile_model = loaded.quant is not None
    if compile_model:
        from tokenfleet.model.compiled import compile_model as compile_

        compile_info = _compile_or_stay_eager(loaded.model, compile_, explicit)
    fault = fault_on_metadata(fault_key) if fault_key is not None else None
    governor = None
    if not threads and loaded.device.type == "cpu":
        governor = ThreadGovernor.for_this_process(torch.get_num_threads, torch.set_num_threads)
    try:
        core = Engine(
            loaded, engine or EngineConfig(), worker=options.name, fault=fault, threads=governor
        )
    except ValueError as exc:
        raise InvalidBudget(f"invalid budget: {exc}") from exc
    served = options.model or "default"
    options = replace(
        options,
        info={
            **options.info,
            "model": served,
            "checkpoint": checkpoint,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            # a quantized file is served dequantized: what it was, what it serves as
            "source_quant": loaded.source_quant,
            "quant": loaded.quant,  # weights kept int8 / int4; None: dense in `dtype`
            **compile_info,
            # what a job that leaves temperature/top_k/top_p unset samples with
            "sampling_defaults": loaded.sampling_defaults.as_fields(),
            "host": platform.node(),
        },
    )
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics(options.name, served)
        metrics.serve(metrics_port)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, health_check_interval=5)
    return Worker(core, client, Keys(settings.prefix), options, metrics)


def _compile_or_stay_eager(
    model: Any, compile_: Callable[[Any], Any], explicit: bool
) -> dict[str, object]:
    """Compile the model's forward; when that fails (no C++ compiler for inductor, an
    unsupported platform) a worker that did not ask for it serves eagerly instead, and
    says why in its hash. One that asked (`--compile`) fails at start."""
    try:
        report = compile_(model)
    except Exception as exc:  # inductor raises many kinds (CppCompileError, OSError, ...)
        if explicit:
            raise ModelLoadError(f"--compile failed: {type(exc).__name__}: {exc}") from exc
        from tokenfleet.model.compiled import uncompile_model

        uncompile_model(model)
        logger.warning("compiling the forward failed, serving eagerly: %s", exc)
        return {"compile_mode": None, "compile_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"compile_mode": report.mode, "compile_s": round(report.warmup_s, 2)}
