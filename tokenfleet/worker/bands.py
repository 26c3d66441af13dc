"""Priority bands on one worker: which waiting job starts next, which running one may be
put back, and which have waited here too long. Pure: no Redis, no torch.

Bands are strict priorities (keys.BANDS, interactive first), with three promises on top
so that no sustained load of a higher band starves a lower one on a worker:

1. **A share of generated tokens.** While a lower band has work here (a session running
   or waiting), it is owed `band_share` of every token the worker generates and pays one
   for each token of its own: a deficit counter (`BandShares`), bounded to
   ±`burst_tokens`, starting at −`burst_tokens` when the band's work arrives. A band
   owed more than nothing is *starved*: its waiting jobs start before every band that is
   not (preempting one if no slot is free), and its sessions are put back by nobody. So
   over any stretch of sustained higher-band load, the band gets at least `band_share`
   of the tokens, less the bound of the counter. The counter, not aging: an aged job
   gets a slot once and may lose it again; a deficit bounds the band's share of tokens
   itself, which is what a user of the band waits on.
2. **Progress before a second preemption.** A session that was put back once, or that
   started because its band was starved, is not put back again before it has generated
   `progress_tokens` tokens since it started: a job can lose its slot, but never spend
   its turns re-prefilling.
3. **Round robin within a band.** Jobs of one band start in the order they began to
   wait here (a preempted session from the moment it was put back), so every job of a
   starved band gets turns, not only the first.

The fourth promise is the worker's: a job not started within `hold_s` of waiting here
goes back to its band's stream for another worker (`overdue`; the loop re-queues it),
except the band's next job in line, which the share starts here; and a worker holding
no job of a band with jobs waiting in the fleet takes one (pull.lua's floor), so that
every worker's share has work to act on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenfleet.keys import BANDS
from tokenfleet.worker.session import Session

__all__ = ["BandPolicy", "BandShares", "FairnessConfig", "band_of"]

STARVED = -1  # the effective rank of a starved band's jobs: ahead of every band


@dataclass(frozen=True)
class FairnessConfig:
    band_share: float = 1 / 16  # each lower band's least share of generated tokens
    burst_tokens: int = 16  # bound of the deficit counters (tokens)
    progress_tokens: int = 16  # generated before a once-preempted job can be put back again
    hold_s: float = 10.0  # a job waiting here longer goes back to its stream

    def __post_init__(self) -> None:
        if not 0 < self.band_share < 1:
            raise ValueError(f"band_share must be in (0, 1), got {self.band_share}")
        if self.burst_tokens < 1 or self.progress_tokens < 1:
            raise ValueError("burst_tokens and progress_tokens must be >= 1")
        if self.hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {self.hold_s}")


def band_of(session: Session) -> int:
    """The rank of the session's band (keys.BANDS): 0 (interactive) ranks first."""
    return session.band


class BandShares:
    """One deficit counter per band below the top (see the module docstring, 1)."""

    def __init__(self, config: FairnessConfig, num_bands: int = len(BANDS)) -> None:
        self.config = config
        self.credit = [-float(config.burst_tokens)] * num_bands
        self.generated = [0] * num_bands  # tokens generated per band, since start

    def record(self, generated: list[int], busy: list[bool]) -> None:
        """After a tick: `generated[b]` tokens of band b, `busy[b]` whether b has work."""
        total = sum(generated)
        bound = float(self.config.burst_tokens)
        for band, count in enumerate(generated):
            self.generated[band] += count
            if band == 0:
                continue
            if not busy[band]:
                self.credit[band] = -bound
                continue
            owed = self.credit[band] + self.config.band_share * total - count
            self.credit[band] = min(bound, max(-bound, owed))

    def starved(self, band: int) -> bool:
        return band > 0 and self.credit[band] > 0


class BandPolicy:
    """The worker's order between bands, from the shares; the engine asks it."""

    def __init__(self, config: FairnessConfig | None = None) -> None:
        self.config = config or FairnessConfig()
        self.shares = BandShares(self.config)

    def rank(self, session: Session) -> int:
        """Where the session's jobs stand now: its band, or STARVED."""
        band = band_of(session)
        return STARVED if self.shares.starved(band) else band

    def next_to_start(self, waiting: Iterable[Session]) -> Session | None:
        """The waiting session to start first: starved bands, then by band, then the one
        that has waited longest."""
        return min(
            waiting,
            key=lambda s: (self.rank(s), band_of(s), s.waiting_since),
            default=None,
        )

    def protected(self, session: Session) -> bool:
        """Not to be put back yet: it started after a preemption (or out of starvation)
        and has not generated `progress_tokens` since."""
        return session.protect_until is not None and len(session.emitted) < session.protect_until

    def victim(self, rank: int, running: Iterable[Session]) -> Session | None:
        """The running session a job of effective rank `rank` may put back: of those that
        rank below it and are not protected, the lowest band's with the least computed;
        None when there is none. Jobs of one rank never put each other back, so two
        bands cannot take turns throwing each other out."""
        lower = [s for s in running if self.rank(s) > rank and not self.protected(s)]
        return max(
            lower,
            key=lambda s: (self.rank(s), -(s.seq.num_computed if s.seq is not None else 0)),
            default=None,
        )

    def on_start(self, session: Session) -> None:
        """A session starts (or resumes): protect it if it was hurt before."""
        if session.preemptions > 0 or self.shares.starved(band_of(session)):
            session.protect_until = len(session.emitted) + self.config.progress_tokens
        else:
            session.protect_until = None

    def record_tick(self, generated: list[int], sessions: Iterable[Session]) -> None:
        busy = [False] * len(BANDS)
        for s in sessions:
            busy[band_of(s)] = True
        self.shares.record(generated, busy)

    def overdue(self, waiting: Iterable[Session], now: float) -> list[Session]:
        """Waiting sessions not started within `hold_s` of beginning to wait here, except
        each band's next in line: that one the band's share starts here (the band must
        keep work on the worker for its deficit to count), the others would wait for it."""
        held = list(waiting)
        first: dict[int, Session] = {}
        for s in held:
            band = band_of(s)
            if band not in first or s.waiting_since < first[band].waiting_since:
                first[band] = s
        keep = {id(s) for s in first.values()}
        return [
            s for s in held if id(s) not in keep and now - s.waiting_since >= self.config.hold_s
        ]

    def telemetry(self) -> dict[str, object]:
        return {
            "band_tokens": dict(zip(BANDS, self.shares.generated, strict=True)),
            "band_credit": {
                band: round(credit, 2)
                for band, credit in zip(BANDS[1:], self.shares.credit[1:], strict=True)
            },
            "band_share": self.config.band_share,
        }
