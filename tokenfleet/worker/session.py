"""One job inside the engine: its request, emitted tokens, text stream, finish and timings.

The session is the one record of a job's output: `emitted` (token ids, also the
scheduler's `SeqState.output_ids`, the same list) and `events` (one `TokenEvent`
per emitted token, built once, published as is). Everything it produces goes
through `accept`, one sampled token at a time, and `accept` alone decides when
the job ends (stop token, stop string, length). A resumed session (crash
recovery) rebuilds exactly the state the dead worker had by replaying the tokens
it already emitted through the same path, without emitting them again.

`terminal` builds every terminal message (finish event + stored result): the
engine's finishes and rejections and the worker's dead letters alike.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.grammar import grammar_failed, unmet
from tokenfleet.keys import band_rank
from tokenfleet.model.detokenizer import IncrementalDetokenizer
from tokenfleet.protocol import (
    ErrorInfo,
    FinishEvent,
    GenerationRequest,
    JobResult,
    PromptEcho,
    Structured,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.seam import ResolvedSampling, SeqState
from tokenfleet.worker.stops import StopStrings


@dataclass(frozen=True)
class Finished:
    """A job that ended: its terminal event and the result to store."""

    event: FinishEvent
    result: JobResult

    @property
    def job_id(self) -> str:
        return self.event.job_id


@dataclass
class Outbox:
    """What is to be published for one job: its token events from `sent` on, then its
    terminal outcome (`end`, set by the engine when it decided one). The engine hands
    one out per job (`Engine.outbox`); the worker loop sends what it holds and records
    what Redis confirmed. `events` is the session's own list (the engine appends to it;
    nothing else writes it)."""

    events: Seq[TokenEvent]
    sent: int = 0  # token indices the job's replay stream holds, as the last publish said
    end: Finished | None = None
    first: int = field(init=False)  # `sent` when the job came here: its first new token
    # Durable mode (a Redis with replicas): `safe`, the indices a replica acknowledged
    # (a WAIT after the tick that wrote them); `announced`, those published to clients.
    # Events a worker before this one wrote are announced by the hash's `durable` once
    # this worker's first WAIT covers them, not published again.
    safe: int = 0
    announced: int = field(init=False)

    def __post_init__(self) -> None:
        self.first = self.sent
        self.announced = self.sent

    def unsent(self) -> list[TokenEvent]:
        return list(self.events[self.sent :])

    def due(self, flush: bool, durable: bool = False) -> bool:
        """Whether its events go out this tick: on a flush tick (every tick, or every
        --stream-interval'th: the worker's, one for all its jobs), when its outcome is
        decided, or when its first token here waits (time to first token is never held
        back). In durable mode also when acknowledged events wait to be announced."""
        waiting = len(self.events) - self.sent
        if self.end is not None:
            return True
        if durable and self.safe > self.announced:
            return True
        return waiting > 0 and (flush or self.sent <= self.first)

    def in_tick(self, flush: bool, durable: bool = False) -> bool:
        """Whether the job is in this tick's fenced round trip: when it is `due`, or, on a
        flush tick, for the owner and cancel checks alone (every job, every tick, at
        interval 1). Between flushes a job is checked only when it sends: its cancel is
        seen within the interval."""
        return self.due(flush, durable) or flush

    def confirm(self, next_index: int) -> None:
        """Redis holds indices 0..next_index-1 now."""
        self.sent = next_index

    def acknowledged(self, announced: int, next_index: int, replicated: bool) -> None:
        """Durable mode, after a round trip that was not refused: the events up to
        `announced` are out to clients; when its WAIT counted enough replicas, they hold
        indices 0..next_index-1, which the next round trip announces."""
        self.announced = max(self.announced, announced)
        if replicated:
            self.safe = max(self.safe, next_index)

    def to_announce(self) -> list[TokenEvent]:
        """Durable mode: the acknowledged events not published yet."""
        return list(self.events[self.announced : self.safe])

    def settled(self) -> bool:
        """Durable mode: every event is acknowledged, so the end may go out."""
        return self.safe >= len(self.events)

    def rewind(self) -> None:
        """After a lost connection: send every event again (tick.lua appends only the
        indices the replay stream lacks)."""
        self.sent = 0

    @property
    def dirty(self) -> bool:
        """Something decided for the job is not in Redis yet."""
        return len(self.events) > self.sent or self.end is not None


def terminal(
    job_id: str,
    reason: FinishReason,
    worker: str | None,
    *,
    error: ErrorInfo | None = None,
    events: Seq[TokenEvent] = (),
    usage: Usage | None = None,
    timings: Timings | None = None,
    prompt: PromptEcho | None = None,
) -> Finished:
    """The terminal event and stored result of a job; the result's text is always the
    concatenation of its token events' texts. `prompt` (echo) goes into the result, and
    into the finish event when no token event carried it."""
    usage = usage or Usage()
    timings = timings or Timings()
    event = FinishEvent(
        job_id=job_id,
        reason=reason,
        usage=usage,
        timings=timings,
        error=error,
        worker=worker,
        prompt=None if events else prompt,
    )
    result = JobResult(
        job_id=job_id,
        text="".join(e.text for e in events),
        token_ids=[e.token_id for e in events],
        finish_reason=reason,
        usage=usage,
        timings=timings,
        error=error,
        worker=worker,
        logprobs=_all_logprobs(events),
        prompt=prompt,
    )
    return Finished(event, result)


def _all_logprobs(events: Seq[TokenEvent]) -> list[TokenLogprob] | None:
    """Every event's logprobs, or None unless each has them (a job that asked none, or
    one resumed from events that carried none)."""
    found = [e.logprobs for e in events if e.logprobs is not None]
    return found if events and len(found) == len(events) else None


@dataclass
class Session:
    request: GenerationRequest
    prompt_ids: list[int]
    sampling: ResolvedSampling
    detok: IncrementalDetokenizer | None  # None: the model has no tokenizer (ids only)
    stop_ids: frozenset[int]
    submitted_at: float  # unix seconds, from the job's state (for timings)
    scratch_bytes: int
    seq: SeqState | None = None  # set once admitted into the scheduler
    recomputed: int = 0  # of seq.num_cached, tokens the runner computed again (usage)
    emitted: list[int] = field(default_factory=list)  # token ids of events 0..n-1
    events: list[TokenEvent] = field(default_factory=list)
    admitted_at: float | None = None
    first_token_at: float | None = None
    # content addresses of the full blocks of prompt + emitted tokens before the last
    # one (prefix caching; computed once, when admission first looks)
    block_hashes: list[bytes] | None = None
    # structured output: the job's grammar state (an llguidance LLMatcher), fed every
    # emitted token; None for a job without one
    matcher: Any = None
    grammar: Structured | None = None  # what `matcher` holds it to (a job's or its tools')
    # why a structured job ended `rejected` mid-way: its output does not satisfy its
    # grammar (grammar.unmet); None otherwise
    end_error: ErrorInfo | None = None
    # prefix caching: which jobs may share this one's cached blocks (tenants.cache_scope:
    # its tenant's, or the cache group its tenant was given)
    cache_scope: str = ""
    # priority bands on the worker (bands.py): when it began to wait here (arrival or
    # preemption), how often it was put back, and the emitted count before which it must
    # not be put back again (None: it may be)
    band: int = field(init=False)  # the rank of the band it runs in (keys.band_rank)
    waiting_since: float = 0.0
    preemptions: int = 0
    protect_until: int | None = None
    # echo (`sampling.prompt_logprobs`): the prompt's text and first token's, and the
    # logprobs of prompt tokens 1, 2, ... as the prefill reported them (`record_prompt`)
    prompt_text: str = ""
    first_token_text: str = ""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    _stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self._stops = StopStrings(self.request.stop)
        self.band = band_rank(self.request.priority)  # the engine may say another

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def echoes(self) -> bool:
        """Whether the job asked for its prompt's logprobs."""
        return self.request.sampling.prompt_logprobs is not None

    def record_prompt(self, first: int, logprobs: Seq[TokenLogprob]) -> None:
        """Prompt tokens first, first + 1, ...'s logprobs, from a prefill chunk; those
        already known (a chunk computed again after a preemption) are kept as they are."""
        for position, entry in enumerate(logprobs, start=first):
            if position == len(self.prompt_logprobs) + 1:
                self.prompt_logprobs.append(entry)

    def echo(self) -> PromptEcho | None:
        """The prompt's echo, once every prompt token's logprob is known (None before, and
        for a job that asked none)."""
        if not self.echoes or len(self.prompt_logprobs) < len(self.prompt_ids) - 1:
            return None
        return PromptEcho(
            text=self.prompt_text,
            first_token=self.first_token_text,
            logprobs=self.prompt_logprobs,
        )

    def accept(
        self, token_id: int, logprobs: TokenLogprob | None = None
    ) -> tuple[TokenEvent | None, FinishReason | None]:
        """Take one sampled token: its event (None for a stop token) and whether it ends the job.
        `logprobs` (when the job asked for them) go into its event as they are.

        A stop token id (or end-of-sequence, unless `ignore_eos`) ends the job as
        `stop` and is not part of the output; a completed stop string ends it as
        `stop` with the text cut just before the stop string. A structured job ends
        `stop` only when its output satisfies its grammar, else `rejected` (`end_error`).
        """
        if token_id in self.stop_ids:
            return None, self._stop(f"stop token {token_id}", cut=False)
        grammar_done = False
        if self.matcher is not None:
            if not self.matcher.consume_token(token_id):
                self.end_error = grammar_failed(self.matcher)
                return None, FinishReason.REJECTED
            grammar_done = self.matcher.is_stopped()  # nothing but end-of-sequence may follow
        index = len(self.emitted)
        delta = self.detok.feed(token_id) if self.detok is not None else ""
        text, stopped = self._stops.push(delta)
        reason: FinishReason | None = FinishReason.STOP if stopped else None
        if reason is None and grammar_done:
            reason = FinishReason.STOP
            text += self._trailing_text()
        if reason is None and index + 1 >= self.max_new_tokens:
            reason = FinishReason.LENGTH
            text += self._trailing_text()  # the last event carries whatever was held back
        event = TokenEvent(
            job_id=self.job_id,
            index=index,
            token_id=token_id,
            text=text,
            logprobs=logprobs,
            prompt=self.echo() if index == 0 else None,
        )
        self.emitted.append(token_id)  # both or neither, should the text handling raise
        self.events.append(event)
        if reason is FinishReason.STOP and self.matcher is not None:
            reason = self._stop("a stop string" if stopped else "the grammar's end", cut=stopped)
        return event, reason

    def _stop(self, why: str, *, cut: bool) -> FinishReason:
        """`stop`, unless the job's output does not satisfy its grammar: `rejected`, with
        `end_error` saying why. `cut`: a stop string cut the text short of the tokens."""
        if self.matcher is None or self.grammar is None:
            return FinishReason.STOP
        text = "".join(e.text for e in self.events) if cut else None
        self.end_error = unmet(self.matcher, self.grammar, why, text)
        return FinishReason.STOP if self.end_error is None else FinishReason.REJECTED

    def _trailing_text(self) -> str:
        """Text held back (partial characters, possible stop-string prefixes) at the end."""
        tail = self.detok.flush() if self.detok is not None else ""
        held, _ = self._stops.push(tail)
        return held + self._stops.flush()

    def finish(
        self, reason: FinishReason, now: float, worker: str | None, error: ErrorInfo | None = None
    ) -> Finished:
        """The terminal outcome; a job cut short (cancel, deadline, error) drops the text
        still held back."""
        timings = Timings(
            queued_s=None if self.admitted_at is None else self.admitted_at - self.submitted_at,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
            total_s=now - self.submitted_at,
        )
        cached = 0 if self.seq is None else min(self.seq.num_cached, len(self.prompt_ids))
        cached = max(0, cached - self.recomputed)
        usage = Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.emitted),
            cached_tokens=cached,
        )
        if error is None and reason is FinishReason.REJECTED:
            error = self.end_error
        return terminal(
            self.job_id,
            reason,
            worker,
            error=error,
            events=self.events,
            usage=usage,
            timings=timings,
            prompt=self.echo(),
        )
