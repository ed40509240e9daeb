"""Tool calls held to their format through a real `join` on 127.0.0.1, with the real `openai`
and `anthropic` clients: per API, a required or named tool_choice gives a call whose arguments
fit the strict tool's schema; tools with a response format; Anthropic's structured outputs
(`output_config`, as the SDK's `messages.parse` sends it) and its errors in Anthropic's shape.
A tiny random model with a Hermes-style template: whatever it writes, the grammar holds it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.procs import JoinNode as Node
from tests.helpers.tool_models import FORECAST, clients, conforms, tools_model

pytestmark = pytest.mark.process

TOOL = {"type": "function", "function": {"name": "forecast", "parameters": FORECAST,
                                         "strict": True}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):
    d = tools_model(tiny_models["llama"], tmp_path_factory.mktemp("tiny-tools") / "tools")
    tmp = tmp_path_factory.mktemp("tools-grammar-node")
    n = Node(str(d), tmp, "--data-dir", str(tmp))
    yield n
    assert n.stop() == 0, n.text()[-3000:]


def test_chat_required_and_named_calls_fit_the_schema(node):
    oai, _ = clients(node)
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        for spec in ("off", {"drafter": "lookup", "depth": 4}):
            r = oai.chat.completions.create(model="tools", messages=ASK, tools=[TOOL],
                                            tool_choice=choice, max_tokens=80,
                                            parallel_tool_calls=False,
                                            extra_body={"speculation": spec})
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls", msg
            assert msg.tool_calls[0].function.name == "forecast"
            conforms(json.loads(msg.tool_calls[0].function.arguments), FORECAST)


def test_chat_tools_with_a_response_format(node):
    oai, _ = clients(node)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = oai.chat.completions.create(
        model="tools", messages=ASK, tools=[TOOL], max_tokens=80, parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    msg = r.choices[0].message
    if msg.tool_calls:
        conforms(json.loads(msg.tool_calls[0].function.arguments), FORECAST)
    elif r.choices[0].finish_reason == "stop":
        conforms(json.loads(msg.content), schema)


def test_responses_named_call_fits_the_schema(node):
    oai, _ = clients(node)
    r = oai.responses.create(model="tools", input=ASK[0]["content"], max_output_tokens=80,
                             parallel_tool_calls=False,
                             tools=[{"type": "function", "name": "forecast",
                                     "parameters": FORECAST, "strict": True}],
                             tool_choice={"type": "function", "name": "forecast"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "forecast", r.output
    conforms(json.loads(calls[0].arguments), FORECAST)


def test_anthropic_any_tool_and_output_config(node):
    from typing import Literal

    import anthropic
    from pydantic import BaseModel

    _, claude = clients(node)
    tool = {"name": "forecast", "input_schema": FORECAST, "strict": True}
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "forecast", "disable_parallel_tool_use": True}):
        msg = claude.messages.create(model="tools", max_tokens=80, messages=ASK, tools=[tool],
                                     tool_choice=choice)
        assert msg.stop_reason == "tool_use", msg
        use = [b for b in msg.content if b.type == "tool_use"]
        conforms(use[0].input, FORECAST)

    class Answer(BaseModel):
        unit: Literal["c", "f"]
        rain: bool

    # A typed output, as the SDK sends it (output_config.format; the beta with its header).
    msg = claude.messages.parse(model="tools", max_tokens=40, messages=ASK, output_format=Answer)
    assert msg.stop_reason == "end_turn" and isinstance(msg.parsed_output, Answer)
    beta = claude.beta.messages.parse(model="tools", max_tokens=40, messages=ASK,
                                      output_format=Answer,
                                      betas=["structured-outputs-2025-11-13"])
    assert isinstance(beta.parsed_output, Answer)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tools", max_tokens=4, messages=ASK, output_config={
            "format": {"type": "json_schema", "schema": {"type": "intger"}}})
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema.type" in body["error"]["message"]


def test_openai_bad_strict_tool_is_a_400_naming_its_path(node):
    import openai

    oai, _ = clients(node)
    bad = {"type": "object", "properties": {"x": {"type": "string", "minLength": -1}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tools", messages=ASK, max_tokens=4, tools=[{
            "type": "function", "function": {"name": "f", "parameters": bad, "strict": True}}])
    assert e.value.body["param"] == "tools[0].function.parameters.properties.x.minLength"
