"""The client matrix: widely used OpenAI client libraries and agent frameworks, each run
as its quick start shows, against a running `tokenfleet gateway`.

Every library lives in its own venv (installed plainly: `python -m venv D/instructor &&
D/instructor/bin/pip install instructor`); this program runs its own checks for each in
that venv's interpreter, so versions never mix:

    python bench/clients.py --url http://127.0.0.1:8000 --venvs /tmp/clientvenvs \
        --model default --out bench/results/clients.json

`--venvs D` looks for D/<name>/bin/python for every library in `LIBRARIES` (missing
ones are reported as skipped); `--only openai` runs one library in this interpreter.
A check passes when the call returns and its answer has the shape the library promises
(a tool call whose arguments validate, a parsed pydantic object, text); the model's
wisdom is not judged. The JSON lists library, version, check, result and the error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

LIBRARIES = {  # venv folder name → the distribution whose version is reported
    "openai": "openai",
    "instructor": "instructor",
    "langchain-openai": "langchain-openai",
    "pydantic-ai-slim": "pydantic-ai-slim",
    "openai-agents": "openai-agents",
    "litellm": "litellm",
    "outlines": "outlines",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]

Check = Callable[[str, str], None]  # (base url with /v1, model) → raises on failure


def _weather_city(arguments: str | dict[str, Any]) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert args["city"] in ("Paris", "Rome", "Oslo"), args
    return str(args["city"])


# ---- openai ------------------------------------------------------------------------------


def openai_checks() -> dict[str, Check]:
    import openai

    def client(url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def chat(url: str, model: str) -> None:
        r = client(url).chat.completions.create(model=model, messages=ASK, max_tokens=8)
        assert r.choices[0].message.content is not None

    def chat_stream(url: str, model: str) -> None:
        parts = client(url).chat.completions.create(
            model=model, messages=ASK, max_tokens=8, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    def completions(url: str, model: str) -> None:
        r = client(url).completions.create(model=model, prompt="Once upon", max_tokens=8)
        assert r.choices[0].text

    def tools_named(url: str, model: str) -> None:
        r = client(url).chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert r.choices[0].finish_reason == "tool_calls"
        _weather_city(call.function.arguments)  # type: ignore[union-attr]

    def tools_loop(url: str, model: str) -> None:
        c = client(url)
        first = c.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required"
        )
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        history = [
            *ASK,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = c.chat.completions.create(
            model=model, messages=history, tools=[WEATHER_TOOL], max_tokens=16
        )
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

    def tools_stream(url: str, model: str) -> None:
        args: dict[int, str] = {}
        for chunk in client(url).chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required", stream=True
        ):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")  # type: ignore[union-attr]
        _weather_city(args[0])

    def responses(url: str, model: str) -> None:
        r = client(url).responses.create(model=model, input="Say hi", max_output_tokens=8)
        assert r.output_text

    def responses_stream(url: str, model: str) -> None:
        # room to finish: the client's stream helper wants `response.completed`, which an
        # answer cut by max_output_tokens (`response.incomplete`) is not, as on OpenAI
        with client(url).responses.stream(
            model=model, input="Say hi in one word.", max_output_tokens=256
        ) as stream:
            final = stream.get_final_response()
        assert final.output_text

    def responses_tool(url: str, model: str) -> None:
        fn = WEATHER_TOOL["function"]
        r = client(url).responses.create(
            model=model,
            input="weather in Paris?",
            tools=[{"type": "function", **fn}],  # type: ignore[list-item,dict-item]
            tool_choice="required",
        )
        calls = [o for o in r.output if o.type == "function_call"]
        _weather_city(calls[0].arguments)  # type: ignore[union-attr]

    def json_schema(url: str, model: str) -> None:
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
        r = client(url).chat.completions.create(
            model=model,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": schema},
            },
        )
        assert isinstance(json.loads(r.choices[0].message.content or "")["ok"], bool)

    def logprobs(url: str, model: str) -> None:
        r = client(url).chat.completions.create(
            model=model, messages=ASK, max_tokens=4, logprobs=True, top_logprobs=3
        )
        content = r.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and len(content[0].top_logprobs) == 3

    def n_choices(url: str, model: str) -> None:
        r = client(url).chat.completions.create(model=model, messages=ASK, max_tokens=4, n=2)
        assert sorted(c.index for c in r.choices) == [0, 1]

    def defaults_sent(url: str, model: str) -> None:  # what SDKs send as "defaults"
        client(url).chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=4,
            tools=[],
            tool_choice="none",
            store=False,
            metadata={"k": "v"},
            parallel_tool_calls=True,
            top_logprobs=0,
        )

    def models_retrieve(url: str, model: str) -> None:
        assert client(url).models.retrieve(model).id == model

    def penalties(url: str, model: str) -> None:
        client(url).chat.completions.create(
            model=model, messages=ASK, max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5
        )

    return {
        "chat": chat,
        "chat stream": chat_stream,
        "completions": completions,
        "tools, named": tools_named,
        "tools, two-turn loop": tools_loop,
        "tools, streamed": tools_stream,
        "responses": responses,
        "responses stream": responses_stream,
        "responses, function tool": responses_tool,
        "response_format json_schema": json_schema,
        "logprobs": logprobs,
        "n=2": n_choices,
        "default-valued fields": defaults_sent,
        "models.retrieve": models_retrieve,
        "penalties": penalties,
    }


# ---- instructor ---------------------------------------------------------------------------


def instructor_checks() -> dict[str, Check]:
    import instructor
    import openai
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        sunny: bool

    def run(mode: Any) -> Check:
        def check(url: str, model: str) -> None:
            c = instructor.from_openai(
                openai.OpenAI(base_url=url, api_key="unused", max_retries=0), mode=mode
            )
            if mode == instructor.Mode.RESPONSES_TOOLS:
                out = c.responses.create(model=model, input=ASK, response_model=Weather)
            else:
                out = c.chat.completions.create(model=model, messages=ASK, response_model=Weather)
            assert isinstance(out, Weather)

        return check

    return {
        "default mode (TOOLS)": run(instructor.Mode.TOOLS),
        "JSON_SCHEMA": run(instructor.Mode.JSON_SCHEMA),
        "RESPONSES_TOOLS": run(instructor.Mode.RESPONSES_TOOLS),
    }


# ---- langchain-openai ---------------------------------------------------------------------


def langchain_checks() -> dict[str, Check]:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]

    def llm(url: str, model: str, **kw: Any) -> ChatOpenAI:
        return ChatOpenAI(base_url=url, api_key="unused", model=model, max_retries=0, **kw)  # type: ignore[arg-type]

    def invoke(url: str, model: str) -> None:
        assert llm(url, model, max_tokens=8).invoke("hi").content

    def stream(url: str, model: str) -> None:
        assert "".join(str(c.content) for c in llm(url, model, max_tokens=8).stream("hi"))

    def bind_tools(url: str, model: str) -> None:
        out = (
            llm(url, model)
            .bind_tools([WEATHER_TOOL], tool_choice="get_weather")
            .invoke("weather in Paris?")
        )
        _weather_city(out.tool_calls[0]["args"])  # type: ignore[attr-defined]

    def structured(method: str) -> Check:
        def check(url: str, model: str) -> None:
            out = (
                llm(url, model)
                .with_structured_output(Weather, method=method)
                .invoke(  # type: ignore[arg-type]
                    "weather in Paris?"
                )
            )
            assert isinstance(out, Weather)

        return check

    def responses_api(url: str, model: str) -> None:
        out = llm(url, model, max_tokens=8, use_responses_api=True).invoke("hi")
        assert out.content

    def n2(url: str, model: str) -> None:
        from langchain_core.messages import HumanMessage

        result = llm(url, model, max_tokens=4, n=2).generate([[HumanMessage("hi")]])
        assert len(result.generations[0]) == 2

    return {
        "invoke": invoke,
        "stream": stream,
        "bind_tools": bind_tools,
        "with_structured_output function_calling": structured("function_calling"),
        "with_structured_output json_schema": structured("json_schema"),
        "use_responses_api": responses_api,
        "n=2": n2,
    }


# ---- pydantic-ai --------------------------------------------------------------------------


def pydantic_ai_checks() -> dict[str, Check]:
    from pydantic import BaseModel
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]

    def provider(url: str) -> OpenAIProvider:
        return OpenAIProvider(base_url=url, api_key="unused")

    def tool_output(url: str, model: str) -> None:  # the default: a final-result tool
        agent = Agent(OpenAIChatModel(model, provider=provider(url)), output_type=Weather)
        assert isinstance(agent.run_sync("weather in Paris?").output, Weather)

    def native(url: str, model: str) -> None:
        agent = Agent(
            OpenAIChatModel(model, provider=provider(url)), output_type=NativeOutput(Weather)
        )
        assert isinstance(agent.run_sync("weather in Paris?").output, Weather)

    def responses_model(url: str, model: str) -> None:  # what `openai:NAME` means in 2.x
        agent = Agent(OpenAIResponsesModel(model, provider=provider(url)), output_type=Weather)
        assert isinstance(agent.run_sync("weather in Paris?").output, Weather)

    return {
        "output_type (tool output)": tool_output,
        "NativeOutput": native,
        "OpenAIResponsesModel": responses_model,
    }


# ---- openai-agents ------------------------------------------------------------------------


def agents_checks() -> dict[str, Check]:
    import agents
    import openai

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    def run(kind: str) -> Check:
        def check(url: str, model: str) -> None:
            client = openai.AsyncOpenAI(base_url=url, api_key="unused")
            m: Any = (
                agents.OpenAIResponsesModel(model=model, openai_client=client)
                if kind == "responses"
                else agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
            )
            agent = agents.Agent(
                name="w",
                instructions="Use the weather tool.",
                tools=[get_weather],
                model=m,
                model_settings=agents.ModelSettings(tool_choice="required"),
                tool_use_behavior="stop_on_first_tool",
            )
            out = agents.Runner.run_sync(agent, "weather in Paris?").final_output
            assert str(out).startswith("sunny in ")

        return check

    return {"Runner, Responses model + tool": run("responses"), "chat model + tool": run("chat")}


# ---- litellm ------------------------------------------------------------------------------


def litellm_checks() -> dict[str, Check]:
    import litellm

    def completion(url: str, model: str) -> None:
        r = litellm.completion(
            model=f"openai/{model}", api_base=url, api_key="unused", messages=ASK, max_tokens=8
        )
        assert r.choices[0].message.content is not None

    def stream(url: str, model: str) -> None:
        parts = litellm.completion(
            model=f"openai/{model}",
            api_base=url,
            api_key="unused",
            messages=ASK,
            max_tokens=8,
            stream=True,
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts)

    def tools(url: str, model: str) -> None:
        r = litellm.completion(
            model=f"openai/{model}",
            api_base=url,
            api_key="unused",
            messages=ASK,
            tools=[WEATHER_TOOL],
            tool_choice="required",
        )
        _weather_city(r.choices[0].message.tool_calls[0].function.arguments)

    def responses(url: str, model: str) -> None:
        r = litellm.responses(
            model=f"openai/{model}",
            api_base=url,
            api_key="unused",
            input="hi",
            max_output_tokens=8,
        )
        assert r.output

    return {"completion": completion, "stream": stream, "tools": tools, "responses": responses}


# ---- outlines -----------------------------------------------------------------------------


def outlines_checks() -> dict[str, Check]:
    import openai
    import outlines
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]

    def from_openai(url: str, model: str) -> None:
        m = outlines.from_openai(openai.OpenAI(base_url=url, api_key="unused"), model)
        Weather.model_validate_json(m("weather in Paris?", Weather))

    def from_vllm_json(url: str, model: str) -> None:
        m = outlines.from_vllm(openai.OpenAI(base_url=url, api_key="unused"), model)
        Weather.model_validate_json(m("weather in Paris?", Weather))

    def from_vllm_choice(url: str, model: str) -> None:
        m = outlines.from_vllm(openai.OpenAI(base_url=url, api_key="unused"), model)
        assert m("Paris or Rome?", Literal["Paris", "Rome"]) in ("Paris", "Rome")

    return {
        "from_openai json": from_openai,
        "from_vllm json": from_vllm_json,
        "from_vllm choice": from_vllm_choice,
    }


CHECKS: dict[str, Callable[[], dict[str, Check]]] = {
    "openai": openai_checks,
    "instructor": instructor_checks,
    "langchain-openai": langchain_checks,
    "pydantic-ai-slim": pydantic_ai_checks,
    "openai-agents": agents_checks,
    "litellm": litellm_checks,
    "outlines": outlines_checks,
}


def run_one(library: str, url: str, model: str) -> list[dict[str, Any]]:
    """This interpreter's checks of `library`: one row per check."""
    version = metadata.version(LIBRARIES[library])
    rows = []
    for name, check in CHECKS[library]().items():
        started = time.monotonic()
        try:
            check(url, model)
            error = None
        except Exception as exc:  # a failing check is a row, never the end of the run
            error = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc(limit=2, file=sys.stderr)
        rows.append(
            {
                "library": library,
                "version": version,
                "check": name,
                "ok": error is None,
                "error": error,
                "s": round(time.monotonic() - started, 2),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="default")
    parser.add_argument("--venvs", type=Path, help="a folder of one venv per library")
    parser.add_argument("--only", choices=sorted(CHECKS), help="one library, in this python")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = args.url.rstrip("/") + "/v1"
    if args.only:
        rows = run_one(args.only, base, args.model)
        print(json.dumps(rows))
        return
    rows = []
    for library in LIBRARIES:
        python = args.venvs / library / "bin" / "python" if args.venvs else None
        if python is None or not python.exists():
            rows.append({"library": library, "check": "*", "ok": None, "error": "not installed"})
            continue
        done = subprocess.run(
            [str(python), __file__, "--url", args.url, "--model", args.model, "--only", library],
            capture_output=True,
            text=True,
        )
        try:
            rows += json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            rows.append(
                {"library": library, "check": "*", "ok": False, "error": done.stderr[-400:]}
            )
    passed = sum(1 for r in rows if r["ok"])
    total = sum(1 for r in rows if r["ok"] is not None)
    for r in rows:
        mark = {True: "pass", False: "FAIL", None: "skip"}[r["ok"]]
        where = f"{r['library']:18} {r.get('version', ''):10} {r['check']:42}"
        print(f"{mark:4}  {where} {r['error'] or ''}")
    print(f"{passed} of {total} checks pass")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"passed": passed, "total": total, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
