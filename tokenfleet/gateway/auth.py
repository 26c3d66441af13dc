"""API keys: who a request is (its tenant) and what priority it gets by default.

Each configured key entry is `KEY`, `KEY=TENANT` or `KEY=TENANT:PRIORITY` (PRIORITY one
of `keys.BANDS`). A plain `KEY` is tenant `default` at priority `default`. The tenant
part is split off at the *last* `=` (a tenant name has none), so a key that itself
contains `=` (base64 padding) must name its tenant: `abc==` is refused, `abc===default`
is the key `abc==`. With no keys configured there is no auth and every request is
tenant `default`.

Keys are secrets: nothing here puts one in a message, a repr or a log; a bad entry is
named by its position.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from starlette.requests import Request

from tokenfleet.keys import BANDS, DEFAULT_TENANT, TENANT_PATTERN, valid_tenant
from tokenfleet.openai.errors import unauthorized
from tokenfleet.protocol import Priority


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as its API key says."""

    tenant: str = DEFAULT_TENANT
    priority: Priority = "default"  # the band of a request that asks for none


ANONYMOUS = Caller()  # every request of a gateway without keys


@dataclass(frozen=True)
class ApiKey:
    token: str = field(repr=False)
    caller: Caller = ANONYMOUS


def parse_api_key(entry: str, position: int = 1) -> ApiKey:
    """One key entry (`KEY`, `KEY=TENANT`, `KEY=TENANT:PRIORITY`); ValueError naming the
    entry by `position` (1-based), never by its key."""
    where = f"API key entry #{position}"
    token, sep, grant = entry.rpartition("=")
    if not sep:
        token, grant = entry, ""
    if not token:
        raise ValueError(f"{where}: the key is empty (want KEY, KEY=TENANT or KEY=TENANT:PRIORITY)")
    if not sep:
        return ApiKey(token)
    tenant, colon, priority = grant.partition(":")
    if not tenant:
        raise ValueError(
            f"{where}: no tenant after '=' (a key that contains '=' must be written "
            "KEY=TENANT, e.g. KEY=default)"
        )
    if not valid_tenant(tenant):
        raise ValueError(f"{where}: tenant {tenant!r} does not match {TENANT_PATTERN}")
    if not colon:
        return ApiKey(token, Caller(tenant))
    if priority not in BANDS:
        raise ValueError(f"{where}: priority {priority!r} is not one of {', '.join(BANDS)}")
    return ApiKey(token, Caller(tenant, priority))


def parse_api_keys(entries: tuple[str, ...]) -> tuple[ApiKey, ...]:
    """Every entry parsed; one key given twice with different grants is an error."""
    parsed: dict[str, ApiKey] = {}
    for position, entry in enumerate(entries, start=1):
        key = parse_api_key(entry, position)
        known = parsed.get(key.token)
        if known is not None and known.caller != key.caller:
            raise ValueError(
                f"API key entry #{position}: the same key is given earlier with another "
                f"tenant or priority ({known.caller.tenant}:{known.caller.priority})"
            )
        parsed[key.token] = key
    return tuple(parsed.values())


class KeyCheck:
    """The `/v1/*` dependency: with keys configured, `Authorization: Bearer KEY` must be
    one of them (else 401); the request's `Caller` is left on `request.state.caller`."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = [(key.token.encode(), key.caller) for key in keys]

    async def __call__(self, request: Request) -> None:
        request.state.caller = self.caller(request.headers.get("authorization", ""))

    def caller(self, header: str) -> Caller:
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        given = token.strip().encode()
        # compare with every key, always: the time taken says nothing about which matched
        found: Caller | None = None
        for key, caller in self._keys:
            if hmac.compare_digest(given, key):
                found = caller
        if found is None:
            raise unauthorized("invalid API key")
        return found


def caller_of(request: Request) -> Caller:
    """The request's caller as `KeyCheck` left it (ANONYMOUS on a route without it)."""
    caller = getattr(request.state, "caller", ANONYMOUS)
    assert isinstance(caller, Caller)
    return caller


__all__ = [
    "ANONYMOUS",
    "ApiKey",
    "Caller",
    "KeyCheck",
    "caller_of",
    "parse_api_key",
    "parse_api_keys",
]
