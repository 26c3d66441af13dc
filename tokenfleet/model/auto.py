"""The engine a default start gets (`--dtype auto`, no `--quant`): chosen for this CPU and
this model by a short measured probe, not by a table.

What decides a CPU tick's speed is how its matmuls read the weights. A decode tick of a
few rows reads every weight once and does little arithmetic with it: fewer bytes win
(packed int4 / int8: tokenfleet's int4 x int8 and int8 x int8 kernels where the CPU has
AVX512-VNNI or AVX2, torch's weight-only kernels elsewhere). A wide tick (a prefill chunk,
many decodes) is arithmetic: the dense bf16 weights on the CPU's matrix units win (AMX
tiles on a Xeon; AVX512-BF16 elsewhere). Where those two cross depends on the CPU, so
`plan_engine` measures it: one pass over every layer's matrices and the LM head, in each
format, at 1, 2, 4, 8 and 16 rows (~1 s, the model's own weights, so the pass streams
them from memory as a tick does). The winner at one row becomes the model's *narrow*
weights (`LlamaModel.add_narrow`), used for decode ticks of up to the largest row count
where it still beats dense; every other tick runs dense.

The narrow formats offered keep the quality of the weights served: int4 only from a GGUF
file's own Q4_0 / Q4_1 blocks (the file's very values), int8 per channel otherwise (within
0.1% of the dense perplexity, docs/benchmarks.md). Then the forward is compiled, with whole
decode ticks as one graph (`decode_graph.py`) where the paged kernel builds.

A CPU without bf16 (AVX2 only) serves the model in float32, and the plan is made the
same way: tokenfleet's kernels quantize the float32 activations as they are and return
float32 (torch's, where they serve, get them rounded to bf16: `PackedWeight.matmul`). On
an AVX2 EPYC Zen 3 that took a SmolLM2 decode tick from 78 ms (dense float32, eager) to
20 ms with torch's int4 kernel, and the layers' matmuls from 14.4 to ~4 ms more with
tokenfleet's AVX2 build of its own (docs/benchmarks.md). Such a model keeps its K/V in
float16 (`EnginePlan.kv_dtype`, `LlamaModel.set_kv_dtype`): half the bytes attention reads.

Small models (under `AUTO_MIN_PARAMS`: test and toy models) start as before, dense and
eager: compiling costs seconds to minutes at start, and a second set of weights buys them
nothing anyone waits for. The probe's figures are cached per CPU, thread count, torch
version and model, under ~/.cache/tokenfleet/probe; the worker's hash carries the plan,
the reason and the figures (`tokenfleet status`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from tokenfleet.model.build import LoadedModel
from tokenfleet.model.cpu import cpu_flags
from tokenfleet.model.layers import LayerShape, Weight, linear
from tokenfleet.model.quant import (
    PackedWeight,
    QuantKind,
    int4_blocks,
    int8_vnni,
    int_kernels,
    quantize,
    resident_bytes,
)

AUTO_MIN_PARAMS = 50_000_000
PROBE_ROWS = (1, 2, 4, 8, 16)
# bump when the probe measures something else (2: int8 runs the VNNI kernel; 3: the int4
# layout, Q4_1 blocks on tokenfleet's kernel or torch's, is part of the key; 4: that
# kernel reads 16 output rows per vector; 5: so does the int8 one; 6: both kernels built for
# AVX2 too, the int8 layout part of the key)
PROBE_VERSION = 6
_PROBE_PASSES = 5


@dataclass(frozen=True)
class EnginePlan:
    """How the engine runs this model here, and why."""

    narrow: QuantKind | None  # packed weights for decode ticks of <= narrow_rows rows
    narrow_rows: int
    head_rows: int  # ... and the packed (int8) LM head for those of <= head_rows
    compile: bool
    decode_graph: bool  # whole decode ticks as one compiled graph
    why: str
    # ms of matmuls per tick (every layer and the head) by format and rows, as probed
    probe_ms: dict[str, dict[int, float]]
    probe_cached: bool = False
    kv_dtype: str | None = None  # the KV pool's dtype where not the model's ("float16")

    def as_fields(self) -> dict[str, object]:
        out = asdict(self)
        out["probe_ms"] = {k: {str(r): v for r, v in d.items()} for k, d in self.probe_ms.items()}
        return out


def plan_engine(
    loaded: LoadedModel,
    *,
    compile_asked: bool | None,
    q4: Mapping[str, PackedWeight] | None = None,
    cache_dir: Path | None = None,
    kv_dtype: str = "auto",
) -> EnginePlan:
    """The plan for a default start (see the module docstring). `q4`: a GGUF file's own
    4-bit blocks by module name (`load_model(..., q4_aside=True)`), the int4 candidate.
    `kv_dtype`: the operator's `--kv-dtype`; the plan chooses the pool's dtype only under
    `auto` (an explicit ask is the worker's to apply, and the plan's fields don't claim it)."""
    plan = _plan_weights(loaded, compile_asked=compile_asked, q4=q4, cache_dir=cache_dir)
    planned_fp32 = plan.probe_ms and loaded.dtype == torch.float32  # a float32 model on a CPU
    if kv_dtype == "auto" and planned_fp32:
        why = f"{plan.why}; {FLOAT16_KV}"
        return dataclasses.replace(plan, kv_dtype="float16", why=why)
    return plan


# A float32 model (a CPU without bf16) keeps its K/V in float16, as llama.cpp's default
# cache does: a decode tick's attention reads half the bytes, a token's KV takes half the
# budget. The rounding alone moved the fp32 model's perplexity by -0.01 to -0.02 %
# (SmolLM2, Gemma 3 270M: -0.01 %); an EPYC Zen 3's tick of 8 rows at ~1,060 keys went
# from 48-53 to 36-37 ms (docs/benchmarks.md, 2026-12-07).
FLOAT16_KV = "float16 KV cache (half the bytes of float32)"


def _plan_weights(
    loaded: LoadedModel,
    *,
    compile_asked: bool | None,
    q4: Mapping[str, PackedWeight] | None,
    cache_dir: Path | None,
) -> EnginePlan:
    """`plan_engine`'s weights and compiling."""
    model = loaded.model
    compile_ = compile_asked if compile_asked is not None else True
    params = sum(p.numel() for p in model.parameters())
    dtype = str(loaded.dtype).removeprefix("torch.")
    if loaded.device.type != "cpu" or loaded.dtype not in (torch.bfloat16, torch.float32):
        why = f"dense {dtype} on {loaded.device}: packed weights are CPU kernels"
        return EnginePlan(None, 0, 0, compile_asked is True, False, why, {})
    if params < AUTO_MIN_PARAMS:
        why = f"small model ({params / 1e6:.1f}M parameters < {AUTO_MIN_PARAMS / 1e6:.0f}M): "
        why += "dense and eager, start-up over speed"
        return EnginePlan(None, 0, 0, compile_asked is True, False, why, {})

    candidates: dict[str, Callable[[], dict[str, Weight]]] = {
        "int8": lambda: _packed(loaded, "int8")
    }
    if q4 and all(name in q4 for name in loaded.model.projection_names() if name != "lm_head"):
        candidates["int4"] = lambda: _packed(loaded, "int4", q4)
    path = _cache_path(loaded, list(candidates), cache_dir)
    probe, cached = _read(path), True
    wanted = {"dense", *candidates, "head_dense", "head_int8"}
    if probe is None or set(probe) != wanted:
        cached = False
        steady = True
        probe = {}
        for kind, make in {"dense": lambda: _dense(loaded), **candidates}.items():
            weights = make()
            head = {"lm_head": weights.pop("lm_head")}
            probe[kind], calm = _time_pass(weights, loaded.dtype)
            steady = steady and calm
            if kind in ("dense", "int8"):  # the head: one matrix, its own crossover
                probe[f"head_{kind}"], calm = _time_pass(head, loaded.dtype, weights)
                steady = steady and calm
        if steady:  # a probe that other processes disturbed is not kept
            _write(path, probe)

    dense = probe["dense"]
    best = min(candidates, key=lambda k: probe[k][1])
    rows = _crossover(probe[best], dense)
    head_rows = min(rows, _crossover(probe["head_int8"], probe["head_dense"]))
    graph = compile_ and _kernel_builds()
    how = "whole decode ticks in one call" if graph else "compiled pieces" if compile_ else "eager"
    if rows == 0:
        why = f"dense {dtype} at every row count ({best} {probe[best][1]:.1f} ms vs dense "
        why += f"{dense[1]:.1f} ms per one-row tick of layer matmuls); {how}"
        return EnginePlan(None, 0, 0, compile_, False, why, probe, cached)
    on_ours = int4_blocks() if best == "int4" else int8_vnni()
    kernel = f"tokenfleet's {int_kernels()} kernel" if on_ours else "torch's kernel"
    why = (
        f"{best} layers on {kernel} for decode ticks of <= {rows} rows ({probe[best][1]:.1f} "
        f"vs dense {dense[1]:.1f} ms of layer matmuls at one row), int8 LM head for <= {head_rows} "
        f"({probe['head_int8'][1]:.1f} vs {probe['head_dense'][1]:.1f} ms at one row), "
        f"dense {dtype} above ({probe[best][16]:.1f} vs {dense[16]:.1f} ms at 16); {how}"
    )
    narrow: QuantKind = "int4" if best == "int4" else "int8"
    return EnginePlan(narrow, rows, head_rows, compile_, graph, why, probe, cached)


def _crossover(packed: dict[int, float], dense: dict[int, float]) -> int:
    """The largest probed row count up to which `packed` is faster at every row count."""
    rows = 0
    for r in PROBE_ROWS:
        if packed[r] >= dense[r]:
            break
        rows = r
    return rows


def apply_plan(
    loaded: LoadedModel, *, compile_asked: bool | None, kv_dtype: str = "auto"
) -> tuple[LoadedModel, EnginePlan]:
    """`plan_engine` on a model loaded with `q4_aside=True`, its narrow weights added:
    the model (its `weight_bytes` counting both weight sets, the aside blocks dropped)
    and the plan. Compiling, where the plan says so, is the caller's
    (`compiled.compile_model(..., decode_graph=plan.decode_graph)`)."""
    plan = plan_engine(loaded, compile_asked=compile_asked, q4=loaded.q4_blocks, kv_dtype=kv_dtype)
    if plan.narrow is not None:
        loaded.model.add_narrow(plan.narrow, plan.narrow_rows, loaded.q4_blocks, plan.head_rows)
    if plan.kv_dtype is not None:
        loaded.model.set_kv_dtype(getattr(torch, plan.kv_dtype))
    weight_bytes = resident_bytes(loaded.model)
    return dataclasses.replace(loaded, q4_blocks=None, weight_bytes=weight_bytes), plan


def _kernel_builds() -> bool:
    from tokenfleet.model.attention import paged_cpu

    return paged_cpu.load()


def _matrix(loaded: LoadedModel, name: str) -> Tensor:
    weight = loaded.model.get_submodule(name).weight
    assert isinstance(weight, Tensor)
    return weight


def _dense(loaded: LoadedModel) -> dict[str, Weight]:
    return {name: _matrix(loaded, name) for name in loaded.model.projection_names()}


def _packed(
    loaded: LoadedModel, kind: QuantKind, given: Mapping[str, PackedWeight] | None = None
) -> dict[str, Weight]:
    out: dict[str, Weight] = {}
    for name in loaded.model.projection_names():
        if given and name in given:
            out[name] = given[name]
        else:  # the head is kept int8 whatever the layers are (`LlamaModel.add_narrow`)
            out[name] = quantize(_matrix(loaded, name), "int8" if name == "lm_head" else kind)
    return out


def _time_pass(
    weights: dict[str, Weight], dtype: torch.dtype, between: dict[str, Weight] | None = None
) -> tuple[dict[int, float], bool]:
    """The fastest of 5 passes over every matrix (after a warm one), ms per row count,
    and whether the passes agreed (within 1.5x: nothing else took the cores). Each pass
    runs every row count once, so a burst of other work spoils one pass of each count
    rather than every pass of one count (which once moved a crossover from 16 rows to
    8 on a shared EPYC Zen 4). `between`: matrices run (untimed, one row) before each
    timed pass, as a tick runs the layers before its head: timed alone, the LM head
    stayed in a large L3 (the Xeon AMX VM) and its dense bf16 form read 2.1 ms at 8 rows
    where a real tick spent 4.4."""
    shape = LayerShape(1, 1, 1, 1, 1e-5)  # plain matmuls: no row tiles
    inputs: dict[tuple[int, int], Tensor] = {}
    times: dict[int, list[float]] = {rows: [] for rows in PROBE_ROWS}

    def run(ws: dict[str, Weight], rows: int) -> None:
        for w in ws.values():
            width = w.in_features if isinstance(w, PackedWeight) else w.shape[1]
            x = inputs.get((rows, width))
            if x is None:
                x = inputs[(rows, width)] = torch.randn(rows, width, dtype=dtype)
            linear(x, w, None, shape)

    with torch.inference_mode():
        for n in range(_PROBE_PASSES + 1):
            for rows in PROBE_ROWS:
                if between:
                    run(between, 1)
                started = time.perf_counter()
                run(weights, rows)
                if n:  # the first pass warms
                    times[rows].append(time.perf_counter() - started)
    out = {rows: round(min(t) * 1000, 3) for rows, t in times.items()}
    calm = all(max(t) < 1.5 * min(t) for t in times.values())
    return out, calm


def _cache_path(loaded: LoadedModel, kinds: list[str], cache_dir: Path | None) -> Path:
    h = hashlib.blake2b(digest_size=10)
    for part in (
        PROBE_VERSION,
        platform.processor(),
        sorted(cpu_flags()),
        torch.__version__,
        torch.get_num_threads(),
        repr(loaded.config),
        loaded.source_quant,
        sorted(kinds),
        int4_blocks(),
        int8_vnni(),
    ):
        h.update(repr(part).encode())
    root = cache_dir or Path(
        os.environ.get("TOKENFLEET_PROBE_DIR", Path.home() / ".cache" / "tokenfleet" / "probe")
    )
    return root / f"{h.hexdigest()}.json"


def _read(path: Path) -> dict[str, dict[int, float]] | None:
    try:
        raw = json.loads(path.read_text())
        return {k: {int(r): float(v) for r, v in d.items()} for k, d in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _write(path: Path, probe: dict[str, dict[int, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(probe))
        tmp.replace(path)
    except OSError:  # a read-only home: the next start probes again
        pass
