"""One job inside the engine: its request, sequence, sampler, text stream and timings.

Everything a session produces goes through `accept`, one sampled token at a
time, so a resumed session (crash recovery) rebuilds exactly the state the
dead worker had by replaying the tokens it already emitted through the same
path, without emitting them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.model import IncrementalDetokenizer, SamplingState
from tokenfleet.protocol import (
    ErrorInfo,
    FinishEvent,
    GenerationRequest,
    JobResult,
    Timings,
    TokenEvent,
    Usage,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.worker.scheduler import Sequence
from tokenfleet.worker.stops import StopStrings


@dataclass
class Session:
    request: GenerationRequest
    prompt_ids: list[int]
    sampling: SamplingState
    detok: IncrementalDetokenizer | None  # None: the model has no tokenizer (ids only)
    stop_ids: frozenset[int]
    submitted_at: float  # unix seconds, from the job's state (for timings)
    scratch_bytes: int
    seq: Sequence | None = None  # set once admitted into the scheduler
    emitted: list[int] = field(default_factory=list)  # token ids of events 0..n-1
    text_parts: list[str] = field(default_factory=list)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    _stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self._stops = StopStrings(self.request.stop)

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    def accept(self, token_id: int) -> tuple[TokenEvent | None, FinishReason | None]:
        """Take one sampled token: its event (None for a stop token) and whether it ends the job.

        A stop token id (or end-of-sequence, unless `ignore_eos`) ends the job as
        `stop` and is not part of the output; a completed stop string ends it as
        `stop` with the text cut just before the stop string.
        """
        if token_id in self.stop_ids:
            return None, FinishReason.STOP
        index = len(self.emitted)
        self.emitted.append(token_id)
        delta = self.detok.feed(token_id) if self.detok is not None else ""
        text, stopped = self._stops.push(delta)
        reason: FinishReason | None = FinishReason.STOP if stopped else None
        if reason is None and len(self.emitted) >= self.max_new_tokens:
            reason = FinishReason.LENGTH
            text += self._trailing_text()  # the last event carries whatever was held back
        self.text_parts.append(text)
        return TokenEvent(job_id=self.job_id, index=index, token_id=token_id, text=text), reason

    def _trailing_text(self) -> str:
        """Text held back (partial characters, possible stop-string prefixes) at the end."""
        tail = self.detok.flush() if self.detok is not None else ""
        held, _ = self._stops.push(tail)
        return held + self._stops.flush()

    def finish(
        self, reason: FinishReason, now: float, worker: str | None, error: ErrorInfo | None = None
    ) -> tuple[FinishEvent, JobResult]:
        """The terminal event and stored result.

        The result's text is always the concatenation of the token events' texts; a
        job cut short (cancel, deadline, error) drops what was still held back.
        """
        self.finish_reason = reason
        self.error = error
        usage = Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.emitted))
        timings = Timings(
            queued_s=None if self.admitted_at is None else self.admitted_at - self.submitted_at,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
            total_s=now - self.submitted_at,
        )
        event = FinishEvent(
            job_id=self.job_id,
            reason=reason,
            usage=usage,
            timings=timings,
            error=error,
            worker=worker,
        )
        result = JobResult(
            job_id=self.job_id,
            text="".join(self.text_parts),
            token_ids=list(self.emitted),
            finish_reason=reason,
            usage=usage,
            timings=timings,
            error=error,
            worker=worker,
        )
        return event, result
