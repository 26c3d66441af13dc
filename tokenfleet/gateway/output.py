"""How one job is shown to its client: the seam between `Gateway.serve` (one request,
one job: submit, follow, cancel) and the shape of the answer.

Completions and chat completions are shown by `Rendered` (`openai.render.Renderer`: one
JSON body, or chunks and `data: [DONE]`); the Responses API by its own `Output`
(gateway/responses_api.py), which the same job machinery drives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokenfleet.openai.errors import ApiError
from tokenfleet.openai.render import DONE, Renderer
from tokenfleet.protocol import FinishEvent


class Output(Protocol):
    """One request's answer. Streamed: `opening` goes out with the first token (or with
    the end, when there is none), `delta` with every token's text, then `ended` or, for a
    failure after submit, `failed`. Not streamed: `answer` is the body. The async steps
    run before their bytes are sent, so whatever they record is there when the client
    has them."""

    job_id: str

    def opening(self) -> bytes: ...

    def delta(self, text: str) -> bytes: ...

    async def ended(self, finish: FinishEvent, include_usage: bool) -> bytes: ...

    async def failed(self, error: ApiError) -> bytes: ...

    async def answer(self, text: str, finish: FinishEvent) -> dict[str, Any]: ...


# What `Gateway.serve` makes a request's `Output` with: (job id, service tier) → Output.
OutputFactory = Callable[[str, str], Output]


class Rendered(Renderer):
    """Completions and chat completions as `Renderer` writes them; an error after submit
    is OpenAI's error event, then `data: [DONE]`."""

    async def ended(self, finish: FinishEvent, include_usage: bool) -> bytes:
        return self.closing(finish, include_usage)

    async def failed(self, error: ApiError) -> bytes:
        return error.sse() + DONE

    async def answer(self, text: str, finish: FinishEvent) -> dict[str, Any]:
        return self.body(text, finish).model_dump(mode="json")
