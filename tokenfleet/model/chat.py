"""Rendering chat messages into a prompt with a model's chat template (Jinja, as in
Hugging Face `tokenizer_config.json`), in a sandbox: templates come with checkpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenfleet.model.tokenizer import Tokenizer

# A plain template for models that ship none of their own (the built-in presets).
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened; `tools`
    (OpenAI's shape) for a template that renders them (tokenfleet.tools.chat_input)."""
    source = tokenizer.chat_template
    if source is None:
        raise ChatTemplateError(
            "this model has no chat template: send a prompt (completions) instead of messages"
        )
    try:
        return str(
            _compile(source).render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from None
