"""Where a decode tick's time goes: the default start's engine (the worker's own model
set-up; with `--quant`, a worker started with it) stepped in this process with B
sessions decoding, the tick split into the matmuls and everything else.

Usage: python bench/tick_profile.py [--batches 1,8] [--ticks 40] [--threads 2]
           [--rounds 3] [--inductor 'cpp_wrapper=True,...'] [--quant int8|int4]
           [--kv-dtype auto|model|float16] [--prompt 32] [--kv-mb 256]
           [--decode native,graph]
           [--out bench/out/tick_profile.json]
           [--plot docs/img/tick_profile.png]

For each batch size B: B jobs (32 fresh prompt tokens, or `--prompt`; greedy, eos
ignored, long enough to outlast the run; the worker's KV budget, or `--kv-mb`) are
admitted and stepped until every one of them decodes. Then, in `--rounds` rounds:

  timed     `--ticks` ticks of `Engine.step`, the model's forward timed inside each
            (wall clock, no profiler): tick ms and forward ms;
  profiled  the same number of ticks under torch.profiler (CPU, no shapes), each op's
            self time summed by name and divided by the ticks.

The matmuls are the self time of the weight ops (torch's int4 / int8 packed kernels,
`mm`, `addmm`, `linear`'s dense calls); "outside the matmuls" is the timed forward minus
that (issue 25 part 2's measure: attention, norms, rope, KV writes, the compiled graph's
own code and guards), and "outside the forward" is the tick minus the forward (sampling,
scheduling, bookkeeping). The profiled ops' top entries are recorded as the profile of
what remains. The profiler's own cost lands in the profiled ticks only, never in the
timed split. The timed forward and the profiled matmuls come from different ticks, so
on a host whose speed drifts between rounds their difference drifts too: "outside the
matmuls in the profiled ticks" takes both from the same ticks (the forward's span as
the profiler saw it, less its matmuls' self time), at the cost of the profiler's own
overhead per op (small for the native stack's few ops, larger for the graph's).
`--inductor NAME=VALUE,...` sets torch._inductor.config fields before the model
compiles (to try a setting; the worker sets none of them).

`--decode native,graph` measures both ways of running a whole decode tick on the same
engine, in turn within every round (so both see the same contexts and the same host):
the native C++ stack (model/native_decode.py, the worker's default where it serves the
model) and the compiled decode graph (model/decode_graph.py); each is reported as
"B native" and "B graph".
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import random_request
from report import figure, machine_info, mark_end, outputs, parser, spread, write_json

from tokenfleet.protocol import SamplingParams

MODEL = "smollm2-135m-instruct"
FORWARD = "tick_profile::forward"  # the forward's own span in the profiled ticks
# the ops that multiply by a weight matrix (their self time is the kernel's)
MATMULS = (
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "tokenfleet::int8_linear",
    "tokenfleet::q4_linear",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--ticks", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inductor", default="", help="torch._inductor.config NAME=VALUE,...")
    p.add_argument("--quant", default=None, choices=["int8", "int4"], help="as the worker's")
    p.add_argument("--kv-dtype", default="auto", help="as the worker's: auto, model, float16")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of each job")
    p.add_argument("--kv-mb", type=int, default=256, help="the engine's KV budget, as the worker's")
    p.add_argument(
        "--decode",
        default="",
        help="native,graph: what runs whole decode ticks, each in turn within every round "
        "(the native C++ stack and the compiled decode graph); default: what the worker picks",
    )
    outputs(p, "tick_profile")
    args = p.parse_args()
    machine = machine_info()

    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile, record_function

    inductor: dict[str, Any] = {}
    for pair in filter(None, args.inductor.split(",")):
        name, value = pair.split("=", 1)
        inductor[name] = {"True": True, "False": False}.get(
            value, int(value) if value.isdigit() else value
        )
        setattr(inductor_config, name, inductor[name])

    from tokenfleet.config.worker import WorkerSettings
    from tokenfleet.worker.engine import Engine
    from tokenfleet.worker.main import engine_config, torch_model

    variants = [v for v in args.decode.split(",") if v] or ["worker"]
    if "graph" in variants:  # the worker compiles (and warms) the graph, not the stack
        os.environ["TOKENFLEET_NATIVE_DECODE"] = "0"
    settings = WorkerSettings(
        model=MODEL,
        threads=args.threads,
        quant=args.quant,
        kv_dtype=args.kv_dtype,
        kv_mb=args.kv_mb,
    )
    loaded, info, _ = torch_model(settings)
    model: Any = loaded.model
    units: dict[str, Any] = {"worker": model.decode_graph}
    if "graph" in variants:
        from tokenfleet.model.native_decode import NativeDecode

        units["graph"] = model.decode_graph
        units["native"] = NativeDecode(model, narrow=model.narrow is not None)
    elif "native" in variants:
        units["native"] = model.decode_graph
    forward_s: list[float] = []
    plain_forward = model.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with record_function(FORWARD):  # the profiled ticks' forward, inclusive
                return plain_forward(*a, **k)
        finally:
            forward_s.append(time.perf_counter() - t0)

    model.forward = timed_forward
    rng = random.Random(0)
    results: dict[str, Any] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = Engine(loaded, engine_config(settings))
        new = 64 + (args.rounds * 2 * args.ticks + 3) * len(variants)
        for _ in range(batch):
            job = random_request(f"tick-{rng.getrandbits(48):x}", args.prompt, new, rng)
            greedy = job.model_copy(update={"sampling": SamplingParams(temperature=0.0)})
            assert engine.submit(greedy).accepted
        for _ in range(200 + batch * args.prompt // 64):  # until every session decodes
            engine.step()
            live = engine.sessions.values()
            if len(live) == batch and all(len(s.emitted) >= 2 for s in live):
                break
        for _ in range(5):  # warm (the decode graph's shape for this batch)
            engine.step()
        for name in variants:  # each variant's graph warm for this batch
            model.decode_graph = units[name]
            for _ in range(3):
                engine.step()
        tick_ms: dict[str, list[float]] = defaultdict(list)
        fwd_ms: dict[str, list[float]] = defaultdict(list)
        ops: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
        same: dict[str, list[float]] = defaultdict(list)  # outside the matmuls, same ticks
        for _ in range(args.rounds):
            for name in variants:  # interleaved: each round runs every variant in turn
                model.decode_graph = units[name]
                forward_s.clear()
                t0 = time.perf_counter()
                for _ in range(args.ticks):
                    engine.step()
                tick_ms[name].append(1000 * (time.perf_counter() - t0) / args.ticks)
                fwd_ms[name].append(1000 * sum(forward_s) / args.ticks)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.ticks):
                        engine.step()
                totals: dict[str, float] = defaultdict(float)
                forward = 0.0  # the forward's span, inclusive, ms a tick
                for event in prof.key_averages():
                    totals[event.key] += event.self_cpu_time_total / 1000 / args.ticks
                    if event.key == FORWARD:
                        forward += event.cpu_time_total / 1000 / args.ticks
                same[name].append(forward - sum(totals.get(k, 0.0) for k in MATMULS))
                for key, value in totals.items():
                    ops[name][key].append(value)
        for name in variants:
            label = str(batch) if variants == ["worker"] else f"{batch} {name}"
            results[label] = _split(tick_ms[name], fwd_ms[name], ops[name], args.rounds)
            results[label]["outside_matmuls_same_ticks_ms"] = spread(same[name])
            _show(f"batch {label}", results[label])
        del engine
    report = {
        "model": MODEL,
        "decode": variants,
        "threads": args.threads,
        "ticks": args.ticks,
        "rounds": args.rounds,
        "prompt": args.prompt,
        "kv_mb": args.kv_mb,
        "inductor": inductor,
        "engine": {
            k: v for k, v in info.items() if "engine" in k or k in ("dtype", "kv_dtype", "quant")
        },
        "torch": torch.__version__,
        "batches": results,
        "machine": mark_end(machine),
    }
    write_json(Path(args.out), report)
    names = list(results)
    if not args.plot:  # --plot '': no figure
        return
    with figure(Path(args.plot), 1, 1, figsize=(2 + 1.5 * len(names), 3.5)) as ax:
        parts = ("matmul_ms", "outside_matmuls_ms", "outside_forward_ms")
        bottom = [0.0] * len(names)
        for part in parts:
            values = [results[n][part] for n in names]
            ax.bar([f"batch {n}" for n in names], values, bottom=bottom, label=part[:-3])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("ms per decode tick (medians)")
        start = f"--quant {args.quant}" if args.quant else "default start"
        ax.set_title(f"{MODEL}, {start}, {args.threads} threads")
        ax.legend(fontsize=8)


def _split(
    tick_ms: list[float], fwd_ms: list[float], ops: dict[str, list[float]], rounds: int
) -> dict[str, Any]:
    """One variant's rounds: the tick split into the matmuls, the rest of the forward and
    what is outside the forward, with the profile's top ops."""
    median_ops = {k: spread(v)["median"] for k, v in ops.items() if len(v) == rounds}
    matmul = sum(median_ops.get(k, 0.0) for k in MATMULS)
    tick, fwd = spread(tick_ms), spread(fwd_ms)
    top = sorted(median_ops.items(), key=lambda kv: -kv[1])[:20]
    return {
        "tick_ms": tick,
        "forward_ms": fwd,
        "matmul_ms": matmul,
        "outside_matmuls_ms": fwd["median"] - matmul,
        "outside_forward_ms": tick["median"] - fwd["median"],
        "profile_ms_per_tick": dict(top),
    }


def _show(label: str, r: dict[str, Any]) -> None:
    tick, fwd, matmul = r["tick_ms"], r["forward_ms"], r["matmul_ms"]
    print(
        f"{label}: tick {tick['median']:.2f} ms ({tick['min']:.2f}-{tick['max']:.2f}),"
        f" forward {fwd['median']:.2f}, matmuls {matmul:.2f},"
        f" outside the matmuls {fwd['median'] - matmul:.2f},"
        f" outside the forward {tick['median'] - fwd['median']:.2f}",
        flush=True,
    )
    if "outside_matmuls_same_ticks_ms" in r:
        same = r["outside_matmuls_same_ticks_ms"]
        print(
            f"    outside the matmuls in the profiled ticks: {same['median']:.2f} ms"
            f" ({same['min']:.2f}-{same['max']:.2f})",
            flush=True,
        )
    for name, value in list(r["profile_ms_per_tick"].items())[:12]:
        print(f"    {value:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
