"""The tick's index tensors (reused buffers) and the attention backend seam."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tokenfleet.model import SeqInput, load_model
from tokenfleet.model.attention import AttentionBackend, SdpaBackend, get_backend
from tokenfleet.model.tick_inputs import BatchPlan, TickBuffers

CPU = torch.device("cpu")


def test_buffers_are_reused_across_ticks_and_grow_when_needed() -> None:
    buffers = TickBuffers(CPU)
    first = buffers.build([1, 2, 3, 4], [SeqInput([0, 1], 0, 3), SeqInput([2], 3, 1)], 4, 8)
    assert first.input_ids.tolist() == [1, 2, 3, 4]
    assert first.positions.tolist() == [0, 1, 2, 3]
    assert first.write_slots.tolist() == [0, 1, 2, 11]
    assert first.last_rows.tolist() == [2, 3]
    assert first.decode is not None and first.decode.context_lens.tolist() == [4]
    assert first.decode.block_tables.dtype == torch.int32
    assert first.decode.block_tables.tolist() == [[2]]
    [span] = first.prefills
    assert (span.row_start, span.num_new, span.start_pos) == (0, 3, 0)
    storage = first.input_ids.untyped_storage().data_ptr()
    # A smaller tick writes into the same storage: nothing is allocated per tick.
    second = buffers.build([9], [SeqInput([5], 2, 1)], 4, 8)
    assert second.input_ids.untyped_storage().data_ptr() == storage
    assert second.write_slots.tolist() == [22]
    # A bigger one grows the buffer once, and is still right.
    seqs = [SeqInput(list(range(8)), 0, 30), SeqInput([8, 9, 10, 11, 12], 10, 10)]
    big = buffers.build(list(range(40)), seqs, 4, 16)
    assert big.positions.tolist() == [*range(30), *range(10, 20)]
    assert big.last_rows.tolist() == [29, 39]


def test_bad_inputs_are_named() -> None:
    buffers = TickBuffers(CPU)
    with pytest.raises(ValueError, match="at least one"):
        buffers.build([], [], 4, 8)
    with pytest.raises(ValueError, match="claim"):
        buffers.build([1, 2], [SeqInput([0], 0, 1)], 4, 8)
    with pytest.raises(ValueError, match="outside the pool"):
        buffers.build([1], [SeqInput([9], 0, 1)], 4, 8)


class CountingBackend:
    """A backend that delegates to SDPA and counts: any backend plugs in without a layer change."""

    name = "counting"

    def __init__(self) -> None:
        self.inner = SdpaBackend()
        self.prepared = 0
        self.attended = 0

    def prepare(self, plan: BatchPlan) -> object:
        self.prepared += 1
        return self.inner.prepare(plan)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: object
    ) -> Tensor:
        self.attended += 1
        return self.inner.attend(q, k, v, k_cache, v_cache, meta)


def test_a_backend_is_swapped_in_without_touching_the_layers() -> None:
    loaded = load_model("tiny-random", device="cpu")
    model = loaded.model
    ids = [5, 6, 7, 8, 9, 10]
    seqs = [SeqInput([0, 1], 0, 5), SeqInput([2], 0, 1)]
    want = model.forward(ids, seqs, model.new_kv_pool(4, 4))
    counting = CountingBackend()
    backend: AttentionBackend = counting
    model.attention = backend
    try:
        got = model.forward(ids, seqs, model.new_kv_pool(4, 4))
    finally:
        model.attention = SdpaBackend()
    assert torch.equal(got, want)
    assert counting.prepared == 1 and counting.attended == loaded.config.num_layers


def test_unknown_backend_names_the_known_ones() -> None:
    assert get_backend("sdpa").name == "sdpa"
    with pytest.raises(ValueError, match="sdpa"):
        get_backend("flash")
