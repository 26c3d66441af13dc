"""`tokenfleet worker`: parse the flags, build the worker (`tokenfleet.worker.main`), run it."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tokenfleet.cli.common import Prefix, RedisUrl, fail, settings
from tokenfleet.errors import TokenfleetError

MiB = 1024 * 1024


def worker(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="preset (tiny-random) or checkpoint folder "
            "(default: $TOKENFLEET_MODEL or tiny-random)",
        ),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option("--model-name", help="jobs naming this model are served (default stream)"),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda or auto (default: $TOKENFLEET_DEVICE or auto)")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="auto (bfloat16 where the hardware has it), float32, bfloat16 or float16 "
            "(default: $TOKENFLEET_DTYPE or auto)"
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(help="int8 or int4: keep the weights quantized (CPU); none: dense"),
    ] = None,
    compile_: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="compile the forward's row-wise parts at start (default: "
            "$TOKENFLEET_COMPILE, else only with --quant)",
        ),
    ] = None,
    prefix_cache: Annotated[
        bool | None,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="share full KV blocks between jobs with the same prefix (default: "
            "$TOKENFLEET_PREFIX_CACHE, else on)",
        ),
    ] = None,
    kv_mb: Annotated[int, typer.Option("--kv-mb", help="KV cache budget, MiB")] = 256,
    max_batch: Annotated[int, typer.Option("--max-batch", help="decode sessions per tick")] = 32,
    max_active: Annotated[int, typer.Option("--max-active", help="sessions holding KV")] = 64,
    prefill_tokens: Annotated[
        int, typer.Option("--prefill-tokens", help="prefill tokens per tick")
    ] = 256,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="local waiting list")] = 4,
    band_share: Annotated[
        float,
        typer.Option(
            "--band-share",
            help="each lower priority band's least share of the tokens this worker "
            "generates while it has jobs here",
        ),
    ] = 1 / 16,
    hold_s: Annotated[
        float,
        typer.Option(
            "--hold-s",
            help="a job waiting here this long without starting goes back to its stream",
        ),
    ] = 10.0,
    name: Annotated[str | None, typer.Option("--name", help="worker name (unique)")] = None,
    burst: Annotated[
        bool, typer.Option("--burst", help="exit 0 once the stream is empty and nothing runs")
    ] = False,
    max_deliveries: Annotated[int, typer.Option("--max-deliveries")] = 3,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="seconds")] = 30.0,
    overlap: Annotated[
        bool,
        typer.Option(
            "--overlap/--no-overlap",
            help="read each tick's Redis replies after the next forward pass (default)",
        ),
    ] = True,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads")] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="serve Prometheus metrics on this port")
    ] = None,
    fault_key: Annotated[
        str | None,
        typer.Option(
            "--inject-fault-on-metadata",
            hidden=True,
            help="tests only: fail the forward of jobs whose metadata has this key",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Serve jobs from the fleet's stream with one continuous-batching engine."""
    import signal

    # A signal while torch and the model load: nothing is held yet, so leave cleanly.
    # The worker's own drain-then-stop handlers replace this once it runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    import logging

    from tokenfleet.worker.bands import FairnessConfig
    from tokenfleet.worker.engine import EngineConfig
    from tokenfleet.worker.loop import WorkerOptions, default_worker_name
    from tokenfleet.worker.main import build_worker

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    conf = settings(redis_url, prefix)
    try:
        fairness = FairnessConfig(band_share=band_share, hold_s=hold_s)
    except ValueError as exc:
        raise fail(str(exc)) from None
    engine = EngineConfig(
        kv_budget_bytes=kv_mb * MiB,
        max_active=max_active,
        max_batch_size=max_batch,
        max_prefill_tokens_per_tick=prefill_tokens,
        max_waiting=max_waiting,
        prefix_cache=conf.prefix_cache if prefix_cache is None else prefix_cache,
        fairness=fairness,
    )
    options = WorkerOptions(
        name=name or default_worker_name(),
        model=model_name,
        burst=burst,
        max_deliveries=max_deliveries,
        drain_timeout_s=drain_timeout,
        overlap=overlap,
    )
    try:
        runner = build_worker(
            conf,
            checkpoint=model,
            device=device,
            dtype=dtype,
            quant=quant,
            compile_model=compile_,
            engine=engine,
            options=options,
            threads=threads,
            metrics_port=metrics_port,
            fault_key=fault_key,
        )
    except TokenfleetError as exc:
        raise fail(str(exc)) from None
    runner.install_signal_handlers()
    raise typer.Exit(code=runner.run())
