"""An agent framework run unchanged against the gateway: openai-agents (its quick start:
an `Agent` with a function tool, `Runner.run_sync`), on its default Responses API model
and on its chat-completions model, in front of one real tiny-random worker process.

tiny-random has random weights, so the tool's argument is an enum and the call is forced
(`tool_choice="required"`); the run ends on the tool's own answer
(`tool_use_behavior="stop_on_first_tool"`): what is checked is the round trip — the
framework's tool schema reaches the model, the call comes back valid, the framework runs
the function with those arguments."""

from __future__ import annotations

from typing import Literal

import openai
import pytest

from tests.helpers.gateway import GatewayEnv, gateway_env

agents = pytest.importorskip("agents")

env = gateway_env([("agents-w", [])])
calls: list[str] = []


@agents.function_tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"sunny in {city}"


def weather_agent(model: object) -> object:
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0.0
        ),
        tool_use_behavior="stop_on_first_tool",
    )


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the framework would post traces to OpenAI
    calls.clear()


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_calls_its_tool_through_the_gateway(env: GatewayEnv, api: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{env.gateway.url}/v1", api_key="unused")
    model: object
    if api == "responses":  # the framework's default model for a model name
        model = agents.OpenAIResponsesModel(model="default", openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model="default", openai_client=client)
    result = agents.Runner.run_sync(weather_agent(model), "What is the weather in Paris?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Oslo")
    assert result.final_output == f"sunny in {calls[0]}"
