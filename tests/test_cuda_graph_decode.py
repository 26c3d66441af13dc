"""Decode ticks from CUDA graphs (tokenfleet/model/cuda_graph.py), checked on the CPU.

Nothing is captured here (no GPU): `CudaGraphDecode(capture=False)` runs the very tick a
graph records, padded to the same row and width buckets, on the same static buffers,
with the K/V written after it. These tests pin what the padding, the masks and the
writes must give: the eager forward's logits and pool, tick after tick, for every
attention shape the families have (GQA, sliding windows, gemma3's local rope and
scaled embeddings, qwen3's q/k norms), and the engine's tokens. The recorded graphs
themselves are checked on a GPU by test_cuda_reference.py (bench/gpu_check.sh).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.helpers.models import REFERENCE_CONFIGS, block_tables, make_hf_llama, save_hf_llama
from tokenfleet.model import LoadedModel, SeqInput, load_model
from tokenfleet.model.cuda_graph import CudaGraphDecode, bucket, install
from tokenfleet.model.torch_runner import TorchRunner
from tokenfleet.protocol import GenerationRequest
from tokenfleet.worker.engine import Engine, EngineConfig

BLOCK = 4
MiB = 1024 * 1024


def _load(tmp_path: Path, config: str) -> LoadedModel:
    hf = make_hf_llama(seed=3, **REFERENCE_CONFIGS[config])
    return load_model(str(save_hf_llama(hf, tmp_path / config)), dtype="fp32", device="cpu")


def test_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert [bucket(n, 8) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket(5, 6) == 6  # the engine's batch, when it is not a power of two


@pytest.mark.parametrize("config", ["gqa-hd32", "mistral-window", "gemma3-window", "qwen3-gqa"])
def test_graph_ticks_follow_the_eager_forward(tmp_path: Path, config: str) -> None:
    """Three sequences of different lengths decoded together for 14 ticks (rows padded
    from 3 to 4, tables from 1 to 8 blocks: every bucket change; windows of 8 passed):
    the same logits as the eager forward and the same K/V in the pool."""
    eager = _load(tmp_path, config).model
    model = copy.deepcopy(eager)
    graphs = CudaGraphDecode(model, max_rows=4, max_context=64, capture=False)
    model.decode_graph = graphs
    e_pool, g_pool = eager.new_kv_pool(48, BLOCK), model.new_kv_pool(48, BLOCK)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20 + i for i in range(13)]]
    tables = block_tables([len(p) + 16 for p in prompts], BLOCK, 48, seed=1)
    for p, table in zip(prompts, tables, strict=True):  # prefills run eagerly on both
        for m, pool in ((eager, e_pool), (model, g_pool)):
            m.forward(p, [SeqInput(table, 0, len(p))], pool)
    assert graphs.stats.ticks == 0  # no prefill went through the graphs
    last = [p[-1] for p in prompts]
    for step in range(14):
        seqs = [SeqInput(t, len(p) + step, 1) for p, t in zip(prompts, tables, strict=True)]
        want = eager.forward(last, seqs, e_pool)
        got = model.forward(last, seqs, g_pool)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        last = want.argmax(-1).tolist()
    assert graphs.stats.ticks == 14
    widths = {w for rows, w in graphs.stats.captured}
    assert {rows for rows, _ in graphs.stats.captured} == {4}
    assert widths == {4, 8}  # 13 + 14 tokens need 7 blocks of 4 at the end
    torch.testing.assert_close(g_pool.k, e_pool.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_pool.v, e_pool.v, atol=1e-5, rtol=1e-5)


def test_only_decode_ticks_within_the_limits_replay(tmp_path: Path) -> None:
    model = _load(tmp_path, "gqa-hd32").model
    graphs = CudaGraphDecode(model, max_rows=2, max_context=32, capture=False)
    assert graphs.serves([SeqInput([0], 3, 1), SeqInput([1], 0, 1)], narrow=False)
    assert not graphs.serves([SeqInput([0], 3, 1), SeqInput([1], 0, 2)], narrow=False)  # prefill
    assert not graphs.serves([SeqInput([0], 3, 1)] * 3, narrow=False)  # more rows than the batch
    assert not graphs.serves([SeqInput(list(range(9)), 32, 1)], narrow=False)  # past the context
    assert not graphs.serves([SeqInput([0], 3, 1)], narrow=True)  # a CPU plan's packed set
    with pytest.raises(ValueError, match="CUDA model"):
        CudaGraphDecode(model, max_rows=2, max_context=32, capture=True)


def test_a_graph_belongs_to_the_pool_it_was_made_on(tmp_path: Path) -> None:
    """Another pool (a runner's new one) drops the graphs of the old: they read its
    addresses. The runner binds its pool when it allocates it, row buckets made then."""
    loaded = _load(tmp_path, "gqa-hd32")
    graphs = install(loaded.model, max_rows=3, max_context=64)
    runner = TorchRunner(loaded)
    runner.allocate_kv(16, BLOCK)
    made = set(graphs.stats.captured)
    assert {rows for rows, _ in made} == {1, 2, 3} and {w for _, w in made} == {1, 2, 4, 8}
    other = loaded.model.new_kv_pool(16, BLOCK)
    loaded.model.forward([3], [SeqInput([2, 5], 4, 1)], other)
    assert graphs.stats.ticks == 1 and len(graphs.stats.captured) == len(made) + 1


def _engine_tokens(loaded: LoadedModel, c: int) -> list[list[int]]:
    requests = [
        GenerationRequest(
            job_id=f"job-{i}",
            prompt_ids=[(7 * i + 3 * k) % 60 + 3 for k in range(1 + 5 * i)],
            max_new_tokens=6 + 3 * i,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    config = EngineConfig(kv_budget_bytes=4 * MiB, max_active=c, max_batch_size=c, max_waiting=8)
    engine = Engine(loaded, config)
    for r in requests:
        assert engine.submit(r).accepted
    tokens: dict[str, list[int]] = {r.job_id: [] for r in requests}
    while engine.has_work:
        for event in engine.step().tokens:
            tokens[event.job_id].append(event.token_id)
    return [tokens[r.job_id] for r in requests]


def test_the_engine_gives_the_same_tokens_from_graph_ticks(tmp_path: Path) -> None:
    """Eight jobs of different lengths at concurrency 8 (rows padded to buckets as jobs
    come and go): the greedy tokens the eager engine gives at concurrency 1."""
    loaded = _load(tmp_path, "mistral-window")
    eager = _engine_tokens(loaded, 1)
    graphs = install(loaded.model, max_rows=8, max_context=256)
    assert _engine_tokens(loaded, 8) == eager
    assert graphs.stats.ticks > 20
    assert {rows for rows, _ in graphs.stats.captured} >= {1, 2, 4, 8}
