import pytest

from skulkp2p.engine.request import RequestError
from skulkp2p.formats.pipe_format import parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_defaults():
    r = parse_request(dict(CHAT))
    assert r.sampling.greedy and r.speculation.mode == "auto" and r.stop == ()


def test_fields():
    r = parse_request({"prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                       "top_k": 40, "min_p": 0.05, "seed": 3, "stop": ["\n"],
                       "repetition_penalty": 1.1, "speculation": {"drafter": "lookup", "depth": 3}})
    assert r.max_tokens == 5 and r.sampling.top_k == 40 and r.stop == ("\n",)
    assert r.speculation.drafter == "lookup" and r.speculation.depth == 3


def test_content_parts():
    r = parse_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.messages[0].content == "ab"


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"speculation": "fast"}, "speculation"),
    ({"speculation": {"drafter": "oracle"}}, "speculation"),
    ({"speculation": {"drafter": "lookup", "depth": 0}}, "depth"),
    ({"n": 2}, "n"),
    ({"model": 7}, "model"),
])
def test_bad_fields_named(extra, param):
    with pytest.raises(RequestError) as e:
        parse_request({**CHAT, **extra})
    assert e.value.param == param


@pytest.mark.parametrize("obj", [
    [], "x", {}, {"messages": []}, {"messages": [{"role": "bot", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"prompt": ""},
    {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
])
def test_bad_shapes(obj):
    with pytest.raises(RequestError):
        parse_request(obj)


def _no_model_check(name):
    assert name in (None, "m")


def test_every_api_reads_the_same_conversation_into_the_same_request():
    """One conversation with a tool call and its result, in each API's own shape: each format
    builds the typed request itself, and all three are the same."""
    from skulkp2p.engine.request import Message, ToolChoice
    from skulkp2p.engine.results import ToolCall
    from skulkp2p.formats.anthropic_messages import messages_request
    from skulkp2p.formats.openai_chat import chat_request
    from skulkp2p.formats.responses_api import response_request

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    openai = {"model": "m", "max_tokens": 8, "tool_choice": "required", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "Thanks."}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": schema}}]}
    anthropic = {"model": "m", "max_tokens": 8, "system": "Be brief.",
                 "tool_choice": {"type": "any"}, "messages": [
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "c1",
                                                        "name": "weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                   "content": "sunny"},
                                                  {"type": "text", "text": "Thanks."}]}],
                 "tools": [{"name": "weather", "input_schema": schema}]}
    responses = {"model": "m", "max_output_tokens": 8, "instructions": "Be brief.",
                 "tool_choice": "required", "input": [
                     {"role": "user", "content": "Weather in Paris?"},
                     {"type": "function_call", "call_id": "c1", "name": "weather",
                      "arguments": '{"city": "Paris"}'},
                     {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                     {"role": "user", "content": "Thanks."}],
                 "tools": [{"type": "function", "name": "weather", "parameters": schema}]}

    a = chat_request(openai, _no_model_check).req
    b = messages_request(anthropic, _no_model_check).req
    c = response_request(responses, _no_model_check, lambda rid: ()).req
    assert a == b == c
    assert a.messages[2] == Message("assistant", "", (
        ToolCall("c1", "weather", '{"city": "Paris"}'),))
    assert a.messages[3] == Message("tool", "sunny", tool_call_id="c1")
    assert a.tool_choice == ToolChoice("required") and a.max_tokens == 8
