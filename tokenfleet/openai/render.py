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
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, TypeVar

from tokenfleet.fleet import ServedModel
from tokenfleet.openai.models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
)
from tokenfleet.protocol import (
    FinishEvent,
    FunctionTool,
    PromptEcho,
    TokenEvent,
    TokenLogprob,
    ToolCall,
)
from tokenfleet.reasons import FinishReason
from tokenfleet.tools import DEFAULT_FORMAT, CallStream, ToolFormat, split_calls

OPENAI_FINISH_REASON: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.DEADLINE: "length",
    FinishReason.CANCELLED: "stop",
}

DONE = b"data: [DONE]\n\n"
_Choice = TypeVar("_Choice", ChatChunkChoice, CompletionChoice)
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic


def usage_of(finish: FinishEvent) -> UsageOut:
    u = finish.usage
    return UsageOut(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


def reads_calls(
    parsed: CompletionRequest | ChatCompletionRequest, served: ServedModel | None
) -> dict[str, Any]:
    """The `Renderer` fields that read tool calls out of the answer to `parsed`: its
    callable tools and how the model serving it writes calls (as its workers advertise;
    the Hermes convention when none is live)."""
    if not isinstance(parsed, ChatCompletionRequest):
        return {}
    tools = parsed.callable_tools()
    advertised = served.tool_format if served is not None else None
    known = {str(f) for f in ToolFormat}
    fmt = ToolFormat(advertised) if advertised in known else DEFAULT_FORMAT
    return {"tools": tools, "tool_format": fmt} if tools else {}


def echoes(parsed: CompletionRequest | ChatCompletionRequest, prompt: str | None) -> dict[str, Any]:
    """The `Renderer` fields that echo the prompt of a completions request that asks for
    it; `prompt`: its job's text prompt (None: token ids), echoed as it is when the worker
    sends none back (no logprobs asked)."""
    if not isinstance(parsed, CompletionRequest) or not parsed.echo:
        return {}
    asked = parsed.prompt_logprobs_asked() is not None
    return {"echo": True, "echo_text": None if asked else prompt, "logprobs": parsed.logprobs}


def _fn(call: ToolCall) -> dict[str, str]:
    return {"name": call.name, "arguments": call.arguments}


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(**_fn(call)))


def _at(choice: _Choice, index: int) -> _Choice:
    """`choice` (made with index 0) as choice `index` of its request."""
    return choice if index == 0 else choice.model_copy(update={"index": index})


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
    # the functions the answer may call (none: its text is all content), and how the
    # model writes calls (tokenfleet.tools)
    tools: Sequence[FunctionTool] = ()
    tool_format: ToolFormat = DEFAULT_FORMAT
    # which choice of its request this one is, in bodies and chunks (several choices:
    # n > 1 or several prompts, gateway/fanout.py)
    index: int = 0
    # completions' echo: the answer's text (and logprobs) begin with the prompt's, which
    # the job's first token event or its finish carries (`PromptEcho`), or, for a text
    # prompt without logprobs, `echo_text`; `logprobs`: the request's
    echo: bool = False
    echo_text: str | None = None
    logprobs: int | None = None
    _calls: CallStream | None = field(default=None, init=False, repr=False)
    _offset: int = field(default=0, init=False, repr=False)  # streamed completion text so far
    _echoed: bool = field(default=False, init=False, repr=False)  # the echo chunk went out

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.job_id}"

    def answer_of(
        self, tokens: Sequence[TokenEvent], finish: FinishEvent
    ) -> CompletionResponse | ChatCompletionResponse:
        """The non-streamed body of a job that emitted `tokens`, then ended with `finish`:
        with the tokens' logprobs when its job asked for them, and the prompt echoed
        first when the request asked for that."""
        text = "".join(e.text for e in tokens)
        logprobs = [e.logprobs for e in tokens if e.logprobs is not None]
        asked = bool(tokens) and len(logprobs) == len(tokens)
        prompt = tokens[0].prompt if tokens else finish.prompt
        return self.body(text, finish, logprobs if asked else None, prompt)

    def body(
        self,
        text: str,
        finish: FinishEvent,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt: PromptEcho | None = None,
    ) -> CompletionResponse | ChatCompletionResponse:
        """`logprobs`: one per token, when the request asked for them; `prompt`: the echo
        the worker sent (completions with echo)."""
        reason = OPENAI_FINISH_REASON[finish.reason]
        if self.kind == "chat":
            message = ChatMessageOut(content=text)
            if self.tools:
                split = split_calls(self.tool_format, text, self.tools, self.job_id)
                if split.calls:
                    message = ChatMessageOut(
                        content=split.content, tool_calls=[_call_out(c) for c in split.calls]
                    )
                    reason = "tool_calls"
            return ChatCompletionResponse(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatChoice(
                        index=self.index,
                        message=message,
                        logprobs=None if logprobs is None else chat_logprobs(logprobs),
                        finish_reason=reason,
                        fleet_finish_reason=str(finish.reason),
                    )
                ],
                usage=usage_of(finish),
                service_tier=self.service_tier,
            )
        lp = None if logprobs is None else completion_logprobs(logprobs)
        if self.echo:
            head, head_lp = self._echo_parts(prompt)
            if self.logprobs is not None:
                lp = _joined(head_lp, completion_logprobs(logprobs or [], len(head)))
            text = head + text
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=self.index,
                    text=text,
                    logprobs=lp,
                    finish_reason=reason,
                    fleet_finish_reason=str(finish.reason),
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
        (this runs for every token, so it is one json.dumps and two concatenations). With
        tools, text that may begin a call is held back until the end (`closing`)."""
        if self.tools and self.kind == "chat":
            text = self._call_stream().feed(text)
            if not text:
                return b""
        head, tail = self._delta_template
        return head + json.dumps(text, ensure_ascii=False).encode() + tail

    def _echo_parts(self, prompt: PromptEcho | None) -> tuple[str, CompletionLogprobs]:
        """The echoed prompt's text and logprobs (the first token's are null, as OpenAI's)."""
        if prompt is None:
            return self.echo_text or "", completion_logprobs([])
        first = TokenLogprob(logprob=0.0, token=prompt.first_token)
        lp = completion_logprobs([first, *prompt.logprobs])
        lp.token_logprobs[0] = None
        lp.top_logprobs[0] = None
        return prompt.text, lp

    def echoed(self, prompt: PromptEcho | None) -> bytes:
        """The echo's chunk, once, before the first token's (or the end's): b"" after it
        went out, or when the request asked for no echo."""
        if not self.echo or self._echoed:
            return b""
        self._echoed = True
        text, lp = self._echo_parts(prompt)
        self._offset += len(text)
        logprobs = lp if self.logprobs is not None else None
        if not text and logprobs is None:
            return b""
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=None)
        return _sse(self._completion_chunk(choice))

    def token(self, event: TokenEvent) -> bytes:
        """One token event's chunk (b"" when it has nothing to say): its text, and its
        logprobs when the job asked for them (then every token gets a chunk); the echo's
        chunk before the first."""
        echo = self.echoed(event.prompt) if self.echo else b""
        if event.logprobs is None:
            return echo + (self.delta(event.text) if event.text else b"")
        if self.kind == "completions":
            lp = completion_logprobs([event.logprobs], self._offset)
            self._offset += len(event.logprobs.token)
            choice = CompletionChoice(text=event.text, logprobs=lp, finish_reason=None)
            return echo + _sse(self._completion_chunk(choice))
        text = self._call_stream().feed(event.text) if self.tools else event.text
        delta = ChatChunkChoice(
            delta=ChatDelta(content=text), logprobs=chat_logprobs([event.logprobs])
        )
        return _sse(self._chat_chunk(delta))

    def _call_stream(self) -> CallStream:
        if self._calls is None:
            self._calls = CallStream(self.tool_format, self.tools, self.job_id)
        return self._calls

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
        calls = self.echoed(finish.prompt)  # a job that emitted no token: echo now
        if self.kind == "chat" and self.tools:
            rest, found = self._call_stream().finish()
            if rest:
                head, tail = self._delta_template
                calls += head + json.dumps(rest, ensure_ascii=False).encode() + tail
            if found:
                deltas = [
                    ToolCallDelta(index=i, id=c.id, function=FunctionCallOut(**_fn(c)))
                    for i, c in enumerate(found)
                ]
                calls += _sse(self._chat_chunk(ChatChunkChoice(delta=ChatDelta(tool_calls=deltas))))
                reason = "tool_calls"
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
        return calls + _sse(last) + (_sse(usage) if include_usage else b"") + DONE

    def _chat_chunk(
        self, choice: ChatChunkChoice | None, usage: UsageOut | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[] if choice is None else [_at(choice, self.index)],
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
            choices=[] if choice is None else [_at(choice, self.index)],
            usage=usage,
        )


# ---- logprobs -------------------------------------------------------------------------


def _top_out(token: str, logprob: float) -> TopLogprobOut:
    return TopLogprobOut(token=token, logprob=logprob, bytes=list(token.encode()))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """Chat's `logprobs`: per token its text, logprob, UTF-8 bytes and the top ones."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode()),
                top_logprobs=[_top_out(text, lp) for _, lp, text in e.top],
            )
            for e in entries
        ]
    )


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """Completions' `logprobs`; `offset`: where the first token's text starts (the
    token texts before it, when streaming). Two top tokens with the same text keep
    the likelier one's logprob (a dict by text, as OpenAI's shape is)."""
    offsets: list[int] = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{text: lp for _, lp, text in reversed(e.top)} for e in entries],
        text_offset=offsets,
    )
