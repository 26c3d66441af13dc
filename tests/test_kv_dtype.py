"""A float32 model's K/V kept in float16 (`LlamaModel.set_kv_dtype`, `--kv-dtype`; the
engine plan's choice for a default start on a CPU without bf16): each new key and value
is rounded to float16 as it is written and attended to as rounded, on every path that
reads the pool (SDPA's gathers, the paged kernel, the native decode stack); the budget
holds twice the tokens; the worker says what its pool holds."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tokenfleet.errors import ModelLoadError
from tokenfleet.model import LoadedModel, load_model
from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.tick_inputs import SeqInput
from tokenfleet.model.torch_runner import TorchRunner
from tokenfleet.worker.engine import Engine, EngineConfig

MiB = 1024 * 1024
needs_kernel = pytest.mark.skipif(not paged_cpu.load(), reason=f"{paged_cpu.failure()}")
PROMPT = [(13 * i) % 200 + 5 for i in range(40)]


def tiny(kv: torch.dtype | None = None, dtype: str = "float32") -> LoadedModel:
    loaded = load_model("tiny-random", dtype=dtype, device="cpu")
    if kv is not None:
        loaded.model.set_kv_dtype(kv)
    return loaded


def test_the_pool_holds_float16_under_a_float32_model_and_nothing_else() -> None:
    loaded = tiny(torch.float16)
    assert loaded.model.kv_dtype == torch.float16 and loaded.model.dtype == torch.float32
    pool = loaded.model.new_kv_pool(4, 4)
    assert pool.k.dtype == pool.v.dtype == torch.float16
    loaded.model.set_kv_dtype(torch.float32)  # back to the model's own
    assert loaded.model.new_kv_pool(4, 4).k.dtype == torch.float32
    with pytest.raises(ValueError, match="float16 under a float32 model"):
        tiny(torch.bfloat16)  # a float32 model in a bf16 pool: not a pool the kernels read
    with pytest.raises(ValueError, match="float16 under a float32 model"):
        tiny(torch.float16, dtype="bfloat16")


def test_a_pool_of_the_wrong_dtype_is_refused_by_name() -> None:
    model = tiny(torch.float16).model
    pool = tiny().model.new_kv_pool(16, 4)  # float32: not what this model writes
    with pytest.raises(ValueError, match=r"KV pool is torch\.float32"):
        model.forward(PROMPT[:4], [SeqInput([0], 0, 4)], pool)


def test_the_budget_holds_twice_the_tokens_and_the_cache_is_told_apart() -> None:
    """Admission counts float16 bytes: the same KV budget gives twice the blocks; and a
    prefix cached by a float32 pool is not the same KV as a float16 pool's."""
    config = EngineConfig(kv_budget_bytes=8 * MiB, max_active=4, max_batch_size=4)
    f32, f16 = tiny(), tiny(torch.float16)
    assert TorchRunner(f16).spec.kv_dtype_bytes == 2 and TorchRunner(f32).spec.kv_dtype_bytes == 4
    blocks32 = Engine(f32, config).budget.num_kv_blocks
    blocks16 = Engine(f16, config).budget.num_kv_blocks
    assert blocks16 == 2 * blocks32, (blocks16, blocks32)
    assert TorchRunner(f16).spec.cache_identity != TorchRunner(f32).spec.cache_identity


@pytest.mark.parametrize("split", [4, 8, 20, 36])
def test_a_chunk_attends_to_its_own_keys_as_the_pool_keeps_them(split: int) -> None:
    """A prompt prefilled at once (its keys straight from the projection) and in two
    chunks (the second reading the first's keys back from the pool, as after a prefix-
    cache hit) give the same logits: the fresh chunk attends to its keys rounded to
    float16 as well. Unrounded, they differ by the rounding (checked below)."""
    model = tiny(torch.float16).model
    table = list(range(12))
    pool = model.new_kv_pool(16, 4)
    whole = model.forward(PROMPT, [SeqInput(table, 0, 40)], pool, rows=range(split, 40))
    pool = model.new_kv_pool(16, 4)
    model.forward(PROMPT[:split], [SeqInput(table, 0, split)], pool)
    rest = PROMPT[split:]
    chunked = model.forward(rest, [SeqInput(table, split, len(rest))], pool, rows=range(len(rest)))
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)  # float32 sum order only
    exact = tiny().model  # the same weights, a float32 pool
    unrounded = exact.forward(PROMPT, [SeqInput(table, 0, 40)], exact.new_kv_pool(16, 4))
    assert (unrounded - whole[-1]).abs().max() > 1e-6  # the rounding is there to see
    torch.testing.assert_close(whole[-1], unrounded[0], atol=1e-3, rtol=1e-3)


@needs_kernel
@pytest.mark.parametrize("hd", [64, 128, 48])  # 48: the plain loops
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("new", [False, True])
def test_the_kernel_reads_a_float16_pool_as_the_float32_values_it_holds(
    hd: int, window: int, new: bool
) -> None:
    """The paged kernel over a float16 pool gives the bits it gives over a float32 pool
    holding the same (rounded) values; a new key given beside the pool (the decode
    graph's way) is rounded to float16 first, as it will be written."""
    torch.manual_seed(hd + window)
    layers, slots, kvh, heads, rows = 2, 64, 3, 9, 4
    k = torch.randn(layers, slots, kvh, hd).half()
    v = torch.randn(layers, slots, kvh, hd).half()
    q = torch.randn(rows, heads, hd)
    tables = torch.randperm(slots // 4)[: rows * 4].view(rows, 4).int()
    past = torch.tensor([3, 7, 16, 11])
    k_new = torch.randn(rows, kvh, hd) if new else None
    v_new = torch.randn(rows, kvh, hd) if new else None
    got = paged_cpu.decode_attention(q, k, v, k_new, v_new, tables, past, 1, 4, window)

    def rounded(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.half().float()

    want = paged_cpu.decode_attention(
        q, k.float(), v.float(), rounded(k_new), rounded(v_new), tables, past, 1, 4, window
    )
    assert got.dtype == torch.float32 and torch.equal(got, want)


@needs_kernel
def test_the_kernel_refuses_other_mixtures_by_name() -> None:
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    pool = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
    tables, past = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3])
    with pytest.raises(RuntimeError, match="float16 under a float32 q"):
        paged_cpu.decode_attention(q, pool, pool, None, None, tables, past, 0, 4)


# ---- the worker ------------------------------------------------------------------------


def test_kv_dtype_flag_is_checked_and_said(redis_url: str) -> None:
    """`--kv-dtype float16` on a float32 model: the pool holds float16, the hash says so,
    and a job runs to its end; asked of a bf16 model it is refused at start, by name;
    an unknown value is refused by the settings."""
    from tokenfleet.config import WorkerSettings
    from tokenfleet.producer import Producer
    from tokenfleet.protocol import SamplingParams
    from tokenfleet.worker.main import build_worker

    settings = WorkerSettings(
        redis_url=redis_url, prefix="kvd:", dtype="float32", kv_dtype="float16", burst=True
    )
    worker = build_worker(settings)
    assert worker.options.info["kv_dtype"] == "float16", worker.options.info
    assert worker.engine.runner.spec.kv_dtype_bytes == 2
    job = Producer.from_url(redis_url, prefix="kvd:").submit(
        prompt_ids=PROMPT, max_new_tokens=8, sampling=SamplingParams(temperature=0.0)
    )
    assert worker.run() == 0
    assert len(job.result(timeout=30).token_ids) == 8
    plain = WorkerSettings(redis_url=redis_url, prefix="kvd:", dtype="float32", burst=True)
    assert build_worker(plain).options.info["kv_dtype"] == "float32"  # no plan: the model's
    bf16 = WorkerSettings(
        redis_url=redis_url, prefix="kvd:", dtype="bfloat16", kv_dtype="float16", burst=True
    )
    with pytest.raises(ModelLoadError, match="--kv-dtype float16"):
        build_worker(bf16)
    with pytest.raises(ValidationError, match="kv_dtype must be one of"):
        WorkerSettings(kv_dtype="int8")
