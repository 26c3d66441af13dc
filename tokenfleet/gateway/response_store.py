"""Finished Responses API responses in Redis, so any gateway replica can return one
(`GET /v1/responses/ID`) or continue its conversation (`previous_response_id`).

One key per response, `P response:ID` (keys.py), a JSON string: the Response object,
the conversation's input items (everything before its output, so the next turn is
`input + output + new input`), its owning tenant and job. Written once, when the job
has ended (never while it runs), with `EX response_ttl_s` (a day by default,
`TOKENFLEET_GATEWAY_RESPONSE_TTL_S`): Redis memory is the price of `store: true`, which
is OpenAI's default, so stored conversations expire sooner than OpenAI's 30 days.

A response belongs to the tenant of the API key that made it: another tenant is told it
does not exist (`NotFound`), as the batch store does.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aredis
from pydantic import BaseModel, ConfigDict

from tokenfleet.batch.store import NotFound
from tokenfleet.keys import Keys
from tokenfleet.openai.responses import ResponseObject, job_of


class StoredResponse(BaseModel):
    """What `P response:ID` holds."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    job_id: str
    response: ResponseObject
    input: list[dict[str, Any]]  # the conversation's input items, as a client sends them


class ResponseStore:
    def __init__(self, client: aredis.Redis, keys: Keys, ttl_s: int) -> None:
        self.r = client
        self.keys = keys
        self.ttl_s = ttl_s

    async def put(self, stored: StoredResponse) -> None:
        await self.r.set(
            self.keys.response(stored.response.id), stored.model_dump_json(), ex=self.ttl_s
        )

    async def get(self, response_id: str, tenant: str) -> StoredResponse:
        """The stored response; NotFound when there is none (never stored, expired,
        deleted, an id this gateway never makes) or `tenant` does not own it."""
        raw = None
        if job_of(response_id) is not None:
            raw = await self.r.get(self.keys.response(response_id))
        if raw is None:
            raise NotFound(f"no response {response_id!r}")
        stored = StoredResponse.model_validate_json(raw)
        if stored.tenant != tenant:
            raise NotFound(f"no response {response_id!r}")  # another tenant's
        return stored

    async def delete(self, response_id: str, tenant: str) -> None:
        """Delete it; NotFound as `get`."""
        await self.get(response_id, tenant)
        await self.r.delete(self.keys.response(response_id))
