"""Chat messages become prompts through the model's own template, or a clear refusal."""

from __future__ import annotations

import pytest

from tokenfleet.model import ByteTokenizer, load_model
from tokenfleet.model.chat import SIMPLE_CHAT_TEMPLATE, ChatTemplateError, render_chat
from tokenfleet.protocol import GenerationRequest
from tokenfleet.reasons import AdmissionReason, FinishReason
from tokenfleet.worker.engine import Engine, EngineConfig


def test_preset_template_renders_every_turn_and_opens_the_assistant_turn() -> None:
    text = render_chat(
        ByteTokenizer(chat_template=SIMPLE_CHAT_TEMPLATE),
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    )
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_template_errors_and_missing_templates_are_named() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(ByteTokenizer(), [{"role": "user", "content": "hi"}])
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat(ByteTokenizer(chat_template=strict), [{"role": "system", "content": "x"}])
    # the sandbox refuses to reach into Python internals
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        render_chat(ByteTokenizer(chat_template=escape), [{"role": "user", "content": "x"}])


def test_engine_serves_messages_and_rejects_them_without_a_template() -> None:
    loaded = load_model("tiny-random")
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=8 << 20))
    chat = GenerationRequest(
        job_id="chat",
        messages=[{"role": "user", "content": "hi"}],
        max_new_tokens=4,
        ignore_eos=True,
    )
    assert engine.submit(chat).reason == AdmissionReason.ADMITTED
    same_as_text = GenerationRequest(
        job_id="text", prompt="<|user|>\nhi\n<|assistant|>\n", max_new_tokens=4, ignore_eos=True
    )
    engine.submit(same_as_text)
    results = {}
    while engine.has_work:
        for done in engine.step().finished:
            results[done.job_id] = done.result
    assert results["chat"].token_ids == results["text"].token_ids
    assert results["chat"].finish_reason == FinishReason.LENGTH

    bare = Engine(
        loaded.__class__(**{**loaded.__dict__, "tokenizer": ByteTokenizer()}),
        EngineConfig(kv_budget_bytes=8 << 20),
    )
    decision = bare.submit(chat)
    assert decision.reason == AdmissionReason.REJECTED_INVALID
    assert "no chat template" in decision.message
