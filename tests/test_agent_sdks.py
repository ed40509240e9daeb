"""Agent SDKs, the real libraries, against a real node serving the tools-capable card
(Qwen2.5-Coder-0.5B): openai-agents over chat completions and over the Responses API (a strict
function tool runs, the final answer carries no call as text), instructor (tool mode and a JSON
schema mode give a validated pydantic object) and pydantic-ai (a typed result). The calls are
held to the tools' schemas by the tool-call grammar, so a 0.5B model's calls parse."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

from tests.helpers.models import test_data_dir
from tests.helpers.procs import JoinNode as Node

pytestmark = [pytest.mark.process, pytest.mark.model, pytest.mark.slow]

MODEL = "qwen2.5-coder-0.5b"
ASK = "What is the weather like in Paris today?"


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from skulkp2p.models.store import ModelStore

    ModelStore(test_data_dir()).pull(MODEL)
    tmp = tmp_path_factory.mktemp("agents-node")
    n = Node(MODEL, tmp, "--data-dir", str(test_data_dir()), ready_timeout=300)
    yield n
    assert n.stop() == 0, n.text()[-3000:]


def _async_client(node):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_runs_a_strict_tool(node, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool(strict_mode=True)
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return f"It is sunny and 22 degrees in {city}."

    client = _async_client(node)
    model = (OpenAIChatCompletionsModel(model=MODEL, openai_client=client) if api == "chat"
             else OpenAIResponsesModel(model=MODEL, openai_client=client))
    # The run ends on the tool's result: given it, Qwen2.5-Coder-0.5B calls the same tool again
    # (it does so through plain chat too, with the call grammar off until it opens the call),
    # so "run the model again" would loop to max_turns whatever the server does.
    agent = Agent(name="weather", instructions="Answer with the weather tool's result.",
                  tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0.0, max_tokens=48))
    result = Runner.run_sync(agent, ASK, max_turns=2)
    assert ran and "paris" in ran[0].lower()  # the call parsed, its arguments fit
    assert result.final_output == f"It is sunny and 22 degrees in {ran[0]}."
    # No call leaked as text: the model's turn is a call item, its text empty.
    texts = [str(getattr(item, "raw_item", "")) for item in result.new_items
             if item.type == "message_output_item"]
    assert not any("<tool_call>" in t or '"arguments"' in t for t in texts)


def test_instructor_tool_and_json_modes(node):
    import instructor
    from openai import OpenAI

    raw = OpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0, timeout=300)
    for mode in (instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        got = client.chat.completions.create(
            model=MODEL, response_model=Weather, max_retries=0, max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": "Paris, in celsius."}])
        assert isinstance(got, Weather)


def test_pydantic_ai_typed_result(node):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=_async_client(node)))
    agent = Agent(model, output_type=Weather, model_settings={"max_tokens": 40,
                                                              "temperature": 0.0})
    result = agent.run_sync("Paris, in celsius.")
    assert isinstance(result.output, Weather)
