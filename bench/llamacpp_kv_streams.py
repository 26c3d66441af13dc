"""What one unified pool of KV cells costs llama.cpp's decode against a stream per sequence.

Usage: python bench/llamacpp_kv_streams.py [--rounds 3] [--prompt 32]
           [--out bench/out/llamacpp_kv_streams.json]

The llama.cpp runner (`--runner llamacpp`) gives llama.cpp one pool of cells for every
session (`kv_unified`), as the scheduler has one pool of blocks; llama-server gives each
slot a stream of its own (`kv_unified = false` with `-np N` here). With one pool, every
row's attention walks all the sessions' cells (the others' masked). This times it
directly on llama-cpp-python's low-level API, SmolLM2-135M-Instruct Q4_1, 2 threads:
8 sequences x 32 prompt tokens (--prompt), then 96 decode ticks of 8 rows, in four
contexts per round (interleaved): unified with the runner's default budget (11,648
cells, 256 MiB), unified with 2,048 cells, 8 streams of 256 cells (of as many as the
prompt and the ticks need, rounded up to 256: `--kv-streams 8`), and unified with 9,216
of the 11,648 cells held by 18 other sequences (what finished sequences kept for their
cached prefixes would hold). The contexts too small for the prompt are left out. Prints
ms per 8-row tick (median, min, max over rounds), writes the JSON and a PNG.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from llama_cpp import llama_cpp as lib
from report import machine_info

from tokenfleet.model.smollm2 import require_smollm2_gguf

SEQS, TICKS = 8, 96
KEPT_SEQ = 512  # tokens of each kept sequence (ids from SEQS up)
CHUNK = 512  # tokens per llama_decode while prefilling


def contexts(prompt: int) -> dict[str, tuple[bool, int, int]]:
    """label: (kv_unified, cells, cells other sequences hold meanwhile), for prompts of
    `prompt` tokens (those that cannot hold 8 of them left out)."""
    stream = -(-(prompt + TICKS) // 256) * 256
    out = {
        "unified, 11648 cells": (True, 11648, 0),
        "unified, 2048 cells": (True, 2048, 0),
        f"8 streams x {stream} cells": (False, 8 * stream, 0),
        # the pool mostly held by finished sequences kept for their cached prefixes (the
        # runner's prefix sharing): every row's attention walks the range they occupy
        "unified, 11648 cells, 9216 kept": (True, 11648, 9216),
    }
    need = SEQS * (prompt + TICKS)
    return {k: v for k, v in out.items() if v[1] - v[2] >= need}


def tick_ms(model: Any, unified: bool, cells: int, kept: int = 0, prompt: int = 32) -> float:
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = cells, 512, 512
    cp.n_seq_max = SEQS + kept // KEPT_SEQ  # llama_decode takes ids below it
    cp.n_threads = cp.n_threads_batch = 2
    cp.kv_unified, cp.no_perf = unified, True
    ctx = lib.llama_init_from_model(model, cp)
    batch = lib.llama_batch_init(CHUNK, 0, 1)
    rng = random.Random(1)

    def decode(rows: list[tuple[int, int, int, int]]) -> None:
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        for k in range(kept // KEPT_SEQ):  # first, so that they take the low cells
            decode([(rng.randrange(100, 40000), p, SEQS + k, 0) for p in range(KEPT_SEQ)])
        rows = [
            (rng.randrange(100, 40000), p, s, int(p == prompt - 1))
            for s in range(SEQS)
            for p in range(prompt)
        ]
        for at in range(0, len(rows), CHUNK):
            decode(rows[at : at + CHUNK])
        start = time.perf_counter()
        for k in range(TICKS):
            decode([(rng.randrange(100, 40000), prompt + k, s, 1) for s in range(SEQS)])
        return 1000 * (time.perf_counter() - start) / TICKS
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--out", default="bench/out/llamacpp_kv_streams.json")
    args = p.parse_args()
    lib.llama_backend_init()
    quiet = lib.llama_log_callback(lambda *_: None)  # kept referenced: C holds it
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    model = lib.llama_model_load_from_file(
        str(require_smollm2_gguf()).encode(), lib.llama_model_default_params()
    )
    table = contexts(args.prompt)
    runs: dict[str, list[float]] = {label: [] for label in table}
    for rnd in range(args.rounds):
        for label, (unified, cells, kept) in table.items():
            runs[label].append(tick_ms(model, unified, cells, kept, args.prompt))
            print(f"round {rnd + 1}: {label}: {runs[label][-1]:.1f} ms per 8-row tick")
    summary = {
        label: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for label, v in runs.items()
    }
    for label, s in summary.items():
        print(f"{label}: {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    facts = {"prompt": args.prompt, "seqs": SEQS, "ticks": TICKS, "machine": machine_info()}
    out.write_text(json.dumps({**facts, "runs": runs, "summary": summary}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(list(summary), [s["median"] for s in summary.values()])
    ax.set_ylabel("ms per 8-row decode tick")
    ax.set_title(f"8 sequences of {args.prompt} prompt tokens", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))


if __name__ == "__main__":
    main()
