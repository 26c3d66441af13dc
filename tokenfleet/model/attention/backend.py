"""The attention backend interface and the registry of implementations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from tokenfleet.model.tick_inputs import BatchPlan


class AttentionBackend(Protocol):
    """Attention over a paged KV cache for one tick's mixed decode + prefill batch."""

    name: str

    def prepare(self, plan: BatchPlan, window: int | None = None) -> object:
        """Per-forward metadata for `attend` (index tensors, masks), built once per tick.
        With `window`, for sliding-window layers: a query at position p sees the keys at
        positions p - window + 1 .. p only."""

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: object
    ) -> Tensor:
        """q [T, H, hd], this tick's k/v [T, KVH, hd] (already written to the caches, which
        are flat [slots, KVH, hd] views of one layer) -> attention output [T, H, hd]."""


def _sdpa() -> AttentionBackend:
    from tokenfleet.model.attention.sdpa import SdpaBackend

    return SdpaBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"sdpa": _sdpa}


def get_backend(name: str) -> AttentionBackend:
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r} (have: {', '.join(BACKENDS)})")
    return factory()
