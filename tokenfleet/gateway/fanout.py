"""Several choices in one request: `n` > 1, or several prompts on /v1/completions.

Each choice is its own fleet job (fenced, resumable, cancellable like any job), and
they are all submitted together; choice i of prompt p is choice `p * n + i` of the
answer, as OpenAI numbers them. The one-job path (`Gateway.serve`) is untouched:
`Gateway.generate` sends a request here only when it asks for more than one choice.

* **Seeds.** With `seed`, choice i of every prompt gets `choice_seed(seed, i)` =
  `(seed + i) mod 2**63`: choice 0 is a plain request with the same seed, and each
  choice is what a single request with its own prompt and derived seed would give.
  Without one, every job draws its own random seed, as a single job does.
* **Usage.** `prompt_tokens` counts each prompt once (as OpenAI does), not once per
  choice; `completion_tokens` is every choice's; `cached_tokens` is, per prompt, the
  least any of its choices found cached: what the prompt cost once (the other choices'
  hits are the fleet sharing the prompt between them, which the worker does by itself:
  worker/scheduler.py, `_look_up`).
* **Answers.** Not streamed: one body, the choices by index, usage summed as above.
  Streamed: the choices' chunks interleaved as their tokens arrive, each with its
  `index`; each choice's finish chunk when it ends; after the last, the usage chunk
  (when asked) and one `data: [DONE]`.
* **Failures.** A choice whose job fails (rejected, error, a queue timeout, a lost job)
  fails the request as a single job's would, and the other jobs are cancelled; so does
  a client hanging up. The `X-Tokenfleet-Job-Id` header names choice 0's job (the
  response's `id` is made from it), `X-Tokenfleet-Job-Ids` every choice's, by index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from tokenfleet.errors import JobLost
from tokenfleet.gateway.auth import caller_of
from tokenfleet.gateway.failures import CLIENT_GONE, job_lost
from tokenfleet.gateway.jobs import ClientGone, Event, EventStreamResponse, JobEvents, QueueTimeout
from tokenfleet.gateway.metrics import RequestTally
from tokenfleet.gateway.output import Rendered
from tokenfleet.openai.errors import ApiError
from tokenfleet.openai.fields import IGNORED_HEADER, ignored_fields
from tokenfleet.openai.models import (
    SERVICE_TIER_OF,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageOut,
)
from tokenfleet.openai.render import DONE, KEEPALIVE, echoes, reads_calls
from tokenfleet.protocol import MAX_SEED, FinishEvent, GenerationRequest, TokenEvent

if TYPE_CHECKING:  # the gateway calls in here (Gateway.generate)
    from tokenfleet.gateway.service import Gateway, Kind

Parsed = CompletionRequest | ChatCompletionRequest
JOB_IDS_HEADER = "X-Tokenfleet-Job-Ids"
log = logging.getLogger(__name__)


def prompts_of(parsed: Parsed) -> list[str | list[int]] | None:
    """A completions request's prompts, one a choice group (None: chat, whose one prompt
    is its messages)."""
    if not isinstance(parsed, CompletionRequest):
        return None
    value: Any = parsed.prompt
    several = isinstance(value, list) and value and isinstance(value[0], str | list)
    return list(value) if several else [value]


def fans_out(parsed: Parsed) -> bool:
    """Whether `parsed` asks for more than one choice (validation checked the limits)."""
    return (parsed.n or 1) > 1 or len(prompts_of(parsed) or ()) > 1


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: `seed` for choice 0, the next ones after it (wrapping at 2**63)."""
    return (seed + i) % (MAX_SEED + 1)


def choice_requests(parsed: Parsed) -> list[Parsed]:
    """One single-choice request per choice, in index order (p * n + i)."""
    n = parsed.n or 1
    out: list[Parsed] = []
    prompts: Sequence[str | list[int] | None] = prompts_of(parsed) or [None]
    for prompt in prompts:
        for i in range(n):
            update: dict[str, Any] = {"n": None}
            if prompt is not None:
                update["prompt"] = prompt
            if parsed.seed is not None:
                update["seed"] = choice_seed(parsed.seed, i)
            out.append(parsed.model_copy(update=update))
    return out


def usage_of_choices(finishes: Sequence[FinishEvent], n: int) -> UsageOut:
    """The request's usage from its choices' (by index, `n` a prompt; module docstring)."""
    groups = [finishes[p : p + n] for p in range(0, len(finishes), n)]
    prompt = sum(group[0].usage.prompt_tokens for group in groups)
    cached = sum(min(f.usage.cached_tokens for f in group) for group in groups)
    completion = sum(f.usage.completion_tokens for f in finishes)
    return UsageOut(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


@dataclass
class ChoiceRendered(Rendered):
    """One choice's bodies and chunks: rendered for its own job (tool-call ids are made
    from it), under the request's id (choice 0's job) and with its `index`."""

    request_job_id: str = ""

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_job_id}"


@dataclass
class _Choice:
    index: int
    job: GenerationRequest
    events: JobEvents
    out: ChoiceRendered
    submitted: bool = False


class _Merged:
    """Every choice's events in the order they arrive, as (index, event): one reader task
    per job, and (not streamed) one watching for the client to hang up. A reader's error
    comes out of `next` as it would out of that job's `JobEvents.next`."""

    def __init__(self, choices: Sequence[_Choice], receive: Receive | None) -> None:
        self._queue: asyncio.Queue[tuple[int, Event | Exception]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._read(c.index, c.events)) for c in choices]
        if receive is not None:
            self._tasks.append(asyncio.create_task(self._watch(receive)))

    async def _read(self, index: int, events: JobEvents) -> None:
        try:
            while True:
                event = await events.next()
                assert event is not None  # no timeout given
                self._queue.put_nowait((index, event))
                if isinstance(event, FinishEvent):
                    return
        except Exception as exc:
            self._queue.put_nowait((index, exc))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._queue.put_nowait((-1, ClientGone()))

    async def next(self, timeout: float | None = None) -> tuple[int, Event] | None:
        """The next event of any choice; None when `timeout` seconds pass first."""
        try:
            async with asyncio.timeout(timeout):
                index, item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, Exception):
            raise item
        return index, item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def serve_choices(
    gw: Gateway, request: Request, parsed: Parsed, kind: Kind, arrived: float
) -> Response:
    """A request for several choices as one job each (module docstring)."""
    served = await gw._route(parsed.model)
    max_tokens = gw._max_tokens(parsed, served)
    caller = caller_of(request)
    jobs = [gw._job(one, kind, max_tokens, served, caller) for one in choice_requests(parsed)]
    created = int(time.time())
    tier = SERVICE_TIER_OF[jobs[0].priority]
    calls = reads_calls(parsed, served)
    choices = [
        _Choice(
            index,
            job,
            JobEvents(
                gw.producer.handle(job.job_id),
                gw.subscriber,
                gw.canceller,
                None,  # the hang-up watch is the request's, one for all (`_Merged`)
                queue_timeout_s=gw.config.queue_timeout_s,
                outage_s=gw.config.redis_outage_s,
            ),
            ChoiceRendered(
                kind,
                job.job_id,
                parsed.model,
                created,
                tier,
                **calls,
                **echoes(parsed, job.prompt),
                index=index,
                request_job_id=jobs[0].job_id,
            ),
        )
        for index, job in enumerate(jobs)
    ]
    try:
        await asyncio.gather(*(c.events.subscribed(gw.config.redis_wait_s) for c in choices))
        for choice in choices:  # one EVALSHA each; a refusal refuses the request
            await gw._submit(choice.job, parsed.model, served)
            choice.submitted = True
    except BaseException:
        with anyio.CancelScope(shield=True):
            for choice in choices:  # the ones already submitted are cancelled
                await choice.events.close(cancel=choice.submitted)
        raise
    fan = _FanOut(gw, parsed, choices, RequestTally(gw.metrics, parsed.model, arrived))
    headers = {
        "X-Tokenfleet-Job-Id": jobs[0].job_id,
        JOB_IDS_HEADER: ",".join(job.job_id for job in jobs),
    }
    ignored = ignored_fields(parsed)
    if ignored:
        headers[IGNORED_HEADER] = ", ".join(ignored)
        log.warning(
            "%s %s: ignored fields %s (jobs %s)",
            request.method,
            request.url.path,
            ", ".join(ignored),
            headers[JOB_IDS_HEADER],
        )
    if parsed.stream:  # the status line goes now: whatever fails later is an event
        merged = _Merged(choices, None)  # Starlette watches a stream's connection
        response: Response = EventStreamResponse(
            fan.stream(merged, parsed.include_usage), on_close=lambda: fan.close(merged)
        )
        response.headers.update(headers)
        return response
    merged = _Merged(choices, request.receive)
    try:
        body = await fan.collect(merged)
    except ClientGone:
        await fan.close(merged)
        return Response(status_code=CLIENT_GONE)
    except (QueueTimeout, JobLost, ApiError) as exc:
        await fan.close(merged)
        if isinstance(exc, QueueTimeout):
            error = gw._queue_timeout(exc.timeout_s, parsed.model)
        else:
            error = job_lost(exc) if isinstance(exc, JobLost) else exc
        error.headers.update(headers)
        raise error from None
    except BaseException:
        await fan.close(merged)
        raise
    await fan.close(merged)
    return JSONResponse(body, headers=headers)


class _FanOut:
    """Follows one request's choices to their ends: collected into one body, or streamed."""

    def __init__(
        self, gw: Gateway, parsed: Parsed, choices: list[_Choice], tally: RequestTally
    ) -> None:
        self.gw = gw
        self.n = parsed.n or 1
        self.kind = choices[0].out.kind
        self.choices = choices
        self.tally = tally

    async def close(self, merged: _Merged) -> None:
        """Always run, shielded: every job not finished is cancelled in the fleet."""
        with anyio.CancelScope(shield=True):
            await merged.aclose()
            for choice in self.choices:
                await choice.events.close()
                if choice.events.cancelled:
                    self.gw.metrics.cancelled.labels(self.tally.model).inc()
        ends = [c.events.finished_at for c in self.choices if c.events.finished_at is not None]
        last = max(ends) if len(ends) == len(self.choices) else None
        self.tally.ended([c.events.finish for c in self.choices], last)

    def _failure(self, finish: FinishEvent, tokens_seen: bool) -> ApiError | None:
        """The HTTP error a choice's end means (as a single job's would), or None."""
        return self.gw._failure(finish, self.tally.model, tokens_seen=tokens_seen)

    async def collect(self, merged: _Merged) -> dict[str, Any]:
        """The one JSON body; a failed choice raises its error (the caller cancels the rest)."""
        tokens: list[list[TokenEvent]] = [[] for _ in self.choices]
        finishes: dict[int, FinishEvent] = {}
        while len(finishes) < len(self.choices):
            got = await merged.next()
            assert got is not None  # no timeout given
            index, event = got
            if isinstance(event, TokenEvent):
                self.tally.token(streamed=False)
                tokens[index].append(event)
                continue
            failure = self._failure(event, bool(tokens[index]))
            if failure is not None:
                raise failure
            finishes[index] = event
        bodies = [c.out.answer_of(tokens[c.index], finishes[c.index]) for c in self.choices]
        ended = [finishes[c.index] for c in self.choices]
        merged_body = bodies[0].model_copy(
            update={
                "choices": [b.choices[0] for b in bodies],
                "usage": usage_of_choices(ended, self.n),
            }
        )
        return merged_body.model_dump(mode="json")

    async def stream(self, merged: _Merged, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body (module docstring); a failure is an error event, then [DONE]."""
        opened: set[int] = set()  # choices whose opening chunk went out
        seen: set[int] = set()  # choices that had a token
        finishes: dict[int, FinishEvent] = {}
        first = self.choices[0].out
        while True:
            try:
                got = await merged.next(timeout=self.gw.config.keepalive_s)
            except Exception as exc:
                error = self.gw.stream_failure(exc, self.tally.model, first.id)
                if error is not None:
                    yield await first.failed(error)
                return
            if got is None:
                yield KEEPALIVE
                continue
            index, event = got
            out = self.choices[index].out
            head = b"" if index in opened else out.opening()
            opened.add(index)
            if isinstance(event, TokenEvent):
                self.tally.token(streamed=True)
                seen.add(index)
                chunk = out.token(event)
                if chunk or head:
                    yield head + chunk
                continue
            failure = self._failure(event, index in seen)
            if failure is not None:
                yield await out.failed(failure)
                return
            finishes[index] = event
            closing = out.closing(event, False)
            assert closing.endswith(DONE)  # the request's one [DONE] comes after the last
            tail = b""
            if len(finishes) == len(self.choices):
                if include_usage:
                    ended = [finishes[c.index] for c in self.choices]
                    tail += self._usage_chunk(usage_of_choices(ended, self.n))
                tail += DONE
            yield head + closing.removesuffix(DONE) + tail
            if tail:
                return

    def _usage_chunk(self, usage: UsageOut) -> bytes:
        first = self.choices[0].out
        chunk: ChatCompletionChunk | CompletionResponse
        if self.kind == "chat":
            chunk = ChatCompletionChunk(
                id=first.id,
                created=first.created,
                model=first.model,
                choices=[],
                usage=usage,
                service_tier=first.service_tier,
            )
        else:
            chunk = CompletionResponse(
                id=first.id, created=first.created, model=first.model, choices=[], usage=usage
            )
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"
