"""Stop strings over streamed text: hold back what could still become a stop string.

A delta is released only once no stop string can start inside it, so when a
stop string completes, everything before it has been (or is now) released and
nothing after it ever is: concatenated deltas equal the final text, which ends
just before the stop string (the stop string itself is not part of the output).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit now, whether a stop string completed)."""
        if not self.stops:
            return delta, False
        held = self._held + delta
        hits = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = self._partial_suffix(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """Release what is held (the job ended for another reason)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
