"""Cached prompt blocks are a tenant's own (issue 21, part 1): through the gateway with
two API keys mapped to two tenants, tenant B sending tenant A's prompt finds nothing in
the prefix cache (`usage.prompt_tokens_details.cached_tokens` is 0: the side channel is
closed), while A's own repeat hits; an operator's `cache_group` lets tenants share; a
`cache_salt` still partitions within a tenant. Real redis-server, a real worker."""

from __future__ import annotations

import openai

from tests.helpers.gateway import GatewayEnv, gateway_env
from tests.helpers.support import KEYS
from tokenfleet.tenants import set_limits

API_KEYS = ("key-a=alpha", "key-b=beta", "key-c=gamma")


class Env(GatewayEnv):
    def cached(self, key: str, prompt: str, salt: str | None = None) -> int:
        """The cached prompt tokens `key`'s tenant gets for `prompt` (a completion)."""
        client: openai.OpenAI = self.gateway.client(key)
        extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
        done = client.completions.create(
            model="default", prompt=prompt, max_tokens=2, extra_body=extra
        )
        assert done.usage is not None and done.usage.prompt_tokens > 4 * 16
        details = done.usage.prompt_tokens_details
        return 0 if details is None else int(details.cached_tokens or 0)


env = gateway_env([("cache-w", [])], env_type=Env, api_keys=API_KEYS)


def _prompt(tag: str) -> str:
    """A long prompt (tiny-random's tokenizer: one token per byte), unique per tag."""
    return f"[{tag}] " + "the system prompt that everyone of a company sends first. " * 4


def test_another_tenant_never_hits_a_tenants_cached_prompt(env: Env) -> None:
    prompt = _prompt("private")
    assert env.cached("key-a", prompt) == 0
    assert env.cached("key-a", prompt) > 0  # the cache works: alpha's repeat hits
    assert env.cached("key-b", prompt) == 0  # beta learns nothing of what alpha sent
    assert env.cached("key-b", prompt) > 0  # ... but its own repeat hits in its own scope


def test_tenants_an_operator_puts_in_one_cache_group_share_and_no_one_else(env: Env) -> None:
    set_limits(env.r, KEYS, "alpha", cache_group="org")
    set_limits(env.r, KEYS, "gamma", cache_group="org")
    try:
        prompt = _prompt("shared")
        assert env.cached("key-a", prompt) == 0
        assert env.cached("key-c", prompt) > 0  # gamma, same group: shares alpha's blocks
        assert env.cached("key-b", prompt) == 0  # beta is in no group
    finally:
        set_limits(env.r, KEYS, "alpha", clear=True)
        set_limits(env.r, KEYS, "gamma", clear=True)


def test_a_group_in_the_defaults_covers_every_tenant_without_its_own(env: Env) -> None:
    set_limits(env.r, KEYS, None, cache_group="everyone")
    set_limits(env.r, KEYS, "gamma", cache_group="own-room")
    try:
        prompt = _prompt("fleet-wide")
        assert env.cached("key-a", prompt) == 0
        assert env.cached("key-b", prompt) > 0  # both fall back to the default group
        assert env.cached("key-c", prompt) == 0  # gamma's own group wins over the default
    finally:
        set_limits(env.r, KEYS, None, clear=True)
        set_limits(env.r, KEYS, "gamma", clear=True)


def test_salts_still_partition_within_a_tenant(env: Env) -> None:
    prompt = _prompt("salted")
    assert env.cached("key-a", prompt, salt="s1") == 0
    assert env.cached("key-a", prompt, salt="s1") > 0
    assert env.cached("key-a", prompt, salt="s2") == 0
    assert env.cached("key-a", prompt) == 0  # unsalted is a partition of its own
    assert env.cached("key-b", prompt, salt="s1") == 0  # a salt never crosses tenants
