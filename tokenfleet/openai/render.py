"""Fleet events → OpenAI response bodies and server-sent-event chunks.

Finish reasons: `stop` → "stop", `length` → "length"; `deadline` → "length" (the
output was cut by the request's time budget, as `length` is a cut by its token
budget); `cancelled` → "stop" (someone else cancelled the job: the text so far
is complete as far as it goes). Every choice also carries `fleet_finish_reason`,
the fleet's own word. `rejected` and `error` never reach these functions: they
become HTTP errors (or an error event mid-stream), see `errors.from_finish`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from tokenfleet.openai.models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    UsageOut,
)
from tokenfleet.protocol import FinishEvent
from tokenfleet.reasons import FinishReason

OPENAI_FINISH_REASON: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.DEADLINE: "length",
    FinishReason.CANCELLED: "stop",
}

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic


def usage_of(finish: FinishEvent) -> UsageOut:
    u = finish.usage
    return UsageOut(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


def _sse(body: CompletionResponse | ChatCompletionChunk) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


@dataclass
class Renderer:
    """Builds one request's bodies. `kind` is the endpoint; `id` embeds the job id."""

    kind: Literal["completions", "chat"]
    job_id: str
    model: str
    created: int
    # chat bodies and chunks name the band the job ran in, as OpenAI's name their tier
    # ("default", "priority", "flex"); None: not said (null)
    service_tier: str | None = None

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.job_id}"

    def body(self, text: str, finish: FinishEvent) -> CompletionResponse | ChatCompletionResponse:
        reason = OPENAI_FINISH_REASON[finish.reason]
        if self.kind == "chat":
            return ChatCompletionResponse(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatChoice(
                        message=ChatMessageOut(content=text),
                        finish_reason=reason,
                        fleet_finish_reason=str(finish.reason),
                    )
                ],
                usage=usage_of(finish),
                service_tier=self.service_tier,
            )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    text=text, finish_reason=reason, fleet_finish_reason=str(finish.reason)
                )
            ],
            usage=usage_of(finish),
        )

    # ---- streaming ----------------------------------------------------------------

    def opening(self) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI's do); completions don't."""
        if self.kind != "chat":
            return b""
        return _sse(
            self._chat_chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))
        )

    def delta(self, text: str) -> bytes:
        """One token's chunk: the chunk's bytes around its text are rendered once per request
        (this runs for every token, so it is one json.dumps and two concatenations)."""
        head, tail = self._delta_template
        return head + json.dumps(text, ensure_ascii=False).encode() + tail

    @cached_property
    def _delta_template(self) -> tuple[bytes, bytes]:
        if self.kind == "chat":
            chunk = _sse(self._chat_chunk(ChatChunkChoice(delta=ChatDelta(content=""))))
            field = b'"content":'
        else:
            chunk = _sse(self._completion_chunk(CompletionChoice(text="", finish_reason=None)))
            field = b'"text":'
        head, tail = chunk.split(field + b'""', 1)
        return head + field, tail

    def closing(self, finish: FinishEvent, include_usage: bool) -> bytes:
        """The chunk carrying finish_reason, the usage chunk when asked for, and [DONE]."""
        reason = OPENAI_FINISH_REASON[finish.reason]
        fleet = str(finish.reason)
        last: ChatCompletionChunk | CompletionResponse
        usage: ChatCompletionChunk | CompletionResponse
        if self.kind == "chat":
            last = self._chat_chunk(
                ChatChunkChoice(delta=ChatDelta(), finish_reason=reason, fleet_finish_reason=fleet)
            )
            usage = self._chat_chunk(None, usage_of(finish))
        else:
            last = self._completion_chunk(
                CompletionChoice(text="", finish_reason=reason, fleet_finish_reason=fleet)
            )
            usage = self._completion_chunk(None, usage_of(finish))
        return _sse(last) + (_sse(usage) if include_usage else b"") + DONE

    def _chat_chunk(
        self, choice: ChatChunkChoice | None, usage: UsageOut | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice] if choice is not None else [],
            usage=usage,
            service_tier=self.service_tier,
        )

    def _completion_chunk(
        self, choice: CompletionChoice | None, usage: UsageOut | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice] if choice is not None else [],
            usage=usage,
        )
