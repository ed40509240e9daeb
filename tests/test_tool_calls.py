"""Tool calls without a model: the request parser's tools (schemas checked, errors naming the
field), and the streaming parser over mlx-lm's own tool parsers fed deterministic text."""

from __future__ import annotations

import json
import random

import pytest

from skulkp2p.engine.decode.tool_calls import (
    ToolCallParser,
    call_opening,
    json_tools_template,
    load_format,
    template_messages,
)
from skulkp2p.engine.request import Message, RequestError, ToolChoice
from skulkp2p.engine.results import ToolCall, ToolCallDelta
from skulkp2p.formats.chat_messages import parse_tools, tool_json
from skulkp2p.formats.pipe_format import parse_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def req(**kw):
    return parse_request({"messages": CHAT, **kw})


# ---- the request --------------------------------------------------------------------------

def test_tools_parse_with_choice_and_history():
    r = req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False)
    assert r.tools[0].name == "get_weather" and tool_json(r.tools[0]) == WEATHER
    assert r.tool_choice == ToolChoice("function", "get_weather") and not r.parallel_tool_calls
    assert r.uses_tools
    assert not req(tools=TOOLS, tool_choice="none").uses_tools
    assert not req(tool_choice="auto").tools  # harmless without tools
    history = [*CHAT,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text",
                                                                    "text": "sunny"}]}]
    r = parse_request({"messages": history, "tools": TOOLS})
    assert r.messages[1] == Message("assistant", "", (
        ToolCall("c1", "get_weather", '{"city": "Paris"}'),))
    assert r.messages[2] == Message("tool", "sunny", tool_call_id="c1")
    # Templates get the arguments as an object (they write them with `| tojson`).
    assert template_messages(r.messages)[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}


def schema(parameters):
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("body, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": schema("a string")}, "tools[0].function.parameters"),
    ({"tools": schema({"type": "array"})}, "tools[0].function.parameters.type"),
    ({"tools": schema({"type": "object", "properties": {"city": {"type": "text"}}})},
     "tools[0].function.parameters.properties.city.type"),
    ({"tools": schema({"type": "object", "properties": []})},
     "tools[0].function.parameters.properties"),
    ({"tools": schema({"type": "object", "required": "city"})},
     "tools[0].function.parameters.required"),
    ({"tools": schema({"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "object", "properties": {"n": 3}}}}})},
     "tools[0].function.parameters.properties.xs.items.properties.n"),
    ({"tools": schema({"type": "object", "properties": {"u": {"anyOf": []}}})},
     "tools[0].function.parameters.properties.u.anyOf"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tools_are_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        req(**body)
    assert info.value.param == param and info.value.status == 400
    assert param.split(".")[-1].split("[")[0] in info.value.message


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x"}],  # no tool_call_id
    [{"role": "user", "content": "x", "tool_calls": []}],
    [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{not json"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}],
])
def test_malformed_tool_history_is_refused(messages):
    with pytest.raises(RequestError) as info:
        parse_request({"messages": messages})
    assert info.value.param == "messages"


def test_tools_need_messages():
    with pytest.raises(RequestError) as info:
        parse_request({"prompt": "hi", "tools": TOOLS})
    assert info.value.param == "tools"


# ---- the streaming parser -------------------------------------------------------------------

def feed(fmt, pieces, tools=TOOLS, **kw):
    ids = iter(f"call_{i}" for i in range(100))
    p = ToolCallParser(fmt, parse_tools(tools), new_id=lambda: next(ids), **kw)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return events, p


def calls_of(events):
    """Reassemble calls from deltas, as a client does, checking the stream's shape."""
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index == len(calls) and e.name and e.arguments == ""
                calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
            else:
                assert e.index in calls and e.arguments
                calls[e.index]["arguments"] += e.arguments
    return list(calls.values())


def test_json_tools_call_streams_after_text_with_fragments():
    fmt = load_format("json_tools")
    pieces = ["Let me", " check.", "\n", "<tool_call>", "\n", '{"name": "get_weather", ',
              '"arguments": {"city": ', '"Paris"}}', "\n", "</tool_call>", "\n",
              "<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
              "</tool_call>"]
    events, p = feed(fmt, pieces)
    texts = [e for e in events if isinstance(e, str)]
    assert "".join(texts) == p.text == "Let me check."
    # Text before the call streamed before it; the call as a call.
    first_delta = next(i for i, e in enumerate(events) if isinstance(e, ToolCallDelta))
    assert all(isinstance(e, str) for e in events[:first_delta])
    assert calls_of(events) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'}]
    # The arguments came in the pieces the model wrote them in.
    frags = [e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == 0
             and e.id is None]
    assert frags == ['{"city": ', '"Paris"}']
    assert [(c.id, c.name) for c in p.calls] == [("call_0", "get_weather"),
                                                 ("call_1", "get_weather")]


@pytest.mark.parametrize("text", [
    'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call> ok',
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>\n',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"',  # cut off
    '{"name": "get_weather", "arguments": {"city": "Par',  # a bare call, cut off
    '{"name": "launch", "arguments": {}} and more',  # a bare object, no offered function
])
def test_malformed_calls_are_plain_text_exactly(text):
    fmt = load_format("json_tools")
    for cut in (1, 3, 7, len(text)):
        pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
        events, p = feed(fmt, pieces)
        assert not p.calls and not any(isinstance(e, ToolCallDelta) for e in events)
        assert p.text == "".join(events) == text


def test_text_without_calls_passes_through_byte_for_byte():
    rng = random.Random(7)
    alphabet = ["a", " ", "\n", "<", "tool", "_call", ">", "/", "{", "}", '"', "é", "\t", "x"]
    fmt = load_format("json_tools")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        if "<tool_call>" in text:
            continue
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            pieces.append(text[i:i + n])
            i += n
        events, p = feed(fmt, pieces)
        if p.calls:
            continue  # a bare {"name": ...} cannot come out of this alphabet, but be sure
        assert p.text == "".join(events) == text, repr(text)


def test_bare_calls_and_unclosed_tags_json_tools():
    """Qwen2.5-Coder-0.5B's habits: the call's JSON without its tags, and a second call in the
    same unclosed tag (see ToolCallParser)."""
    fmt = load_format("json_tools")
    events, p = feed(fmt, ['{"', 'name": "get_weather", "arguments": {"city": "Paris"}}',
                           '\n{"temperature": 21}'])
    assert calls_of(events) == [{"id": "call_0", "name": "get_weather",
                                 "arguments": '{"city": "Paris"}'}]
    assert p.text == '{"temperature": 21}'
    opening = '<tool_call>\n{"name": "get_weather", "arguments":'
    events, p = feed(fmt, [' {"city": "Paris"}}', '\n{"name": "get_weather", "arguments": '
                                                    '{"city": "Tokyo"}}'], opening=opening)
    assert [json.loads(c["arguments"])["city"] for c in calls_of(events)] == ["Paris", "Tokyo"]
    assert p.text == ""


def test_parallel_false_stops_after_the_first_call():
    fmt = load_format("json_tools")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call>'
    events, p = feed(fmt, [call, call], parallel=False)
    assert len(calls_of(events)) == 1 and p.done


def test_forced_openings():
    fmt = load_format("json_tools")
    named = req(tools=TOOLS, tool_choice={"type": "function",
                                          "function": {"name": "get_weather"}})
    assert call_opening(fmt.name, fmt.start, named) == \
        '<tool_call>\n{"name": "get_weather", "arguments":'
    assert call_opening(fmt.name, fmt.start, req(tools=TOOLS, tool_choice="required")) == \
        '<tool_call>\n{"name":'
    assert call_opening(fmt.name, fmt.start, req(tools=TOOLS)) == ""
    events, p = feed(fmt, [' {"city": "Oslo"}}', "\n</tool_call>"],
                     opening=call_opening(fmt.name, fmt.start, named))
    assert calls_of(events) == [{"id": "call_0", "name": "get_weather",
                                 "arguments": '{"city": "Oslo"}'}]
    mistral = load_format("mistral")
    with pytest.raises(RequestError) as info:
        call_opening(mistral.name, mistral.start, named)
    assert info.value.param == "tool_choice"


def test_other_mlx_lm_formats():
    """The parser is format-agnostic: Qwen3-Coder's XML calls, Mistral's calls that run to the
    end of the reply."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    xml = load_format("qwen3_coder")
    events, p = feed(xml, ["Checking.", "<tool_call>\n<function=get_weather>\n",
                           "<parameter=city>\nParis\n</parameter>\n", "</function>\n",
                           "</tool_call>"], tools=tools)
    assert p.text == "Checking." and calls_of(events) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    mistral = load_format("mistral")
    events, p = feed(mistral, ["[TOOL", "_CALLS]", '[{"name": "get_weather", ',
                               '"arguments": {"city": "Rome"}}]'], tools=tools)
    assert p.text == "" and calls_of(events) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Rome"}'}]


def test_json_tools_template_rule():
    assert json_tools_template('{{- "<tool_call>" }}{{ tool_call.name }}')
    assert not json_tools_template("<tool_call>\n<function=x>{{ tool_call.name }}")
    assert not json_tools_template("{{ messages }}")


def test_card_chat_field_and_unknown_parsers(tmp_path):
    from skulkp2p.models.cards import CardError, parse_card

    base = {"id": "m", "family": "qwen2", "format": "mlx", "layers": 1, "hidden_size": 8,
            "kv_heads": 1, "context_length": 64, "size_bytes": 1,
            "source": {"kind": "local", "path": "/x"}}
    assert parse_card({**base, "chat": {"tool_parser": "json_tools"}}, tmp_path / "c.toml"
                      ).chat == {"tool_parser": "json_tools"}
    for chat, field in (({"tool_parser": "no such"}, "chat.tool_parser"),
                        ({"tool_parser": 3}, "chat.tool_parser"),
                        ({"parser": "json_tools"}, "chat.parser")):
        with pytest.raises(CardError, match=field.replace(".", r"\.")):
            parse_card({**base, "chat": chat}, tmp_path / "c.toml")
    with pytest.raises(ValueError, match="json_tools"):  # the known ones are named
        load_format("nope")
