"""Decode attention over a shared prefix (tokenfleet/model/attention/sdpa.py): rows whose
block tables start with the same blocks read them once, and get the same output as
when every row gathers its whole context."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenfleet.model.attention import sdpa
from tokenfleet.model.tick_inputs import DecodeGroup

BLOCK = 4


def group(tables: list[list[int]], lens: list[int]) -> DecodeGroup:
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return DecodeGroup(
        rows=torch.arange(len(tables)),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        max_context=max(lens),
        is_all_rows=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_rows_match_whole_context_gathers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    heads, kv_heads, hd, num_blocks = 6, 2, 8, 40
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, hd, dtype=dtype)
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, hd, dtype=dtype)
    # three rows share blocks 5, 6, 7 (12 tokens), then their own blocks and lengths;
    # block 8 is shared by rows 0 and 1 only, so it is not part of the common prefix
    g = group([[5, 6, 7, 8, 20], [5, 6, 7, 8, 21, 22], [5, 6, 7, 30]], [19, 23, 14])
    q = torch.randn(3, heads, hd, dtype=dtype)
    meta = sdpa._prepare_decode(g, BLOCK)
    assert meta.shared is not None and meta.shared.tolist() == list(range(20, 32))
    whole = replace(meta, shared=None, **_whole_context(g))
    got = sdpa._decode_attention(q, k_cache, v_cache, meta)
    want = sdpa._decode_attention(q, k_cache, v_cache, whole)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _whole_context(g: DecodeGroup) -> dict[str, torch.Tensor]:
    """slots and mask over each row's whole context (the path without sharing)."""
    lens = g.context_lens.long()[:, None]
    keys = torch.arange(g.max_context)[None, :]
    pos = torch.minimum(keys, lens - 1)
    tables = g.block_tables.long()
    slots = tables.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK
    return {"slots": slots.flatten(), "mask": (keys < lens)[:, None, None, :]}


def test_no_sharing_without_a_common_full_prefix() -> None:
    # different first blocks; a single row; a common block holding a row's newest token
    assert sdpa._prepare_decode(group([[1, 2, 3], [4, 2, 3]], [12, 12]), BLOCK).shared is None
    assert sdpa._prepare_decode(group([[1, 2, 3]], [12]), BLOCK).shared is None
    short = sdpa._prepare_decode(group([[1, 2], [1, 2]], [8, 8]), BLOCK)
    assert short.shared is None  # block 2 holds both rows' last token: only 1 block shared
