"""The portable backend: gather each sequence's context from the pool, then SDPA.

Decode rows (one new token each) share ONE padded `scaled_dot_product_attention`
call; each prefill chunk is attended on its own with a causal mask shifted by its
start position. Attention only ever reads slots from a sequence's own block table:
padding keys point at the row's own last real slot and are masked out.

Decode rows whose block tables start with the same blocks (a prefix shared through the
prefix cache) read those blocks once: the shared keys are gathered once for all rows,
each row's own keys after them separately, and one softmax runs over both score sets
(exact: the same scores, concatenated). Without this, 64 rows sharing a 512-token
prompt gathered that prompt 64 times per layer per tick.

Sliding-window layers (gemma3) get metadata of their own (`prepare(plan, window)`):
the same gathers, with keys older than the window masked out (and no shared prefix,
which would mostly lie outside the window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenfleet.model.attention import paged_cpu
from tokenfleet.model.tick_inputs import BatchPlan, DecodeGroup, PrefillSpan

MIN_SHARED_BLOCKS = 2  # a shorter common prefix is not worth a second code path


@dataclass(frozen=True)
class _Decode:
    rows: Tensor  # [B]
    slots: Tensor  # [B * L] flat context slots after the shared prefix, row-major
    mask: Tensor  # [B, 1, 1, L] True where the key is part of the row's context
    is_all_rows: bool
    shared: Tensor | None = None  # [P] slots of the prefix every row shares (whole blocks)
    # The paged CPU kernel's inputs where it runs (`paged_cpu`): each row's block table
    # [B, W] int32 and context length [B] int64; it reads the pool in place.
    tables: Tensor | None = None
    lens: Tensor | None = None
    window: int = 0
    block_size: int = 0


@dataclass(frozen=True)
class _Prefill:
    rows: slice
    # Context slots [ctx] (None for a chunk starting at position 0: it attends to its
    # fresh K/V alone) and the causal mask [num_new, ctx] shifted by start_pos (None
    # for such a chunk when no window cuts into it: plain causal attention).
    slots: Tensor | None
    mask: Tensor | None


@dataclass(frozen=True)
class SdpaMeta:
    decode: _Decode | None
    prefills: tuple[_Prefill, ...]


def _slots(table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    return table.long()[positions // block_size] * block_size + positions % block_size


def _shared_blocks(tables: Tensor, lens: Tensor, block_size: int) -> int:
    """Leading blocks every row's table holds, each full of context before every row's
    last token (so each row keeps at least its own newest key)."""
    if tables.shape[0] < 2 or tables.shape[1] < MIN_SHARED_BLOCKS:
        return 0
    same = (tables == tables[:1]).all(0)  # [W]
    ends = (torch.arange(tables.shape[1], device=tables.device) + 1) * block_size
    full = ends <= lens.min() - 1
    n = int((same & full).long().cumprod(0).sum())
    return n if n >= MIN_SHARED_BLOCKS else 0


def _prepare_decode(
    group: DecodeGroup, block_size: int, window: int | None = None, paged: bool = False
) -> _Decode:
    device = group.block_tables.device
    if paged:  # no gathers, no masks: the kernel reads the pool
        empty = torch.empty(0, dtype=torch.long)
        lens = group.context_lens.long()
        tables = group.block_tables
        return _Decode(
            group.rows, empty, empty, group.is_all_rows, None, tables, lens, window or 0, block_size
        )
    tables = group.block_tables.long()
    lens = group.context_lens.long()[:, None]  # [B, 1]
    start = 0 if window else _shared_blocks(tables, lens, block_size) * block_size
    shared = None
    if start:
        shared = _slots(tables[0], torch.arange(start, device=device), block_size)
    keys = torch.arange(start, group.max_context, device=device)[None, :]  # [1, L]
    pos = torch.minimum(keys, lens - 1)  # [B, L]; padding repeats the last real slot
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    mask = keys < lens
    if window:
        mask = mask & (keys >= lens - window)
    mask = mask[:, None, None, :]
    return _Decode(group.rows, slots.flatten(), mask, group.is_all_rows, shared)


def _prepare_prefill(span: PrefillSpan, block_size: int, window: int | None = None) -> _Prefill:
    rows = slice(span.row_start, span.row_start + span.num_new)
    fresh = span.start_pos == 0
    if fresh and (window is None or span.num_new <= window):
        return _Prefill(rows, None, None)
    device = span.block_table.device
    ctx = torch.arange(span.context_len, device=device)
    pos = torch.arange(span.start_pos, span.context_len, device=device)
    # query i sits at position start_pos + i and sees keys 0..start_pos + i
    mask = ctx[None, :] <= pos[:, None]  # [num_new, ctx]
    if window:  # ... and of those the last `window` only
        mask = mask & (ctx[None, :] > pos[:, None] - window)
    slots = None if fresh else _slots(span.block_table, ctx, block_size)
    return _Prefill(rows, slots, mask)


class SdpaBackend:
    """`paged` (None: as `paged_cpu.enabled()` says, off by default): decode rows
    through the paged CPU kernel (`paged_cpu`), which reads each row's keys in the pool
    where they lie, instead of gathering them for SDPA."""

    name = "sdpa"

    def __init__(self, paged: bool | None = None) -> None:
        self.paged = paged

    def prepare(self, plan: BatchPlan, window: int | None = None) -> SdpaMeta:
        bs = plan.block_size
        if self.paged is None:
            self.paged = plan.input_ids.device.type == "cpu" and paged_cpu.enabled()
        decode = (
            None if plan.decode is None else _prepare_decode(plan.decode, bs, window, self.paged)
        )
        return SdpaMeta(decode, tuple(_prepare_prefill(p, bs, window) for p in plan.prefills))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: object
    ) -> Tensor:
        assert isinstance(meta, SdpaMeta)
        d = meta.decode
        if d is not None and d.is_all_rows:  # the steady state: every row is a decode
            return _decode_attention(q, k_cache, v_cache, d)
        out = torch.empty_like(q)  # [T, H, hd]; every row is written below
        if d is not None:
            out.index_copy_(0, d.rows, _decode_attention(q[d.rows], k_cache, v_cache, d))
        for p in meta.prefills:
            out[p.rows] = _prefill_attention(q[p.rows], k[p.rows], v[p.rows], k_cache, v_cache, p)
        return out


def _decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, d: _Decode) -> Tensor:
    """q: [B, H, hd] (one query per sequence) -> [B, H, hd]."""
    if d.tables is not None and d.lens is not None:  # the pool read in place, one call
        return paged_cpu.decode_attention(
            q, k_cache[None], v_cache[None], None, None, d.tables, d.lens, 0, d.block_size, d.window
        )
    if d.shared is not None:
        return _decode_attention_shared(q, k_cache, v_cache, d, d.shared)
    b, h, hd = q.shape
    kvh = k_cache.shape[1]
    # index_select on the flat slot list: on CPU about 15x faster than k_cache[slots]
    # with a 2-D index tensor.
    keys = _as(q, k_cache.index_select(0, d.slots)).view(b, -1, kvh, hd).transpose(1, 2)
    values = _as(q, v_cache.index_select(0, d.slots)).view(b, -1, kvh, hd).transpose(1, 2)
    # GQA without copying K/V: the query heads sharing a KV head become that head's
    # "query rows" (heads are grouped kv-major, as in repeat_interleave). Queries are
    # independent in attention, so this is exact.
    q_grouped = q.view(b, kvh, h // kvh, hd)  # [B, KVH, G, hd]
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=d.mask)
    return out.reshape(b, h, hd)


def _decode_attention_shared(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, d: _Decode, shared: Tensor
) -> Tensor:
    """`_decode_attention` for rows that share their first P keys: those are gathered
    once ([P, KVH, hd]) and scored against every row's query in one matmul."""
    b, h, hd = q.shape
    kvh = k_cache.shape[1]
    q_grouped = q.view(b, kvh, h // kvh, hd) * hd**-0.5  # [B, KVH, G, hd]
    k_shared = _as(q, k_cache.index_select(0, shared))  # [P, KVH, hd]
    v_shared = _as(q, v_cache.index_select(0, shared))
    k_own = _as(q, k_cache.index_select(0, d.slots)).view(b, -1, kvh, hd)  # [B, L, KVH, hd]
    v_own = _as(q, v_cache.index_select(0, d.slots)).view(b, -1, kvh, hd)
    scores_shared = torch.einsum("bkgd,pkd->bkgp", q_grouped, k_shared)  # [B, KVH, G, P]
    scores_own = torch.einsum("bkgd,blkd->bkgl", q_grouped, k_own)  # [B, KVH, G, L]
    scores_own = scores_own.masked_fill(~d.mask, float("-inf"))
    probs = torch.cat([scores_shared, scores_own], dim=-1).float().softmax(-1).to(q.dtype)
    p = shared.shape[0]
    out = torch.einsum("bkgp,pkd->bkgd", probs[..., :p], v_shared)
    out = out + torch.einsum("bkgl,blkd->bkgd", probs[..., p:], v_own)
    return out.reshape(b, h, hd)


def _prefill_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, p: _Prefill
) -> Tensor:
    """q: [n, H, hd] for one sequence's chunk -> [n, H, hd]."""
    if p.slots is None:  # chunk starts at position 0: its context is itself
        keys, values = k_new, v_new  # [n, KVH, hd]
    else:
        keys = _as(q, k_cache.index_select(0, p.slots))  # [ctx, KVH, hd]
        values = _as(q, v_cache.index_select(0, p.slots))
    group = q.shape[1] // keys.shape[1]
    keys = keys.transpose(0, 1)  # [KVH, ctx, hd]
    values = values.transpose(0, 1)
    if group > 1:
        keys = keys.repeat_interleave(group, dim=0)  # [H, ctx, hd]
        values = values.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [H, n, hd]
        keys,
        values,
        attn_mask=p.mask,
        is_causal=p.mask is None,
    )  # [H, n, hd]
    return out.transpose(0, 1)


def _as(q: Tensor, gathered: Tensor) -> Tensor:
    """Gathered keys or values in q's dtype (a float16 pool under a float32 model)."""
    return gathered if gathered.dtype == q.dtype else gathered.to(q.dtype)
