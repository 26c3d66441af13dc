"""KV layout arithmetic and the block manager's reservation/allocation accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.kv import BlockManager, KVCapacityError, KVLayout


def test_layout_bytes() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2, block_size=16)
    assert layout.bytes_per_token == 2 * 2 * 4 * 8 * 2 == 256
    assert layout.bytes_per_block == 256 * 16
    assert [layout.blocks_for(t) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert layout.num_blocks_for_budget(3 * 4096 + 4095) == 3
    assert layout.bytes_for_blocks(3) == 3 * 4096


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size"]
)
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_layout_rejects_non_positive_ints(field: str, bad: object) -> None:
    kwargs: dict[str, object] = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=1)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_reserve_ensure_free_round_trip() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve("a", 10)  # 3 blocks
    assert bm.num_reserved_blocks == 3 and bm.available_blocks == 5
    assert bm.num_in_use_blocks == 0, "reservation allocates nothing"
    assert bm.ensure("a", 1) == [0]
    assert bm.ensure("a", 4) == [0]
    assert bm.ensure("a", 5) == [0, 1]
    assert bm.ensure("a", 3) == [0, 1], "ensure never shrinks"
    assert bm.used_tokens("a") == 5
    assert bm.num_in_use_blocks == 2 and bm.num_free_blocks == 6
    bm.free("a")
    assert (bm.num_free_blocks, bm.num_in_use_blocks, bm.num_reserved_blocks) == (8, 0, 0)
    assert "a" not in bm and len(bm) == 0
    bm.check_invariants()


def test_freed_blocks_are_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.reserve("a", 4)
    first = bm.ensure("a", 4)
    bm.free("a")
    bm.reserve("b", 8)
    assert bm.ensure("b", 4) == first
    assert sorted(bm.ensure("b", 8)) == [0, 1, 2, 3]


def test_reservation_refused_when_pool_is_spoken_for() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 9)  # 3 blocks, none allocated yet
    assert bm.can_reserve(4) and not bm.can_reserve(5)
    with pytest.raises(KVCapacityError, match="1 of 4"):
        bm.reserve("b", 5)
    with pytest.raises(KVCapacityError, match="already"):
        bm.reserve("a", 1)
    assert "b" not in bm and bm.num_reserved_blocks == 3


def test_ensure_beyond_reservation_is_a_bug() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve("a", 4)
    with pytest.raises(AssertionError):
        bm.ensure("a", 5)
    with pytest.raises(KVCapacityError):
        bm.ensure("nobody", 1)
    with pytest.raises(KVCapacityError):
        bm.free("nobody")


def test_waste_is_at_most_one_partial_block_per_session() -> None:
    bm = BlockManager(num_blocks=64, block_size=16)
    lengths = {"a": 1, "b": 16, "c": 17, "d": 100}
    for sid in lengths:
        bm.reserve(sid, 200)
    for sid, n in lengths.items():
        bm.ensure(sid, n)
    for sid in lengths:
        slots = len(bm.block_table(sid)) * bm.block_size
        assert 0 <= slots - bm.used_tokens(sid) < bm.block_size, sid
    allocated_slots = bm.num_in_use_blocks * bm.block_size
    assert allocated_slots - sum(lengths.values()) < len(lengths) * bm.block_size


def test_everything_freed_returns_kv_to_zero() -> None:
    bm = BlockManager(num_blocks=10, block_size=3)
    for i in range(5):
        bm.reserve(f"s{i}", 6)
        bm.ensure(f"s{i}", 4 + i % 3)
    for i in range(5):
        bm.free(f"s{i}")
    assert bm.num_in_use_blocks == 0 and bm.num_reserved_blocks == 0
    assert bm.available_blocks == bm.num_free_blocks == 10
    bm.check_invariants()


_op = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 7), st.integers(0, 40)),
    st.tuples(st.just("ensure"), st.integers(0, 7), st.integers(0, 40)),
    st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(0, 12), block_size=st.integers(1, 5), ops=st.lists(_op, max_size=60))
def test_random_sequences_keep_invariants(
    num_blocks: int, block_size: int, ops: list[tuple[str, int, int]]
) -> None:
    bm = BlockManager(num_blocks, block_size)
    reserved: dict[str, int] = {}  # model: session -> reserved tokens
    for op, i, n in ops:
        sid = f"s{i}"
        if op == "reserve":
            if sid in reserved or not bm.can_reserve(n):
                with pytest.raises(KVCapacityError):
                    bm.reserve(sid, n)
            else:
                bm.reserve(sid, n)
                reserved[sid] = n
        elif op == "ensure" and sid in reserved:
            target = min(n, bm.reserved_tokens(sid))
            table = bm.ensure(sid, target)
            assert len(table) * block_size >= target
        elif op == "free" and sid in reserved:
            bm.free(sid)
            del reserved[sid]
        bm.check_invariants()
        assert bm.num_free_blocks + bm.num_in_use_blocks == num_blocks
        tables = [bm.block_table(s) for s in reserved]
        flat = [b for t in tables for b in t]
        assert len(flat) == len(set(flat)) == bm.num_in_use_blocks
        assert bm.num_in_use_blocks <= bm.num_reserved_blocks <= num_blocks
    for sid in list(reserved):
        bm.free(sid)
    assert bm.num_free_blocks == num_blocks and bm.num_reserved_blocks == 0
