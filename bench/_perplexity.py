"""Perplexity scored the way `llama-perplexity -c CTX` scores it, for tokenfleet's models
(bench/vs_llamacpp.py compares it with llama.cpp's own tool on the same text and ids)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from tokenfleet.model import LoadedModel
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.llama import LlamaModel
from tokenfleet.model.smollm2 import require_smollm2_gguf
from tokenfleet.model.tick_inputs import SeqInput


def our_perplexity(
    loaded: LoadedModel, tokens: list[int], ctx: int, chunks: int | None, bos: int | None
) -> dict[str, Any]:
    """Perplexity as llama-perplexity computes it (tools/perplexity/perplexity.cpp):
    windows tokens[i*ctx : (i+1)*ctx] for i < len(tokens) // ctx (or `chunks`), each on an
    empty cache, its first token replaced by BOS when the vocab adds one (`bos`); only the
    second half is scored: the logits at positions ctx/2 .. ctx-2 against the next tokens,
    ctx/2 - 1 per window; PPL = exp(mean NLL), +/- as llama.cpp's. The logits come from
    `window_logits`."""
    model = loaded.model
    block = 16
    blocks = -(-ctx // block)
    pool = model.new_kv_pool(blocks, block)
    table = list(range(blocks))
    first = ctx // 2
    n_windows = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    if n_windows < 1:
        raise ValueError(f"the text has {len(tokens)} tokens, less than one window of {ctx}")
    nll, nll2, count = 0.0, 0.0, 0
    running: list[float] = []
    window_nll: list[float] = []  # each window's summed NLL: paired comparisons
    methods: list[str] = []
    checks: list[float] = []
    start = time.perf_counter()
    for w in range(n_windows):
        window = tokens[w * ctx : (w + 1) * ctx]
        if bos is not None:
            window[0] = bos
        logits, method, check = window_logits(model, pool, table, window, first)
        methods.append(method)
        checks.append(check)
        logp = torch.log_softmax(logits.double(), dim=-1)
        target = torch.tensor(window[first + 1 :])
        picked = -logp[torch.arange(len(target)), target]
        window_nll.append(float(picked.sum()))
        nll += window_nll[-1]
        nll2 += float((picked * picked).sum())
        count += len(target)
        running.append(math.exp(nll / count))
    mean, mean2 = nll / count, nll2 / count
    ppl = math.exp(mean)
    err = math.sqrt(max(mean2 - mean * mean, 0.0) / (count - 1)) * ppl
    return {
        "ppl": ppl,
        "ppl_err": err,
        "windows": n_windows,
        "ctx": ctx,
        "scored_tokens": count,
        "running_ppl": running,
        "window_nll": window_nll,
        "seconds": time.perf_counter() - start,
        "logits_from": sorted(set(methods)),
        "check_max_abs_logit_diff": max(checks),
    }


def window_logits(
    model: LlamaModel, pool: KVPool, table: list[int], window: list[int], first: int
) -> tuple[torch.Tensor, str, float]:
    """float32 logits at positions first .. len(window) - 2 of one window on an empty
    cache, how they were got, and the check's max |difference|.

    `LlamaModel.forward` returns each sequence's LAST logits only. So: one prefill of
    window[:-1] (the cheapest forward over the window), with a hook on the last decoder
    layer keeping the hidden states of every row, and the final norm + LM head applied to
    the scored rows ("hidden-states hook"). Valid when its last row equals what forward
    returned (checked every window). When it does not (a compiled path that bypasses the
    layer modules, say), the fallback uses the public API alone ("decode rows"): ONE more
    forward with every scored position as a one-token row sharing the window's block table
    (row p at start_pos p). A forward writes every row's K/V into the pool before any
    attention reads it, so row p attends to positions 0..p exactly: teacher forcing, as a
    decode tick computes it; ~2x the prefill's time (each row gathers its own K/V)."""
    n = len(window) - 1
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            captured.append(output)

    handle = model.layers[-1].register_forward_hook(keep)
    try:
        final = model.forward(torch.tensor(window[:n]), [SeqInput(table, 0, n)], pool)[0]
    finally:
        handle.remove()
    # numerical noise only (bf16 rows computed in another order differ by ~1%); a wrong
    # hidden state (another layer's, a missed norm) is off by the logits' own size
    rel = 2e-3 if model.dtype == torch.float32 else 5e-2
    tolerance = rel * max(1.0, float(final.abs().max()))
    if len(captured) == 1 and captured[0].shape[0] == n:
        with torch.inference_mode():
            logits = model.lm_head(model.norm(captured[0][first:])).float()
        check = float((logits[-1] - final).abs().max())
        if check <= tolerance:
            return logits, "hidden-states hook", check
    rows = range(first, n)
    logits = model.forward(
        torch.tensor(window[first:n]), [SeqInput(table, p, 1) for p in rows], pool
    )
    check = float((logits[-1] - final).abs().max())
    if check > tolerance:
        raise RuntimeError(f"decode-row logits differ from the prefill's by {check:.3g}")
    return logits, "decode rows", check


def gguf_add_bos() -> tuple[bool, int | None]:
    """Whether llama.cpp prepends BOS for this vocab (tokenizer.ggml.add_bos_token, absent:
    False, as for SmolLM2's gpt2-style vocab), and the BOS id."""
    from tokenfleet.model.gguf import open_gguf

    reader = open_gguf(require_smollm2_gguf())

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    bos = value("tokenizer.ggml.bos_token_id")
    return bool(value("tokenizer.ggml.add_bos_token")), None if bos is None else int(bos)
