"""The paged-KV model and the engine on CUDA against transformers on the same device.

The CPU reference tests (`test_model_reference.py`) pin the maths; these check that it
survives the move to a GPU: other kernels (cuBLAS, SDPA's flash / memory-efficient
paths), other reduction orders, and bf16. Per checkpoint (a few shapes and families
of `REFERENCE_CONFIGS`), both sides loaded from the same saved folder:

  fp32  logits within a tight tolerance (TF32 off), and greedy tokens == `generate`;
  bf16  ours against transformers in bf16: top-1 agreement and max |diff| over the
        logit scale, next to transformers' own bf16 error against fp32 (the noise floor);
  engine  the `Engine` on the device gives the same greedy tokens at concurrency 1 and 8
        (fp32: identical and equal to `generate`; bf16: recorded, batch-size dependent
        kernels may flip near-ties).

Skipped, saying so, where `torch.cuda.is_available()` is False. `TOKENFLEET_TEST_DEVICE=cpu`
runs the same checks on CPU (to check this file itself on a machine without a GPU).
`TOKENFLEET_CUDA_REPORT=path.jsonl` appends every measured error / agreement there, so a
GPU run records its numbers whether or not an assertion fails.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.models import (
    REFERENCE_CONFIGS,
    block_tables,
    greedy_engine_style,
    make_hf_llama,
    run_chunks,
    save_hf_llama,
)
from tokenfleet.model import LoadedModel, SeqInput, load_model
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import Engine, EngineConfig

DEVICE = os.environ.get("TOKENFLEET_TEST_DEVICE", "cuda")
REPORT = os.environ.get("TOKENFLEET_CUDA_REPORT")

if DEVICE.startswith("cuda") and not torch.cuda.is_available():  # one skip, not 36
    pytest.skip(
        "CUDA is not available (torch.cuda.is_available() is False): these are the GPU "
        "reference checks; bench/gpu_check.sh runs them on a GPU machine",
        allow_module_level=True,
    )
pytestmark = pytest.mark.reference

MiB = 1024 * 1024
BLOCK = 8
NUM_BLOCKS = 96
# A few shapes and every family: GQA, MQA with an explicit head_dim, llama3 rope
# scaling, biases, a sliding window, qwen3's q/k norms, phi3's fused projections.
CONFIGS = ("gqa-hd32", "llama3-rope", "biases", "mistral-window", "qwen3-gqa", "phi3-gqa")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_REL = 1e-4  # max |diff| / max(|ref|, 1): the CPU tests' tolerance
BF16_REL = 5e-2
BF16_TOP1 = 0.9


def record(kind: str, **fields: Any) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"kind": kind, "device": DEVICE, **fields}) + "\n")


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in full fp32 (no TF32) for the tight tolerance, restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module", params=CONFIGS)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = make_hf_llama(seed=7, **REFERENCE_CONFIGS[request.param])
    return save_hf_llama(hf, tmp_path_factory.mktemp(request.param, numbered=False))


def load_pair(folder: Path, dtype: str) -> tuple[Any, LoadedModel]:
    """transformers and tokenfleet from the same folder, on DEVICE in `dtype`."""
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype])
    return hf.to(DEVICE).eval(), load_model(str(folder), device=DEVICE, dtype=dtype)


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one prompt: [len(ids), vocab], fp32 on CPU."""
    with torch.no_grad():
        out = hf(torch.tensor([ids], device=DEVICE)).logits[0]
    return out.float().cpu()  # type: ignore[no-any-return]


def ours_every_position(loaded: LoadedModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Ours, fed in `chunks`, the logits after each: [len(chunks), vocab], fp32 on CPU."""
    pool = loaded.model.new_kv_pool(NUM_BLOCKS, BLOCK)
    (table,) = block_tables([len(ids)], BLOCK, NUM_BLOCKS, seed=3)
    return run_chunks(loaded.model, pool, ids, table, chunks).cpu()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1.0)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_model_is_on_the_device(folder: Path) -> None:
    loaded = load_model(str(folder), device=DEVICE, dtype="fp32")
    assert loaded.model.device.type == torch.device(DEVICE).type
    pool = loaded.model.new_kv_pool(4, BLOCK)
    assert pool.k.device.type == torch.device(DEVICE).type
    out = loaded.model.forward([5, 6, 7], [SeqInput([2], 0, 3)], pool)
    assert out.dtype == torch.float32 and out.device.type == torch.device(DEVICE).type


def test_fp32_logits_match(folder: Path) -> None:
    hf, loaded = load_pair(folder, "fp32")
    ids = prompt(60, hf.config.vocab_size, seed=2)
    ref = hf_logits(hf, ids)
    full = ours_every_position(loaded, ids, [60])  # one prefill of the whole prompt
    chunks = [13, 1, 8, 20, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # odd sizes cross blocks
    chunked = ours_every_position(loaded, ids, chunks)
    ends = torch.tensor(chunks).cumsum(0) - 1
    errors = {"prefill": rel_err(full[0], ref[-1]), "chunked": rel_err(chunked, ref[ends])}
    record("fp32_logits", config=folder.name, tolerance=FP32_REL, **errors)
    assert max(errors.values()) <= FP32_REL, errors


def greedy_generate(hf: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    expected = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p], device=DEVICE),
            attention_mask=torch.ones(1, len(p), dtype=torch.long, device=DEVICE),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    return expected


def greedy_ours(loaded: LoadedModel, prompts: list[list[int]], new: int) -> list[list[int]]:
    return greedy_engine_style(loaded.model, prompts, new, BLOCK, NUM_BLOCKS)


def test_fp32_greedy_tokens_match_generate(folder: Path) -> None:
    hf, loaded = load_pair(folder, "fp32")
    vocab, new = hf.config.vocab_size, 20
    prompts = [prompt(n, vocab, seed=4 + n) for n in (1, 3, 7, 12, 18, 25, 33, 40)]
    expected = greedy_generate(hf, prompts, new)
    got = greedy_ours(loaded, prompts, new)
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    record("fp32_greedy", config=folder.name, sequences=len(prompts), identical=same)
    assert got == expected


def test_bf16_logits_close(folder: Path) -> None:
    hf32, _ = load_pair(folder, "fp32")
    hf16, ours16 = load_pair(folder, "bf16")
    ids = prompt(57, hf16.config.vocab_size, seed=1)
    ref32 = hf_logits(hf32, ids)
    ref16 = hf_logits(hf16, ids)
    chunks = [9, *([1] * 8), 16, *([1] * 8), 16]  # prefill chunks and decodes
    ends = torch.tensor(chunks).cumsum(0) - 1
    ours = ours_every_position(ours16, ids, chunks)
    top1 = float((ours.argmax(-1) == ref16[ends].argmax(-1)).float().mean())
    top1_vs_fp32 = float((ours.argmax(-1) == ref32[ends].argmax(-1)).float().mean())
    hf_top1_vs_fp32 = float((ref16[ends].argmax(-1) == ref32[ends].argmax(-1)).float().mean())
    err = rel_err(ours, ref16[ends])
    record(
        "bf16_logits",
        config=folder.name,
        rel_err_vs_hf_bf16=err,
        rel_err_vs_hf_fp32=rel_err(ours, ref32[ends]),
        hf_bf16_rel_err_vs_fp32=rel_err(ref16[ends], ref32[ends]),
        top1_vs_hf_bf16=top1,
        top1_vs_hf_fp32=top1_vs_fp32,
        hf_bf16_top1_vs_fp32=hf_top1_vs_fp32,
        tolerance=BF16_REL,
        top1_min=BF16_TOP1,
    )
    assert err <= BF16_REL, err
    # The referee is fp32: two bf16 paths, each one rounding away from it, disagree with
    # each other at up to twice the positions either disagrees with fp32 (qwen3-gqa on
    # an H200: ours and transformers' bf16 each agree with fp32 at 18 of 19 positions,
    # with each other at 17). Ours may flip at most one position more than theirs.
    floor = min(BF16_TOP1, hf_top1_vs_fp32 - 1 / len(chunks))
    assert top1_vs_fp32 >= floor, (top1_vs_fp32, hf_top1_vs_fp32, top1)


def engine_tokens(loaded: LoadedModel, requests: list[GenerationRequest], c: int) -> Any:
    engine = Engine(
        loaded,
        EngineConfig(kv_budget_bytes=16 * MiB, max_active=c, max_batch_size=c, max_waiting=8),
    )
    for r in requests:
        assert engine.submit(r).accepted
    tokens: dict[str, list[int]] = {r.job_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for event in engine.step().tokens:
            tokens[event.job_id].append(event.token_id)
    assert not engine.has_work and engine.kv_used_bytes == 0
    return [tokens[r.job_id] for r in requests], engine.stats.ticks


def engine_jobs(vocab: int) -> list[GenerationRequest]:
    """test_engine.py's eight jobs: different prompt lengths and budgets."""
    return [
        GenerationRequest(
            job_id=f"job-{i}",
            prompt_ids=[(7 * i + 3 * k) % (vocab - 3) + 3 for k in range(1 + 5 * i)],
            max_new_tokens=6 + 3 * i,
            ignore_eos=True,
        )
        for i in range(8)
    ]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_same_tokens_at_concurrency_1_and_8(folder: Path, dtype: str) -> None:
    hf, loaded = load_pair(folder, dtype)
    requests = engine_jobs(hf.config.vocab_size)
    one, ticks_one = engine_tokens(loaded, requests, 1)
    eight, ticks_eight = engine_tokens(loaded, requests, 8)
    assert [len(t) for t in one] == [r.max_new_tokens for r in requests]
    assert ticks_eight < ticks_one  # it really batched
    same = sum(a == b for a, b in zip(one, eight, strict=True))
    fields: dict[str, Any] = {"config": folder.name, "dtype": dtype, "identical_c1_c8": same}
    if dtype == "fp32":
        expected = greedy_generate(
            hf, [list(r.prompt_ids) for r in requests], max(r.max_new_tokens for r in requests)
        )
        expected = [e[: r.max_new_tokens] for e, r in zip(expected, requests, strict=True)]
        fields["identical_to_generate"] = sum(a == b for a, b in zip(one, expected, strict=True))
    record("engine", sequences=len(requests), **fields)
    if dtype == "fp32":
        assert one == eight, "concurrency 8 changed some session's tokens"
        assert one == expected
    else:  # bf16: batch-dependent kernels may flip a near-tie; the first tokens must agree
        assert all(a[:1] == b[:1] for a, b in zip(one, eight, strict=True))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_tokens_from_cuda_graphs(folder: Path, dtype: str) -> None:
    """Decode ticks replayed from CUDA graphs (tokenfleet/model/cuda_graph.py, as a CUDA
    worker runs them): the eight jobs at concurrency 8 give the eager engine's tokens
    (fp32: identical; bf16: padded row counts may pick other kernels, so near-ties may
    flip: the first tokens must agree), and the ticks really were replayed."""
    from tokenfleet.model.cuda_graph import install

    hf, loaded = load_pair(folder, dtype)
    requests = engine_jobs(hf.config.vocab_size)
    eager, _ = engine_tokens(loaded, requests, 8)
    graphs = install(loaded.model, max_rows=8, max_context=NUM_BLOCKS * BLOCK)
    replayed, _ = engine_tokens(loaded, requests, 8)
    same = sum(a == b for a, b in zip(eager, replayed, strict=True))
    record(
        "cuda_graphs",
        config=folder.name,
        dtype=dtype,
        identical_to_eager=same,
        sequences=len(requests),
        ticks=graphs.stats.ticks,
        replays=graphs.stats.replays,
        captured=len(graphs.stats.captured),
        capture_s=round(graphs.stats.capture_s, 3),
    )
    assert graphs.stats.ticks > 20
    assert graphs.stats.replays == (graphs.stats.ticks if graphs.capture else 0)
    if dtype == "fp32":
        assert replayed == eager
    else:
        assert all(a[:1] == b[:1] for a, b in zip(eager, replayed, strict=True))
