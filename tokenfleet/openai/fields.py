"""Which request fields the gateway ignores, and which it refuses with a reason.

The policy (docs/http.md, "Request fields", is the table of every field):

* **honoured**: a field of `CompletionRequest` / `ChatCompletionRequest` that the job
  carries out (`max_tokens`, `stop`, `response_format`, `user` into the job's metadata…).
* **ignored**: accepted, type-checked, and not acted on, because it cannot change the
  output (`IGNORED`). A request that carries one gets one warning log line naming them
  and the response header `X-Tokenfleet-Ignored-Fields: a, b` (`ignored_fields`).
* **refused**: what the fleet would otherwise silently not honour: a 400 whose `param`
  names the field. OpenAI's and vLLM's fields the fleet does not implement say why
  (`REFUSED`, code `unsupported_parameter`); any other field is unknown
  (`unknown_parameter`).

This module owns those lists; the request models declare the ignored fields (typed, so
`store: "yes"` is still a 400) and tests/test_gateway_fields.py checks that the models,
these lists and docs/http.md agree.
"""

from __future__ import annotations

from pydantic import BaseModel

IGNORED_HEADER = "X-Tokenfleet-Ignored-Fields"

# Accepted and not acted on: field (`stream_options.KEY` inside stream_options) → why
# the output is the same either way.
IGNORED: dict[str, str] = {
    "store": "chat: the gateway stores no completions (there is no stored-completions API)",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "prompt_cache_key": "a hint for OpenAI's cache routing; the fleet's prefix cache needs "
    "none (`cache_salt` is what isolates it)",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prediction": "chat: predicted outputs only speed up OpenAI's decoding; the text is the same",
    "stream_options.include_obfuscation": "random padding against length side channels, "
    "which the gateway does not add",
}
# stream_options keys the gateway acts on; any other key in it is ignored (and named)
STREAM_OPTIONS_HONOURED = frozenset({"include_usage"})

# Fields of OpenAI's API or of vLLM's that the fleet does not implement → why (the 400's
# message). Not fields of the request models: they reach the parser as extra inputs.
REFUSED: dict[str, str] = {
    "modalities": "only text output is served (omit modalities)",
    "audio": "audio output is not served",
    "reasoning_effort": "the fleet's models have no separate reasoning to budget",
    "verbosity": "the fleet's models take no verbosity setting",
    "web_search_options": "the fleet has no web search",
    "min_tokens": "vLLM's min_tokens is not implemented (ignore_eos and max_tokens are)",
    "min_p": "vLLM's min_p is not implemented (top_k and top_p are)",
    "skip_special_tokens": "vLLM's skip_special_tokens is not implemented: the worker's "
    "detokenizer decides",
    "include_stop_str_in_output": "vLLM's include_stop_str_in_output is not implemented: "
    "the text always ends before the stop string",
    "add_generation_prompt": "the worker's chat template always adds the generation prompt",
    "continue_final_message": "vLLM's continue_final_message is not implemented",
    "chat_template": "the worker renders messages with its model's own chat template",
    "chat_template_kwargs": "the worker's chat template takes no arguments",
    "guided_decoding_backend": "structured output has one backend (llguidance)",
    "guided_whitespace_pattern": "structured JSON is always compact (no whitespace pattern)",
    "truncate_prompt_tokens": "prompts are never truncated: one that cannot fit is a 400",
    "prompt_logprobs": "prompt logprobs are not computed",
    "use_beam_search": "beam search is not implemented",
    "allowed_token_ids": "vLLM's allowed_token_ids is not implemented (guided_regex is)",
    "bad_words": "vLLM's bad_words is not implemented",
}
UNKNOWN = "neither an OpenAI parameter nor a tokenfleet extension (docs/http.md, 'Request fields')"


def ignored_fields(request: BaseModel) -> list[str]:
    """The fields of a parsed request that are accepted and ignored, in `IGNORED`'s order
    and then stream_options' own keys (sorted); [] when none was sent."""
    given = request.model_fields_set
    names = [name for name in IGNORED if name in given]
    options = getattr(request, "stream_options", None)
    if isinstance(options, BaseModel):
        keys = options.model_fields_set | set(options.model_extra or {})
        names += [f"stream_options.{key}" for key in sorted(keys - STREAM_OPTIONS_HONOURED)]
    return names


def refusal(param: str) -> tuple[str, str]:
    """(code, why) of a 400 for a field the request models do not have."""
    why = REFUSED.get(param)
    if why is not None:
        return "unsupported_parameter", f"not supported: {why}"
    return "unknown_parameter", f"extra inputs are not permitted: {UNKNOWN}"
