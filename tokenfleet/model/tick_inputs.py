"""One engine tick's batch: which tokens belong to which sequence, and where their KV lives.

The model runs every projection over all T new tokens at once; only attention
needs to know the sequence boundaries. `TickBuffers.build` turns the list of
`SeqInput`s into the index tensors attention needs, once per forward (not once
per layer), so the layers themselves do no Python bookkeeping.

The index tensors are written into buffers allocated once and reused every tick
(host buffers pinned and copied to the device without blocking when the model is
not on the CPU), so a static-shape runner, or a CUDA graph, can replay a tick on
the same tensors. What they hold is backend-neutral: flat positions and write
slots, an int32 block table and a context length per sequence. Each attention
backend derives what its kernels want from them (`tokenfleet.model.attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SeqInput:
    """One sequence's slice of this tick's flattened input.

    `block_table` must cover positions [0, start_pos + num_new).
    """

    block_table: list[int]
    start_pos: int  # position of its first new token (= tokens already in the KV cache)
    num_new: int  # 1 for decode, a chunk length for prefill


def decode_rows(seqs: Sequence[SeqInput], block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """A decode-only tick (one new token per seq) for the paged kernels: each row's block
    table up to its new token's block, zero-padded to the widest (int32 [B, W]), its new
    token's position (int64 [B]) and the pool slot its K/V go to (int64 [B])."""
    width = max(s.start_pos // block_size + 1 for s in seqs)
    rows: list[list[int]] = []
    slots: list[int] = []
    for s in seqs:
        p = s.start_pos
        used = s.block_table[: p // block_size + 1]
        rows.append(used + [0] * (width - len(used)))
        slots.append(used[-1] * block_size + p % block_size)
    positions = torch.tensor([s.start_pos for s in seqs], dtype=torch.long)
    return torch.tensor(rows, dtype=torch.int32), positions, torch.tensor(slots, dtype=torch.long)


@dataclass(frozen=True)
class DecodeGroup:
    """All sequences with exactly one new token: attended together."""

    rows: Tensor  # [B] their rows in the flattened batch
    block_tables: Tensor  # [B, W] int32 block ids, padded with 0 past each row's context
    context_lens: Tensor  # [B] int32 keys each row attends over (its position + 1)
    max_context: int  # max(context_lens), known on the host
    is_all_rows: bool  # rows == arange(T): no gather/scatter of q and output needed


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence with a chunk of several new tokens, attended on its own."""

    row_start: int  # first row in the flattened batch
    num_new: int
    start_pos: int  # tokens of this sequence already in the cache before the chunk
    block_table: Tensor  # [W] int32; covers start_pos + num_new positions

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_new


@dataclass(frozen=True)
class BatchPlan:
    input_ids: Tensor  # [T] the new tokens, concatenated in `seqs` order
    positions: Tensor  # [T] position of each new token
    write_slots: Tensor  # [T] pool slot each new token's K/V goes to
    last_rows: Tensor  # [S] row of each sequence's last new token, in `seqs` order
    block_size: int
    decode: DecodeGroup | None
    prefills: tuple[PrefillSpan, ...]


class TickBuffers:
    """Reusable index buffers for one model: grown when a tick needs more, never shrunk."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._flat = self._alloc((0,), torch.long)  # ids | positions | slots | last | rows
        self._tables = self._alloc((0, 0), torch.int32)  # [rows, W] block tables
        self._lens = self._alloc((0,), torch.int32)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        host = torch.zeros(shape, dtype=dtype, pin_memory=self._pin)
        if self.device.type == "cpu":
            return host, host  # no staging: the model reads the host tensors
        return host, torch.zeros(shape, dtype=dtype, device=self.device)

    def _stage(
        self, which: tuple[Tensor, Tensor], values: Tensor, shape: tuple[int, ...]
    ) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """Copy `values` into the (grown if needed) host buffer, then to the device."""
        host, dev = which
        if any(n > have for n, have in zip(shape, host.shape, strict=True)):
            grown = tuple(max(n, 2 * have, 8) for n, have in zip(shape, host.shape, strict=True))
            host, dev = self._alloc(grown, host.dtype)
        index = tuple(slice(0, n) for n in shape)
        host[index].copy_(values.view(shape))
        if dev is not host:
            dev[index].copy_(host[index], non_blocking=True)
        return (host, dev), dev[index]

    def build(
        self,
        input_ids: Tensor | Sequence[int],
        seqs: Sequence[SeqInput],
        block_size: int,
        num_blocks: int,
    ) -> BatchPlan:
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
        num_tokens = len(ids)
        total = sum(s.num_new for s in seqs)
        if total != num_tokens:
            raise ValueError(f"input has {num_tokens} tokens but seqs claim {total}")

        # Plain ints until one staged tensor at the end: a tensor per sequence costs
        # more than the arithmetic (decode rows are 1 token).
        positions: list[int] = []
        write_slots: list[int] = []
        last_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        spans: list[tuple[int, int, int]] = []  # row_start, num_new, start_pos
        row = 0
        for s in seqs:
            stop = s.start_pos + s.num_new
            if s.num_new < 1 or s.start_pos < 0:
                raise ValueError(f"bad SeqInput: start_pos={s.start_pos}, num_new={s.num_new}")
            used = s.block_table[: -(-stop // block_size)]
            if len(used) * block_size < stop:
                raise ValueError(
                    f"block table of {len(s.block_table)} blocks cannot hold position {stop - 1}"
                )
            if min(used) < 0 or max(used) >= num_blocks:
                raise ValueError(f"block table {used} has ids outside the pool's {num_blocks}")
            span = range(s.start_pos, stop)
            positions.extend(span)
            write_slots.extend(used[p // block_size] * block_size + p % block_size for p in span)
            last_rows.append(row + s.num_new - 1)
            if s.num_new == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(stop)
            else:
                spans.append((row, s.num_new, s.start_pos))
                prefill_tables.append(used)
            row += s.num_new

        flat = [*ids, *positions, *write_slots, *last_rows, *decode_rows]
        self._flat, staged = self._stage(self._flat, torch.tensor(flat), (len(flat),))
        t, n = num_tokens, len(last_rows)
        input_t, pos_t, slots_t = staged[:t], staged[t : 2 * t], staged[2 * t : 3 * t]
        last_t, rows_t = staged[3 * t : 3 * t + n], staged[3 * t + n :]

        tables = decode_tables + prefill_tables
        width = max(len(b) for b in tables)
        padded = [b + [0] * (width - len(b)) for b in tables]
        self._tables, tables_t = self._stage(
            self._tables, torch.tensor(padded, dtype=torch.int32), (len(tables), width)
        )
        decode: DecodeGroup | None = None
        b = len(decode_rows)
        if b:
            self._lens, lens_t = self._stage(
                self._lens, torch.tensor(decode_lens, dtype=torch.int32), (b,)
            )
            decode = DecodeGroup(
                rows_t, tables_t[:b], lens_t, max(decode_lens), is_all_rows=b == num_tokens
            )
        prefills = tuple(
            PrefillSpan(r, k, start, tables_t[b + i]) for i, (r, k, start) in enumerate(spans)
        )
        return BatchPlan(input_t, pos_t, slots_t, last_t, block_size, decode, prefills)
