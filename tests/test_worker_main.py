"""`build_worker` (tokenfleet/worker/main.py) without the command line, on a real Redis.

It builds what its `WorkerSettings` say: a value given wins, one not given is read
from the environment (`$TOKENFLEET_MODEL`, `$TOKENFLEET_DEVICE`, `$TOKENFLEET_DTYPE`)
or defaults; the engine's budget and the loop's options come from the same settings,
and the worker it returns serves jobs from the fleet they name. The command line
gives them the same way (`tokenfleet worker --help` lists each field's flag).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tokenfleet.config import WorkerSettings
from tokenfleet.errors import JobFailed, ModelLoadError
from tokenfleet.keys import Keys
from tokenfleet.model import load_model
from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.cpu import cpu_has_bf16
from tokenfleet.producer import Producer
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.bands import FairnessConfig
from tokenfleet.worker.engine import EngineConfig
from tokenfleet.worker.main import InvalidBudget, build_worker

MiB = 1024 * 1024
PREFIX = "wm:"


def fleet_settings(redis_url: str, **fields: Any) -> WorkerSettings:
    """What `tokenfleet worker --redis-url URL --prefix wm: [FIELD flags]` builds."""
    return WorkerSettings(redis_url=redis_url, prefix=PREFIX, **fields)


def test_settings_from_the_environment_choose_model_device_and_dtype(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TOKENFLEET_PREFIX", PREFIX)
    monkeypatch.setenv("TOKENFLEET_MODEL", "tiny-random")
    monkeypatch.setenv("TOKENFLEET_DEVICE", "cpu")
    monkeypatch.setenv("TOKENFLEET_DTYPE", "bfloat16")
    worker = build_worker(WorkerSettings(name="wm-env", burst=True))

    assert worker.options.info["checkpoint"] == "tiny-random"
    assert worker.options.info["device"] == "cpu"
    assert worker.options.info["dtype"] == "bfloat16"
    assert worker.options.info["model"] == "default"  # no --model-name: the default stream
    assert worker.engine.config == EngineConfig()
    assert worker.engine.fault is None
    assert worker.keys == Keys(PREFIX)
    client = worker.queue.redis.connection_pool.connection_kwargs
    assert (client["port"], client["socket_timeout"]) == (urlsplit(redis_url).port, 10)


def test_the_model_setting_is_what_loads_and_a_bad_one_is_named(redis_url: str) -> None:
    conf = fleet_settings(redis_url, model="/no/such/checkpoint", device="cpu")
    with pytest.raises(ModelLoadError, match="'/no/such/checkpoint' is neither a preset"):
        build_worker(conf)
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        build_worker(fleet_settings(redis_url, model="tiny-random", dtype="int8"))


def test_given_values_win_over_the_environment_and_the_worker_serves_its_stream(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFLEET_MODEL", "/no/such/checkpoint")
    monkeypatch.setenv("TOKENFLEET_DEVICE", "cuda:7")
    monkeypatch.setenv("TOKENFLEET_DTYPE", "int8")
    monkeypatch.setenv("TOKENFLEET_PREFIX_CACHE", "0")
    conf = fleet_settings(
        redis_url,
        model="tiny-random",
        device="cpu",
        dtype="float32",
        kv_mb=2,
        max_active=3,
        max_batch=2,
        prefill_tokens=64,
        max_waiting=1,
        band_share=0.25,
        name="wm-flags",
        model_name="small",
        burst=True,
        max_deliveries=1,
        fault_key="poison",
    )
    worker = build_worker(conf)

    engine = EngineConfig(
        kv_budget_bytes=2 * MiB,
        max_active=3,
        max_batch_size=2,
        max_prefill_tokens_per_tick=64,
        max_waiting=1,
        prefix_cache=False,  # from the environment: nothing gave it
        fairness=FairnessConfig(band_share=0.25),
    )
    assert worker.engine.config == engine
    assert (worker.options.burst, worker.options.max_deliveries) == (True, 1)
    assert worker.engine.budget.kv_budget_bytes == 2 * MiB
    assert worker.engine.budget.max_active == 3
    info = worker.options.info
    assert (info["checkpoint"], info["device"], info["dtype"]) == ("tiny-random", "cpu", "float32")
    assert (info["model"], worker.options.name, worker.engine.worker) == (
        "small",
        "wm-flags",
        "wm-flags",
    )

    producer = Producer.from_url(redis_url, prefix=PREFIX)
    good = producer.submit(prompt="hello", max_new_tokens=5, model="small", ignore_eos=True)
    bad = producer.submit(prompt="bad", max_new_tokens=5, model="small", metadata={"poison": 1})
    assert worker.run() == 0  # burst: the stream is empty and nothing runs

    result = good.result(timeout=10)
    assert result.finish_reason == FinishReason.LENGTH
    assert (result.usage.completion_tokens, result.worker) == (5, "wm-flags")
    with pytest.raises(JobFailed, match="injected fault"):
        bad.result(timeout=10)


def test_a_budget_that_does_not_fit_the_model_is_an_invalid_budget(redis_url: str) -> None:
    with pytest.raises(InvalidBudget, match=r"^invalid budget: kv_budget_bytes"):
        build_worker(fleet_settings(redis_url, device="cpu", kv_mb=0))
    with pytest.raises(InvalidBudget, match=r"^band_share must be in \(0, 1\)"):
        build_worker(fleet_settings(redis_url, model="/not/loaded", band_share=2.0))


def test_quantized_weights_are_compiled_by_default_and_serve_jobs(redis_url: str) -> None:
    worker = build_worker(
        fleet_settings(
            redis_url,
            model="tiny-random",
            device="cpu",
            quant="int8",
            name="wm-int8",
            model_name="int8",
            burst=True,
        )
    )
    info = worker.options.info
    # auto: bf16 where the CPU computes it, else float32 (the packed kernels take either)
    assert (info["quant"], info["dtype"]) == ("int8", "bfloat16" if cpu_has_bf16() else "float32")
    assert info["compile_mode"] == "default" and info["compile_s"] > 0  # unset: on with quant
    # every tick runs the packed weights: decode ticks as one graph, where the kernel builds
    assert info["decode_graph"] is paged_cpu.load()
    assert worker.engine.runner.spec.weight_bytes < load_model("tiny-random").weight_bytes
    producer = Producer.from_url(redis_url, prefix=PREFIX)
    job = producer.submit(prompt="hello", max_new_tokens=6, model="int8", ignore_eos=True)
    assert worker.run() == 0
    assert job.result(timeout=10).usage.completion_tokens == 6


FALLBACK = """
import json, sys
from tokenfleet.config import WorkerSettings
from tokenfleet.worker.main import build_worker
from tokenfleet.errors import ModelLoadError
explicit = {"auto": None, "on": True}[sys.argv[2]]
settings = WorkerSettings(redis_url=sys.argv[1], prefix="wm:", model="tiny-random",
                          device="cpu", quant="int8", compile=explicit, name="wm-cc", burst=True)
try:
    w = build_worker(settings)
    print(json.dumps({k: w.options.info.get(k) for k in ("compile_mode", "compile_error")}))
except ModelLoadError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.parametrize("asked", ["auto", "on"])
def test_without_a_cxx_compiler_auto_compile_serves_eagerly(
    redis_url: str, asked: str, tmp_path: Path
) -> None:
    """No C++ compiler for inductor (a slim image): a worker that compiles by default
    serves eagerly and says why; one started with --compile fails at start, by name."""
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),  # nothing cached to reuse
    }
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK, redis_url, asked],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if asked == "auto":
        assert got["compile_mode"] is None and got["compile_error"], got
    else:
        assert got["error"].startswith("--compile failed"), got


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to govern")
def test_unpinned_threads_are_governed_and_reported_pinned_ones_are_kept(
    redis_url: str,
) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        worker = build_worker(
            fleet_settings(
                redis_url,
                model="tiny-random",
                device="cpu",
                dtype="float32",
                name="wm-gov",
                model_name="gov",
                burst=True,
            )
        )
        assert worker.engine.threads is not None and worker.engine.threads.max_threads == 2
        producer = Producer.from_url(redis_url, prefix=PREFIX)
        job = producer.submit(prompt="hello", max_new_tokens=4, model="gov", ignore_eos=True)
        assert worker.run() == 0
        assert job.result(timeout=10).usage.completion_tokens == 4
        telemetry = worker.engine.telemetry()  # what the heartbeat writes to the hash
        assert telemetry["threads_max"] == 2 and telemetry["threads"] in (1, 2)

        pinned = build_worker(
            fleet_settings(
                redis_url,
                model="tiny-random",
                device="cpu",
                dtype="float32",
                threads=1,
                name="wm-pinned",
                burst=True,
            )
        )
        assert pinned.engine.threads is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ---- the command line: flags from the same settings -----------------------------------


def test_worker_flags_given_win_and_the_environment_fills_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import typer
    from typer.testing import CliRunner

    from tokenfleet.cli.options import settings_command

    seen: list[WorkerSettings] = []

    @settings_command(WorkerSettings)
    def worker(settings: WorkerSettings) -> None:
        seen.append(settings)

    app = typer.Typer()
    app.command()(worker)
    env = {"TOKENFLEET_MODEL": "/from/env", "TOKENFLEET_DEVICE": "cuda:3"}
    env |= {"TOKENFLEET_PREFIX_CACHE": "0", "TOKENFLEET_PREFIX": "env:"}
    flags = ["--model", "tiny-random", "--kv-mb", "8", "--no-overlap", "-v", "--max-batch", "32"]
    result = CliRunner().invoke(app, flags, env=env)
    assert result.exit_code == 0, result.output
    [got] = seen
    assert (got.model, got.kv_mb, got.overlap, got.verbose) == ("tiny-random", 8, False, True)
    assert (got.device, got.prefix_cache, got.prefix) == ("cuda:3", False, "env:")
    assert (got.max_batch, got.max_active, got.dtype) == (32, 64, "auto")  # defaults
    assert got.model_fields_set >= {"model", "kv_mb", "max_batch", "device", "prefix_cache"}
    assert "max_active" not in got.model_fields_set  # not given: not passed on

    refused = CliRunner().invoke(app, ["--prefix", ""], env=env)
    assert refused.exit_code == 2
    assert "--prefix: String should have at least 1 character" in refused.output


def test_worker_help_shows_each_settings_default_and_variable() -> None:
    from typer.testing import CliRunner

    from tokenfleet.cli import app

    out = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "250"}).output
    for line in (
        "--kv-mb",
        "KV cache budget, MiB [default: 256]",
        "[default: 0.0625]",
        "($TOKENFLEET_PREFIX_CACHE)",
        "($TOKENFLEET_MODEL) [default: tiny-random]",
        "($TOKENFLEET_REDIS_URL or $REDIS_URL) [default: redis://127.0.0.1:6379/0]",
    ):
        assert line in out, line
    assert "--inject-fault-on-metadata" not in out  # hidden: tests only


def test_the_prefix_cache_is_on_by_default_except_on_the_llama_cpp_runner() -> None:
    """Unset, the torch runner shares prefixes and the llama.cpp runner does not (its kept
    cells slow every decode of jobs that share nothing: docs/operations.md); the flag,
    given, wins on both."""
    from tokenfleet.worker.main import engine_config

    for runner, default in (("torch", True), ("llamacpp", False), ("sim", True)):
        assert engine_config(WorkerSettings(runner=runner)).prefix_cache is default, runner
        for given in (True, False):
            settings = WorkerSettings(runner=runner, prefix_cache=given)
            assert engine_config(settings).prefix_cache is given, (runner, given)


def test_kv_streams_cap_active_jobs_and_refuse_what_they_cannot_serve() -> None:
    """--kv-streams N (the llama.cpp runner's llama-server layout) lowers --max-active
    to N (a stream per active job) and keeps a smaller one; it is refused, named, with
    --prefix-cache (cells are lent within one pool) and on another runner."""
    from tokenfleet.worker.main import InvalidBudget, engine_config

    assert engine_config(WorkerSettings(runner="llamacpp", kv_streams=8)).max_active == 8
    assert engine_config(WorkerSettings(runner="llamacpp", kv_streams=0)).max_active == 64
    small = WorkerSettings(runner="llamacpp", kv_streams=8, max_active=4)
    assert engine_config(small).max_active == 4
    with pytest.raises(InvalidBudget, match="drop --prefix-cache"):
        engine_config(WorkerSettings(runner="llamacpp", kv_streams=8, prefix_cache=True))
    with pytest.raises(InvalidBudget, match=r"llama\.cpp runner's KV layout"):
        engine_config(WorkerSettings(runner="torch", kv_streams=8))
