"""The batch-invariant backend (`--deterministic`): a row's attention output does not
depend on the other rows of the tick, nor on how its sequence's prompt was chunked or
found in the prefix cache, nor on whether the row is a decode step or part of a prefill.

`SdpaBackend` is not like that on the CPU (torch 2.13, measured in docs/operations.md):
`scaled_dot_product_attention`'s result for one query changes with the padded key length
(decode rows are padded to the tick's longest context), with the number of query rows
(one row takes another kernel than a chunk), and decode rows sharing a cached prefix take
a separate path (`_decode_attention_shared`). Here every query row, of any kind, runs
the same three steps over its own sequence's keys, gathered from position 0 and padded
to whole blocks of `KEY_BLOCK` keys:

    scores = q @ K.T            model dtype, one dot product of head_dim per (query, key)
    probs  = softmax(scores)    float32; keys after the query's position (or before its
                                window, or padding) are -inf: probability exactly 0
    out    = probs @ V          model dtype; the padded keys add exact zeros

Those matmuls give the same bits for a (query, key) pair whatever the number of query
rows and whatever (zero-weighted) keys follow: `tokenfleet.model.deterministic` checks
this on the machine when the mode is switched on, and refuses the mode where it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenfleet.model.tick_inputs import BatchPlan, DecodeGroup, PrefillSpan

KEY_BLOCK = 64  # keys are gathered in whole blocks of this many, from position 0


def _padded(n: int) -> int:
    return -(-n // KEY_BLOCK) * KEY_BLOCK


@dataclass(frozen=True)
class _Rows:
    """Query rows attending over one key list each: decode rows (one query per sequence,
    B sequences) or one prefill chunk (B = 1, R queries of one sequence)."""

    rows: Tensor | slice  # their rows in the tick's flat batch
    slots: Tensor  # [B * L] key slots, row-major, L a multiple of KEY_BLOCK
    mask: Tensor  # [B, 1, 1, R, L] True where query r sees key l
    batch: int  # B


@dataclass(frozen=True)
class ExactMeta:
    decode: _Rows | None
    is_all_rows: bool  # the decode rows are the whole tick
    prefills: tuple[_Rows, ...]


def _slots(tables: Tensor, keys: Tensor, lens: Tensor, block_size: int) -> Tensor:
    """tables [B, W], keys [L], lens [B, 1] -> [B, L] slots (past a row's context, its
    last real slot again: masked, and always a finite value)."""
    pos = torch.minimum(keys[None, :], lens - 1)
    return tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def _prepare_decode(group: DecodeGroup, block_size: int, window: int | None) -> _Rows:
    keys = torch.arange(_padded(group.max_context), device=group.block_tables.device)
    lens = group.context_lens.long()[:, None]  # [B, 1]
    mask = keys[None, :] < lens  # [B, L]
    if window:
        mask = mask & (keys[None, :] >= lens - window)
    slots = _slots(group.block_tables, keys, lens, block_size)
    return _Rows(group.rows, slots.flatten(), mask[:, None, None, None, :], int(lens.shape[0]))


def _prepare_prefill(span: PrefillSpan, block_size: int, window: int | None) -> _Rows:
    device = span.block_table.device
    keys = torch.arange(_padded(span.context_len), device=device)
    pos = torch.arange(span.start_pos, span.context_len, device=device)[:, None]  # [R, 1]
    mask = keys[None, :] <= pos  # [R, L]
    if window:
        mask = mask & (keys[None, :] > pos - window)
    lens = torch.tensor([[span.context_len]], device=device)
    slots = _slots(span.block_table[None, :], keys, lens, block_size)
    rows = slice(span.row_start, span.row_start + span.num_new)
    return _Rows(rows, slots.flatten(), mask[None, None, None], 1)


class ExactBackend:
    name = "exact"

    def prepare(self, plan: BatchPlan, window: int | None = None) -> ExactMeta:
        bs = plan.block_size
        decode = None if plan.decode is None else _prepare_decode(plan.decode, bs, window)
        is_all = plan.decode is not None and plan.decode.is_all_rows
        prefills = tuple(_prepare_prefill(p, bs, window) for p in plan.prefills)
        return ExactMeta(decode, is_all, prefills)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: object
    ) -> Tensor:
        """Every row reads its keys from the caches (this tick's k/v are written there
        already), so a chunk's own keys and cached ones go the same way."""
        assert isinstance(meta, ExactMeta)
        d = meta.decode
        if d is not None and meta.is_all_rows:
            return _attend(q, k_cache, v_cache, d)
        out = torch.empty_like(q)  # [T, H, hd]; every row is written below
        if d is not None:
            assert isinstance(d.rows, Tensor)
            out.index_copy_(0, d.rows, _attend(q[d.rows], k_cache, v_cache, d))
        for p in meta.prefills:
            out[p.rows] = _attend(q[p.rows], k_cache, v_cache, p)
        return out


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, r: _Rows) -> Tensor:
    """q [B * R, H, hd] -> [B * R, H, hd]: R queries of each of B sequences."""
    n, h, hd = q.shape
    b, kvh = r.batch, k_cache.shape[1]
    g, rows = h // kvh, n // r.batch
    # [B, L, KVH, hd] -> [B, KVH, L, hd]. Every operand is made contiguous in one layout:
    # the matmul's kernel (and its summation order) follows the operands' strides, and
    # a view's strides vary with B (measured: a decode row beside another one got other
    # bits than alone when the keys stayed a strided view).
    keys = k_cache.index_select(0, r.slots).to(q.dtype)  # (a float16 pool: to q's dtype)
    values = v_cache.index_select(0, r.slots).to(q.dtype)
    keys = keys.view(b, -1, kvh, hd).transpose(1, 2).contiguous()
    values = values.view(b, -1, kvh, hd).transpose(1, 2).contiguous()
    # GQA: the G query heads of a KV head and the R queries are that head's query rows.
    # q: [B, R, KVH, G, hd] -> [B, KVH, G * R, hd]
    qg = q.view(b, rows, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * rows, hd)
    qg = qg.contiguous()
    scores = bmm(qg, keys.transpose(2, 3)).float() * hd**-0.5  # [B, KVH, G*R, L]
    scores = scores.view(b, kvh, g, rows, -1).masked_fill(~r.mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(b, kvh, g * rows, -1)  # contiguous
    out = bmm(probs, values)  # [B, KVH, G * R, hd]
    return out.view(b, kvh, g, rows, hd).permute(0, 3, 1, 2, 4).reshape(n, h, hd)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """a [..., M, K] @ b [..., K, N], never as a one-row product: where M is 1 (a decode
    row of a model with one query head per KV head) a zero row is added. A one-row
    product may take a matrix-vector kernel that sums K in another order (measured on
    an AVX-512 EPYC Zen 4: probs @ V over 4,096 keys, 3 of 40 rows other bits alone)."""
    if a.shape[-2] != 1:
        return torch.matmul(a, b)
    return torch.matmul(F.pad(a, (0, 0, 0, 1)), b)[..., :1, :].contiguous()
