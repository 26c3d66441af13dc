"""Building a worker: what `tokenfleet worker` runs, without the command line.

`build_worker` turns `WorkerSettings` into a ready `Worker`: the model loaded onto
its device (or, with `runner="sim"`, a `SimRunner` that paces ticks like a GPU and
loads no model: torch is not even imported), an `Engine` holding the node's budget
(with the fault hook the fault tests use), a Redis client, and the loop around them.
It reads no environment variable and no flag itself (the settings did), so a test
builds a worker the way the command does.

Process-wide set-up stays with the caller: logging, signal handlers
(`Worker.install_signal_handlers`) and the exit code of `Worker.run()`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenfleet.config import WorkerSettings
from tokenfleet.connect import connect
from tokenfleet.errors import ModelLoadError, TokenfleetError
from tokenfleet.model.sim_runner import SimPace, SimRunner
from tokenfleet.seam import ModelRunner
from tokenfleet.tools import tool_format
from tokenfleet.worker.bands import FairnessConfig
from tokenfleet.worker.engine import Engine, EngineConfig
from tokenfleet.worker.loop import Worker, WorkerOptions, default_worker_name
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.session import Session
from tokenfleet.worker.threads import ThreadGovernor

if TYPE_CHECKING:
    from tokenfleet.model.auto import EnginePlan
    from tokenfleet.model.build import LoadedModel
    from tokenfleet.model.llamacpp_runner import LlamaCppOptions

__all__ = [
    "InvalidBudget",
    "build_worker",
    "engine_config",
    "fault_on_metadata",
    "llamacpp_options",
    "worker_options",
]

logger = logging.getLogger(__name__)
MiB = 1024 * 1024


class InvalidBudget(TokenfleetError, ValueError):
    """The engine's settings are invalid or do not fit the model (e.g. a KV budget
    smaller than one block)."""


def fault_on_metadata(key: str) -> Callable[[Session], None]:
    """Tests only: a hook that fails the forward of every job whose metadata has `key`."""

    def inject(session: Session) -> None:
        if key in session.request.metadata:
            raise RuntimeError(f"injected fault (metadata key {key!r})")

    return inject


def engine_config(settings: WorkerSettings) -> EngineConfig:
    """The node's budget knobs; `InvalidBudget` for a band share or hold out of range."""
    try:
        fairness = FairnessConfig(band_share=settings.band_share, hold_s=settings.hold_s)
    except ValueError as exc:
        raise InvalidBudget(str(exc)) from exc
    max_active = settings.max_active
    if settings.kv_streams:
        if settings.runner != "llamacpp":
            raise InvalidBudget("--kv-streams is the llama.cpp runner's KV layout")
        if prefix_cache_on(settings):
            raise InvalidBudget(
                "--kv-streams gives each job a stream of cells of its own; prefix sharing "
                "lends cells within one pool: drop --prefix-cache (or --kv-streams)"
            )
        max_active = min(max_active, settings.kv_streams)  # a stream per active job
    return EngineConfig(
        kv_budget_bytes=settings.kv_mb * MiB,
        max_active=max_active,
        max_batch_size=settings.max_batch,
        max_prefill_tokens_per_tick=settings.prefill_tokens,
        max_waiting=settings.max_waiting,
        prefix_cache=prefix_cache_on(settings),
        fairness=fairness,
    )


def prefix_cache_on(settings: WorkerSettings) -> bool:
    """`--prefix-cache` as given; unset, on except on the llama.cpp runner (its prefix
    sharing keeps finished sequences' cells in llama.cpp's one pool, and every decode
    row's attention walks them: a cost jobs that share no prefix pay for nothing)."""
    if settings.prefix_cache is not None:
        return settings.prefix_cache
    return settings.runner != "llamacpp"


def worker_options(settings: WorkerSettings, info: dict[str, Any]) -> WorkerOptions:
    """The loop's options; `info` is what its heartbeat says about the worker."""
    return WorkerOptions(
        name=settings.name or default_worker_name(),
        model=settings.model_name,
        burst=settings.burst,
        max_deliveries=settings.max_deliveries,
        drain_timeout_s=settings.drain_timeout,
        overlap=settings.overlap,
        stream_interval=settings.stream_interval,
        stream_interval_s=None
        if settings.stream_interval_ms is None
        else settings.stream_interval_ms / 1000,
        wait_replicas=settings.wait_replicas,
        wait_timeout_ms=settings.wait_timeout_ms,
        info=info,
    )


def build_worker(settings: WorkerSettings) -> Worker:
    """A worker ready to `run()` on `settings.redis_url` under `settings.prefix`.

    `settings.threads` pins torch's CPU threads (process-wide) before the model loads;
    unset on a CPU, the count starts at torch's default (one per core) and is fitted to
    the cores other processes leave free (`worker.threads.ThreadGovernor`).
    `settings.compile` unset compiles quantized weights only (measured faster there).

    `settings.runner == "llamacpp"` serves a GGUF file on llama.cpp's kernels
    (`LlamaCppRunner`, sized to the node's KV budget and batch); the governor then fits
    llama.cpp's threads, and torch only samples, on one thread.
    `settings.runner == "sim"` builds a `SimRunner` paced by `sim_tok_s` and
    `sim_tick_ms` instead: no model, no torch, no thread governor, no compile.

    Raises `ModelLoadError` when the model cannot be loaded onto the device, and
    `InvalidBudget` when the engine's budget is invalid or does not fit it.
    """
    engine = engine_config(settings)  # before the model loads: a bad flag fails fast
    model: ModelRunner | LoadedModel
    if settings.runner == "sim":
        model, info, governor = _sim_runner(settings)
    elif settings.runner == "llamacpp":
        model, info, governor = llamacpp_model(settings, engine)
    else:
        model, info, governor = torch_model(settings)
    options = worker_options(settings, info)
    fault = fault_on_metadata(settings.fault_key) if settings.fault_key is not None else None
    try:
        core = Engine(model, engine, worker=options.name, fault=fault, threads=governor)
    except ValueError as exc:
        raise InvalidBudget(f"invalid budget: {exc}") from exc
    metrics = None
    if settings.metrics_port is not None:
        metrics = WorkerMetrics(options.name, options.info["model"])
        metrics.serve(settings.metrics_port)
    client = connect(settings.redis_url, socket_timeout=10, health_check_interval=5)
    return Worker(core, client, settings.keys(), options, metrics)


def torch_model(
    settings: WorkerSettings,
) -> tuple[LoadedModel, dict[str, Any], ThreadGovernor | None]:
    """The model loaded (and compiled where asked), what the heartbeat says about it, and
    the thread governor of a CPU worker whose threads were not pinned."""
    import torch

    from tokenfleet.model.loader import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    # a default start (`--dtype auto`, no --quant, no --deterministic): the engine plan
    auto = settings.dtype == "auto" and settings.quant is None and not settings.deterministic
    loaded = load_model(
        settings.model,
        dtype=settings.dtype,
        device=settings.device,
        quant=settings.quant,
        deterministic=settings.deterministic,
        q4_aside=auto,
    )
    plan = None
    if auto:
        from tokenfleet.model.auto import apply_plan

        loaded, plan = apply_plan(
            loaded, compile_asked=settings.compile, kv_dtype=settings.kv_dtype
        )
        logger.info("engine plan: %s", plan.why)
    _kv_dtype(loaded, settings.kv_dtype)
    compile_info = _compile(loaded, settings.compile, plan)
    compile_info["cuda_graphs"] = _cuda_graphs(loaded, settings)
    governor = None
    if not settings.threads and loaded.device.type == "cpu":
        governor = ThreadGovernor.for_this_process(torch.get_num_threads, torch.set_num_threads)
    info = _heartbeat_info(settings, loaded, compile_info)
    info["engine"] = None if plan is None else plan.as_fields()
    return loaded, info, governor


def _kv_dtype(loaded: LoadedModel, asked: str) -> None:
    """The KV pool's dtype as `--kv-dtype` asks (auto: as the engine plan set it, where a
    default start has one; else the model's)."""
    import torch

    if asked == "auto":
        return
    dtype = loaded.dtype if asked == "model" else getattr(torch, asked)
    try:
        loaded.model.set_kv_dtype(dtype)
    except ValueError as exc:
        raise ModelLoadError(f"--kv-dtype {asked}: {exc}") from exc


def _sim_runner(settings: WorkerSettings) -> tuple[SimRunner, dict[str, Any], None]:
    """A `SimRunner` at the settings' pace and what the heartbeat says about it."""
    runner = SimRunner(SimPace(settings.sim_tok_s, settings.sim_tick_ms / 1000))
    info = {
        "model": settings.model_name or "default",
        "checkpoint": "sim",
        "runner": "sim",
        "sim_tok_s": settings.sim_tok_s,
        "sim_tick_ms": settings.sim_tick_ms,
        "device": "sim",
        "sampling_defaults": {},
        "tool_format": str(tool_format(runner.tokenizer.chat_template)),
        "host": platform.node(),
    }
    return runner, info, None


def llamacpp_options(
    engine: EngineConfig, threads: int | None, kv_streams: int = 0
) -> LlamaCppOptions:
    """llama.cpp's context sized to what the engine will plan: the KV budget in cells,
    a sequence per active session, a batch as large as a tick's rows; prefix sharing as
    the engine's prefix cache says (`threads` None: llama.cpp's default, governed);
    `kv_streams` > 0: that many streams of cells (engine.max_active is at most that)."""
    from tokenfleet.model.llamacpp_runner import LlamaCppOptions

    return LlamaCppOptions(
        kv_budget_bytes=engine.kv_budget_bytes,
        block_size=engine.block_size,
        max_sequences=kv_streams or engine.max_active,
        max_tick_tokens=engine.max_batch_size + engine.max_prefill_tokens_per_tick,
        threads=threads,
        prefix_sharing=engine.prefix_cache,
        kv_streams=kv_streams > 0,
    )


def llamacpp_model(
    settings: WorkerSettings, engine: EngineConfig
) -> tuple[ModelRunner, dict[str, Any], ThreadGovernor | None]:
    """The model on llama.cpp, sized to the node's budget, what the heartbeat says about
    it, and a thread governor over llama.cpp's threads unless `settings.threads` pins
    them (its threads wait for each other at every op, as torch's do: worker/threads.py)."""
    from tokenfleet.model.llamacpp_runner import LlamaCppRunner
    from tokenfleet.model.loader import preset_file

    unsupported = [
        flag
        for flag, given in (
            ("--quant", settings.quant is not None),
            ("--deterministic", settings.deterministic),
            ("--kv-dtype model", settings.kv_dtype == "model"),  # llama.cpp's cache: float16
            ("--compile", bool(settings.compile)),
            ("--device", settings.device not in ("auto", "cpu")),
        )
        if given
    ]
    if unsupported:
        raise ModelLoadError(
            f"--runner llamacpp serves the file's own quantization on the CPU: "
            f"{', '.join(unsupported)} do not apply to it"
        )
    runner = LlamaCppRunner(
        preset_file(settings.model), llamacpp_options(engine, settings.threads, settings.kv_streams)
    )
    # torch only samples here (a few rows a tick): one thread, so that no OpenMP pool
    # spins beside llama.cpp's own threads between ticks
    import torch

    torch.set_num_threads(1)
    template = runner.tokenizer.chat_template if runner.tokenizer is not None else None
    info = {
        "model": settings.model_name or "default",
        "checkpoint": settings.model,
        "device": "cpu",
        "dtype": None,
        "kv_dtype": "float16",  # llama.cpp's default cache type (KV_BYTES)
        "source_quant": runner.source_quant,
        "quant": None,
        "deterministic": None,
        **runner.info,
        "sampling_defaults": runner.spec.sampling_defaults.as_fields(),
        "tool_format": str(tool_format(template)),
        "host": platform.node(),
    }
    governor = None
    if not settings.threads:
        governor = ThreadGovernor.for_this_process(lambda: runner.threads, runner.set_threads)
    return runner, info, governor


def _heartbeat_info(
    settings: WorkerSettings, loaded: LoadedModel, compile_info: dict[str, object]
) -> dict[str, Any]:
    """What the worker's hash says it serves, and how."""
    template = loaded.tokenizer.chat_template if loaded.tokenizer is not None else None
    det = loaded.model.deterministic
    return {
        "model": settings.model_name or "default",
        "checkpoint": settings.model,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_dtype": str(loaded.model.kv_dtype).removeprefix("torch."),  # what the KV pool holds
        # a quantized file is served dequantized: what it was, what it serves as
        "source_quant": loaded.source_quant,
        "quant": loaded.quant,  # weights kept int8 / int4; None: dense in `dtype`
        # batch-invariant numerics (`--deterministic`) and how; None: off
        "deterministic": None if det is None else det.as_fields(),
        **compile_info,
        # what a job that leaves temperature/top_k/top_p unset samples with
        "sampling_defaults": loaded.sampling_defaults.as_fields(),
        # how its model writes tool calls: how the gateway reads them back
        "tool_format": str(tool_format(template)),
        "host": platform.node(),
    }


def _compile(
    loaded: LoadedModel, asked: bool | None, plan: EnginePlan | None = None
) -> dict[str, object]:
    """Compile the forward where asked, or, unset, where the engine plan says so (a
    default start), or with quantized weights (measured faster there: issue 12); what the
    heartbeat says about it. Decode ticks compile as one graph where the plan says so,
    and with `--quant` on a CPU, where every tick runs the packed weights: the per-call
    cost the graph removes is the same there. Such a model left uncompiled (not wanted,
    or failed) still runs its decode ticks on the native stack where it serves."""
    if plan is not None:
        wanted = plan.compile
    else:
        wanted = asked if asked is not None else loaded.quant is not None
    info: dict[str, object] = {}
    if wanted:
        from tokenfleet.model.compiled import compile_model

        graph = plan.decode_graph if plan is not None else _quant_decode_graph(loaded)
        info = _compile_or_stay_eager(
            loaded.model,
            functools.partial(compile_model, decode_graph=graph),
            explicit=asked is not None,
        )
    model = loaded.model
    # Ticks that read packed weights (a narrow set, --quant) pay most for running layer
    # by layer; the native stack needs no compiling, so such a model gets it even
    # uncompiled (--no-compile, or the compile failed above).
    if model.narrow is not None or loaded.quant is not None:
        from tokenfleet.model.compiled import install_native_decode

        try:
            installed = install_native_decode(model)
        except RuntimeError as e:  # an optional fast path: the model still decodes eagerly
            logger.warning("the native decode stack did not start, decoding eagerly: %s", e)
            installed = False
        if installed:
            info["decode_graph"] = True
            info["decode_path"] = _decode_path(model)
    return info


def _cuda_graphs(loaded: LoadedModel, settings: WorkerSettings) -> dict[str, int] | None:
    """On CUDA, decode ticks replayed from CUDA graphs (`model/cuda_graph.py`) unless
    `TOKENFLEET_CUDA_GRAPHS=0` or `--deterministic`: what the hash says about them."""
    model = loaded.model
    if loaded.device.type != "cuda" or model.deterministic is not None:
        return None
    if os.environ.get("TOKENFLEET_CUDA_GRAPHS", "1") == "0" or model.narrow is not None:
        return None
    from tokenfleet.model.cuda_graph import install

    rows = min(settings.max_batch, settings.max_active)
    graphs = install(model, max_rows=rows, max_context=loaded.config.max_position_embeddings)
    return {"max_rows": graphs.max_rows, "max_context": graphs.max_context}


def _quant_decode_graph(loaded: LoadedModel) -> bool:
    """Whether a `--quant` worker's decode ticks run as one graph: on a CPU where the
    paged kernel builds, and not under `--deterministic` (its row tiles run eagerly)."""
    model = loaded.model
    if loaded.quant is None or loaded.device.type != "cpu" or model.deterministic is not None:
        return False
    from tokenfleet.model.attention import paged_cpu

    return paged_cpu.load()


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
    return {
        "compile_mode": report.mode,
        "compile_s": round(report.warmup_s, 2),
        # whole decode ticks in one call (model/decode_graph.py, model/native_decode.py)
        "decode_graph": getattr(model, "decode_graph", None) is not None,
        # which: "native" (the C++ layer stack), "compiled" (the graph), or why neither
        "decode_path": _decode_path(model),
    }


def _decode_path(model: Any) -> str | None:
    """What runs a whole decode tick: "native" (model/native_decode.py), "compiled" (the
    decode graph) with why the native stack does not serve this model, or None."""
    unit = getattr(model, "decode_graph", None)
    if unit is None:
        return None
    from tokenfleet.model.compiled import native_decode_wanted
    from tokenfleet.model.native_decode import NativeDecode, unsupported

    if isinstance(unit, NativeDecode):
        return "native"
    if not native_decode_wanted():
        return "compiled (TOKENFLEET_NATIVE_DECODE=0)"
    why = unsupported(model, model.narrow is not None) if model.device.type == "cpu" else None
    return f"compiled ({why})" if why else "compiled"
