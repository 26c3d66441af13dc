"""`tokenfleet worker`'s settings: the model it serves, its engine's budget, its loop.

`tokenfleet.worker.main.build_worker` turns them into a running worker (the engine's
`EngineConfig` and `FairnessConfig`, the loop's `WorkerOptions`, which validate what is
theirs). Only the model's settings and `prefix_cache` are read from the environment
(docs/operations.md); the rest are flags.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tokenfleet.config.common import Env, Flag, Settings

RUNNERS = ("torch", "llamacpp", "sim")  # what runs the model: tokenfleet.worker.main.build_worker
KV_DTYPES = ("auto", "model", "float16")  # what the KV pool holds: LlamaModel.set_kv_dtype
_CHOICES = {"runner": RUNNERS, "kv_dtype": KV_DTYPES}  # the fields that take one of a list


class WorkerSettings(Settings):
    """One worker process."""

    # ---- the model -----------------------------------------------------------------
    model: Annotated[
        str,
        Env("TOKENFLEET_MODEL"),
        Flag("--model"),
        Field(description="preset (tiny-random) or checkpoint folder"),
    ] = "tiny-random"
    model_name: Annotated[
        str | None,
        Flag("--model-name"),
        Field(description="jobs naming this model are served (none: the default stream)"),
    ] = None
    device: Annotated[
        str,
        Env("TOKENFLEET_DEVICE"),
        Flag("--device"),
        Field(description="cpu, cuda, cuda:N or auto (cuda where available)"),
    ] = "auto"
    dtype: Annotated[
        str,
        Env("TOKENFLEET_DTYPE"),
        Flag("--dtype"),
        Field(
            description="auto (bfloat16 where the hardware has it), float32, bfloat16 or float16"
        ),
    ] = "auto"
    kv_dtype: Annotated[
        str,
        Env("TOKENFLEET_KV_DTYPE"),
        Flag("--kv-dtype"),
        Field(
            description="what the KV pool holds: auto (as the engine plan of a default "
            "start decides: float16 under a float32 model on the CPU; else the model's "
            "dtype), model (the model's dtype), float16 (a float32 model on the CPU)"
        ),
    ] = "auto"
    quant: Annotated[
        str | None,
        Env("TOKENFLEET_QUANT"),
        Flag("--quant"),
        Field(description="int8 or int4: keep the weights quantized (CPU); none: dense"),
    ] = None
    compile: Annotated[
        bool | None,
        Env("TOKENFLEET_COMPILE"),
        Flag("--compile/--no-compile"),
        Field(
            description="compile the forward at start; unset: as the engine plan of a "
            "default start decides (docs/operations.md), or on with --quant"
        ),
    ] = None
    deterministic: Annotated[
        bool,
        Env("TOKENFLEET_DETERMINISTIC"),
        Flag("--deterministic/--no-deterministic"),
        Field(
            description="batch-invariant numerics: a job's tokens do not depend on what "
            "runs beside it, the prefix cache or a resume (bf16 / int8; checked at start, "
            "docs/operations.md)"
        ),
    ] = False

    runner: Annotated[
        str,
        Env("TOKENFLEET_RUNNER"),
        Flag("--runner"),
        Field(
            description="torch: run the model; llamacpp: run a .gguf file on llama.cpp's "
            "kernels (needs the llamacpp extra: make llamacpp); sim: no model, ticks paced "
            "like a GPU's (tokenfleet/model/sim_runner.py; for load tests of the fleet)"
        ),
    ] = "torch"
    sim_tok_s: Annotated[
        float,
        Flag("--sim-tok-s"),
        Field(gt=0, description="sim runner: tokens/s at a full batch (a row costs 1/this)"),
    ] = 3000.0
    sim_tick_ms: Annotated[
        float,
        Flag("--sim-tick-ms"),
        Field(ge=0, description="sim runner: the least time of a tick, ms"),
    ] = 15.0

    # ---- the engine's budget (EngineConfig, FairnessConfig) ------------------------
    prefix_cache: Annotated[
        bool | None,
        Env("TOKENFLEET_PREFIX_CACHE"),
        Flag("--prefix-cache/--no-prefix-cache"),
        Field(
            description="share full KV blocks between jobs with the same prefix; unset: "
            "on, except on --runner llamacpp, where the cells it keeps slow every decode "
            "of jobs that share nothing (docs/operations.md)"
        ),
    ] = None
    kv_mb: Annotated[int, Flag("--kv-mb"), Field(description="KV cache budget, MiB")] = 256
    kv_streams: Annotated[
        int,
        Env("TOKENFLEET_KV_STREAMS"),
        Flag("--kv-streams"),
        Field(
            ge=0,
            le=256,
            description="--runner llamacpp: 0, one pool of KV cells for every job; N, "
            "llama-server's layout (-np N): N jobs at most, each in a stream of its own "
            "of 1/N of the cells (a job's prompt + max_tokens must fit it), faster "
            "decodes of many jobs at once; not with --prefix-cache (docs/operations.md)",
        ),
    ] = 0
    max_batch: Annotated[
        int, Flag("--max-batch"), Field(description="decode sessions per tick")
    ] = 32
    max_active: Annotated[int, Flag("--max-active"), Field(description="sessions holding KV")] = 64
    prefill_tokens: Annotated[
        int, Flag("--prefill-tokens"), Field(description="prefill tokens per tick")
    ] = 256
    max_waiting: Annotated[int, Flag("--max-waiting"), Field(description="local waiting list")] = 4
    band_share: Annotated[
        float,
        Flag("--band-share"),
        Field(
            description="each lower priority band's least share of the tokens this worker "
            "generates while it has jobs here"
        ),
    ] = 1 / 16
    hold_s: Annotated[
        float,
        Flag("--hold-s"),
        Field(description="a job waiting here this long without starting goes back to its stream"),
    ] = 10.0

    # ---- the loop (WorkerOptions) and the process ----------------------------------
    name: Annotated[
        str | None, Flag("--name"), Field(description="worker name (unique; none: generated)")
    ] = None
    burst: Annotated[
        bool,
        Flag("--burst"),
        Field(description="exit 0 once the stream is empty and nothing runs"),
    ] = False
    max_deliveries: Annotated[
        int,
        Flag("--max-deliveries"),
        Field(description="a job delivered more often goes to the dead letters"),
    ] = 3
    drain_timeout: Annotated[
        float,
        Flag("--drain-timeout"),
        Field(description="seconds the jobs in flight get to finish after a SIGTERM"),
    ] = 30.0
    overlap: Annotated[
        bool,
        Flag("--overlap/--no-overlap"),
        Field(description="read each tick's Redis replies after the next forward pass"),
    ] = True
    stream_interval: Annotated[
        int,
        Env("TOKENFLEET_STREAM_INTERVAL"),
        Flag("--stream-interval"),
        Field(
            description="send a job's tokens every N ticks, coalesced into one replay entry "
            "and one message (its first token and its end at once): less Redis work per "
            "token, up to N-1 ticks later",
            ge=1,
            le=64,
        ),
    ] = 1
    stream_interval_ms: Annotated[
        float | None,
        Env("TOKENFLEET_STREAM_INTERVAL_MS"),
        Flag("--stream-interval-ms"),
        Field(
            description="instead of --stream-interval: send a job's held tokens once this "
            "many ms passed since the last send (and at least every 64 ticks), coalesced as "
            "--stream-interval does: fast ticks share a send, a tick slower than this sends "
            "every time; at steady ticks a token waits less than this",
            gt=0,
            le=10_000,
        ),
    ] = None
    wait_replicas: Annotated[
        int,
        Env("TOKENFLEET_WAIT_REPLICAS"),
        Flag("--wait-replicas"),
        Field(
            description="durable mode, for a Redis with replicas: clients see a token only "
            "once this many replicas acknowledged it (WAIT after each tick), so a failover "
            "never takes back a token a client saw; 0: off",
            ge=0,
            le=16,
        ),
    ] = 0
    wait_timeout_ms: Annotated[
        int,
        Env("TOKENFLEET_WAIT_TIMEOUT_MS"),
        Flag("--wait-timeout-ms"),
        Field(description="durable mode: how long a tick's WAIT waits for the replicas", ge=1),
    ] = 100
    threads: Annotated[
        int | None,
        Flag("--threads"),
        Field(
            description="CPU threads (torch's, or llama.cpp's on --runner llamacpp), kept; "
            "none: fitted to the cores left free"
        ),
    ] = None
    metrics_port: Annotated[
        int | None, Flag("--metrics-port"), Field(description="serve Prometheus metrics here")
    ] = None
    fault_key: Annotated[
        str | None,
        Flag("--inject-fault-on-metadata", hidden=True),
        Field(description="tests only: fail the forward of jobs whose metadata has this key"),
    ] = None
    verbose: Annotated[bool, Flag("--verbose", "-v"), Field(description="log at INFO")] = False

    @model_validator(mode="after")
    def _one_interval(self) -> WorkerSettings:
        if self.stream_interval_ms is not None and self.stream_interval != 1:
            raise ValueError(
                "give --stream-interval (ticks) or --stream-interval-ms (a time), not both"
            )
        return self

    @field_validator("runner", "kv_dtype")
    @classmethod
    def _one_of_the_choices(cls, value: str, info: ValidationInfo) -> str:
        name = str(info.field_name)
        if value not in _CHOICES[name]:
            raise ValueError(f"{name} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
        return value

    @field_validator("quant")
    @classmethod
    def _none_is_dense(cls, quant: str | None) -> str | None:
        return None if quant in (None, "", "none") else quant
