"""One engine tick's batch: which tokens belong to which sequence, and where their KV lives.

The model runs every projection over all T new tokens at once; only attention
needs to know the sequence boundaries. `BatchPlan.build` turns the list of
`SeqInput`s into the index tensors attention needs, once per forward (not once
per layer), so the layers themselves do no Python bookkeeping.
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


@dataclass(frozen=True)
class DecodeGroup:
    """All sequences with exactly one new token, attended in one padded call."""

    rows: Tensor  # [B] their rows in the flattened batch
    slots: Tensor  # [B, Lmax] context slots; padding repeats the row's own last slot
    mask: Tensor  # [B, 1, 1, Lmax] bool, True where the key is part of the row's context
    is_all_rows: bool  # rows == arange(T): no gather/scatter of q and output needed


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence with a chunk of several new tokens, attended on its own."""

    row_start: int  # first row in the flattened batch
    num_new: int
    # Context slots [start_pos + num_new] to read back from the pool, and the causal
    # mask [num_new, start_pos + num_new] shifted by start_pos. Both None for a
    # chunk starting at position 0: it attends to its fresh K/V with a plain causal mask.
    context_slots: Tensor | None
    mask: Tensor | None


@dataclass(frozen=True)
class BatchPlan:
    positions: Tensor  # [T] position of each new token
    write_slots: Tensor  # [T] pool slot each new token's K/V goes to
    last_rows: Tensor  # [S] row of each sequence's last new token, in `seqs` order
    decode: DecodeGroup | None
    prefills: tuple[PrefillSpan, ...]

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        num_tokens: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
    ) -> BatchPlan:
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        total = sum(s.num_new for s in seqs)
        if total != num_tokens:
            raise ValueError(f"input has {num_tokens} tokens but seqs claim {total}")

        # Positions and write slots are plain ints until one tensor each at the end:
        # a tensor per sequence costs more than the arithmetic (decode rows are 1 token).
        positions: list[int] = []
        write_slots: list[int] = []
        last_rows: list[int] = []
        decode_rows: list[int] = []
        decode_seqs: list[SeqInput] = []
        prefills: list[PrefillSpan] = []
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
                decode_seqs.append(s)
            elif s.start_pos == 0:
                prefills.append(PrefillSpan(row, s.num_new, None, None))
            else:
                bt = torch.tensor(used, dtype=torch.long)
                pos = torch.arange(s.start_pos, stop)
                ctx = torch.arange(stop)
                # query i sits at position start_pos + i and sees keys 0..start_pos + i
                mask = ctx[None, :] <= pos[:, None]  # [num_new, stop]
                prefills.append(
                    PrefillSpan(
                        row, s.num_new, _slots(bt, ctx, block_size).to(device), mask.to(device)
                    )
                )
            row += s.num_new

        return cls(
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            write_slots=torch.tensor(write_slots, dtype=torch.long).to(device),
            last_rows=torch.tensor(last_rows, dtype=torch.long).to(device),
            decode=_decode_group(decode_rows, decode_seqs, num_tokens, block_size, device),
            prefills=tuple(prefills),
        )


def _slots(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


def _decode_group(
    rows: list[int],
    seqs: list[SeqInput],
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> DecodeGroup | None:
    if not seqs:
        return None
    ctx_lens = torch.tensor([s.start_pos + 1 for s in seqs], dtype=torch.long)  # [B]
    max_len = int(ctx_lens.max())
    max_blocks = -(-max_len // block_size)
    padded = [
        s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
        for s in seqs
    ]
    tables = torch.tensor(padded, dtype=torch.long)  # [B, max_blocks]
    keys = torch.arange(max_len)[None, :]  # [1, Lmax]
    # Padding keys point at the row's own last real slot: the mask hides them, and
    # reading only the row's own blocks keeps other sequences' data out entirely.
    pos = torch.minimum(keys, ctx_lens[:, None] - 1)  # [B, Lmax]
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    mask = (keys < ctx_lens[:, None])[:, None, None, :]  # [B, 1, 1, Lmax]
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long).to(device),
        slots=slots.to(device),
        mask=mask.to(device),
        is_all_rows=len(rows) == num_tokens,
    )
