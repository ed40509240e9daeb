"""Tool use and the Responses API through the real HTTP server, with the real `openai` and
`anthropic` clients, in-process, on a scripted engine: the "model" says the text of the last
message, in 4-character pieces, through the engine's real tool-call stream (mlx-lm's json_tools
parser), so the streaming shapes are checked on deterministic output. The real engine and real
models behind a real `join`: test_tools_node.py."""

from __future__ import annotations

import json

import pytest

from skulkp2p.api.response_store import ResponseStore
from skulkp2p.engine.decode.tool_calls import (
    ToolCallParser,
    ToolCallStream,
    forced_opening,
    load_format,
)
from skulkp2p.engine.protocol import EngineInfo, Generation
from skulkp2p.engine.request import Message
from skulkp2p.engine.results import (
    Chunk,
    GenerationResult,
    SpeculationStats,
    Timing,
    Usage,
)
from skulkp2p.formats.chat_messages import message_json
from tests.helpers.fake_engine import LiveNode
from tests.helpers.http_client import H11Client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedEngine:
    """The Engine protocol; the reply is the last message's text ("history": the conversation
    it was given, as JSON), cut to max_tokens pieces."""
    id = "scripted"
    context_length = 10_000
    runs_on_loop = False

    def __init__(self) -> None:
        self.fmt = load_format("json_tools")
        self.requests: list = []

    def info(self) -> EngineInfo:
        return EngineInfo(self.id, "scripted", "none", self.context_length)

    def prompt_length(self, req) -> int:
        return len(req.messages or [])

    def generate(self, req) -> Generation:
        self.requests.append(req)
        return Generation(lambda interrupt: self._run(req, interrupt))

    def _run(self, req, interrupt):
        script = req.messages[-1].content
        if script == "history":
            script = json.dumps([{k: m[k] for k in ("role", "content", "tool_calls",
                                                    "tool_call_id") if k in m}
                                 for m in map(message_json, req.messages)])
        pieces = [script[i:i + 4] for i in range(0, len(script), 4)]
        finish = "stop"
        if req.max_tokens is not None and len(pieces) > req.max_tokens:
            pieces, finish = pieces[:req.max_tokens], "length"
        calls = None
        if req.uses_tools:
            calls = ToolCallStream(ToolCallParser(
                self.fmt, req.tools, req.parallel_tool_calls,
                forced_opening(self.fmt, req)))
        for i, piece in enumerate(pieces):
            interrupt()
            if calls is None:
                yield Chunk(piece, [i])
            else:
                yield from calls.chunks(piece, [i])
                if calls.done:
                    break
        if calls is not None:
            yield from calls.finish()
        result = GenerationResult(
            text="".join(pieces), tokens=list(range(len(pieces))), finish_reason=finish,
            usage=Usage(len(req.messages), len(pieces)), timing=Timing(0.01, 0.02, 100.0),
            speculation=SpeculationStats("lookup", "auto", drafted=4, accepted=3))
        return result if calls is None else calls.result(result)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def node():
    # The server's own defaults (bodies with tool schemas are larger than the fake's 4 KiB).
    n = LiveNode(engine=ScriptedEngine(), model_id="scripted", max_queue=16, keepalive_s=5,
                 header_timeout=10.0, body_timeout=60.0, idle_timeout=30.0,
                 max_body_bytes=8 << 20)
    n.wait_ready()
    yield n
    n.close()


@pytest.fixture
def oai(node):
    import openai
    return openai.OpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture
def claude(node):
    import anthropic
    return anthropic.Anthropic(base_url=node.base, api_key="none", max_retries=0, timeout=30)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- OpenAI chat ----------------------------------------------------------------------------

def test_openai_chat_tool_call_whole(oai):
    r = oai.chat.completions.create(model="scripted", messages=user(CALL), tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.model_extra["speculation"]["drafted"] == 4  # our stats ride along


def test_openai_chat_tool_call_streams_as_openai_does(oai):
    text = "Checking the weather." + CALL + "\n" + CALL.replace("Paris", "Rome")
    chunks = list(oai.chat.completions.create(model="scripted", messages=user(text),
                                              tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    assert content == "Checking the weather."
    tool_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
    # Text before the calls streamed before them.
    first_tool = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_tool]) == content
    calls: dict[int, dict] = {}
    for tc in tool_deltas:
        if tc.id is not None:  # index, id, type, name first, with empty arguments
            assert tc.type == "function" and tc.function.name == "get_weather"
            assert tc.function.arguments == "" and tc.index == len(calls)
            calls[tc.index] = {"id": tc.id, "args": ""}
        else:
            assert tc.function.name is None and tc.function.arguments
            calls[tc.index]["args"] += tc.function.arguments
    assert [json.loads(c["args"]) for c in calls.values()] == [{"city": "Paris"},
                                                               {"city": "Rome"}]
    assert len([tc for tc in tool_deltas if tc.id is None and tc.index == 0]) > 1  # fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].model_extra["speculation"]["accepted"] == 3
    # The SDK's own stream accumulator takes the deltas as they are.
    with oai.chat.completions.stream(model="scripted", messages=user(text),
                                     tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == content and final.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"city": "Paris"}, {"city": "Rome"}]


def test_openai_malformed_call_is_text_with_stop(oai):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    r = oai.chat.completions.create(model="scripted", messages=user(bad), tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad
    streamed = list(oai.chat.completions.create(model="scripted", messages=user(bad),
                                                tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == bad
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_openai_tool_history_and_choice_reach_the_engine(oai, node):
    history = [*user("weather?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "history"}]
    r = oai.chat.completions.create(model="scripted", messages=history, tools=[WEATHER],
                                    tool_choice="none", parallel_tool_calls=False)
    seen = json.loads(r.choices[0].message.content)
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert seen[2] == {"role": "tool", "content": "history", "tool_call_id": "call_1"}
    req = node.engine.requests[-1]
    assert req.tool_choice.mode == "none" and not req.parallel_tool_calls
    # A named function forces the call's opening: the reply continues inside it.
    r = oai.chat.completions.create(
        model="scripted", messages=user(' {"city": "Oslo"}}\n</tool_call>'), tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "text"}}}}}],
     "tools[0].function.parameters.properties.x.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "oops"}}],
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "tools[0].type"),
])
def test_openai_malformed_schema_is_400_naming_the_field(oai, tools, param):
    import openai
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="scripted", messages=user("hi"), tools=tools)
    assert info.value.body["param"] == param


# ---- Anthropic ------------------------------------------------------------------------------

CLAUDE_TOOL = {"name": "get_weather", "description": "Current weather in a city",
               "input_schema": WEATHER["function"]["parameters"]}


def test_anthropic_tool_use_whole_and_streamed(claude):
    text = "Let me look." + CALL
    msg = claude.messages.create(model="scripted", max_tokens=100, tools=[CLAUDE_TOOL],
                                 messages=user(text))
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me look."
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    with claude.messages.stream(model="scripted", max_tokens=100, tools=[CLAUDE_TOOL],
                                messages=user(text)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    json_deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert len(json_deltas) > 1 and json.loads("".join(json_deltas)) == {"city": "Paris"}


def test_anthropic_raw_event_sequence_with_tool_use(node):
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/messages", {
            "model": "scripted", "max_tokens": 100, "stream": True, "tools": [CLAUDE_TOOL],
            "messages": user("Hi." + CALL)})
    events = [(n, json.loads(d)) for n, d in r.sse()]
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]
    # Each block's deltas sit between its start and its stop.
    i_start, i_stop = names.index("content_block_start", 2), len(names) - 3
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in events[i_start + 1:i_stop]
               if n == "content_block_delta")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_tool_result_history_and_choice(claude, node):
    messages = [*user("weather?"),
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "history"}]}]}]
    msg = claude.messages.create(model="scripted", max_tokens=500, tools=[CLAUDE_TOOL],
                                 tool_choice={"type": "auto",
                                              "disable_parallel_tool_use": True},
                                 messages=messages)
    seen = json.loads(msg.content[0].text)
    assert seen[1] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert seen[2] == {"role": "tool", "content": "history", "tool_call_id": "toolu_1"}
    assert node.engine.requests[-1].parallel_tool_calls is False
    claude.messages.create(model="scripted", max_tokens=100, tools=[CLAUDE_TOOL],
                           tool_choice={"type": "any"}, messages=user('"get_weather"'))
    assert node.engine.requests[-1].tool_choice.mode == "required"


@pytest.mark.parametrize("tool, param", [
    ({"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": 5}}}},
     "tools[0].input_schema.properties.x.type"),
    ({"name": "f"}, "tools[0].input_schema"),
    ({"name": "bad name!", "input_schema": {"type": "object"}}, "tools[0].name"),
    ({"type": "bash_20250124", "name": "bash"}, "tools[0].type"),
])
def test_anthropic_malformed_tool_is_400_naming_the_field(claude, tool, param):
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="scripted", max_tokens=10, tools=[tool],
                               messages=user("hi"))
    assert info.value.body["error"]["param"] == param


# ---- Responses ------------------------------------------------------------------------------

RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
             "parameters": WEATHER["function"]["parameters"]}


def test_responses_text_whole_and_streamed(oai):
    r = oai.responses.create(model="scripted", input="Hello there, friend.")
    assert r.status == "completed" and r.output_text == "Hello there, friend."
    assert r.usage.input_tokens == 1 and r.usage.output_tokens == 5
    assert r.model_extra["speculation"]["drafted"] == 4
    with oai.responses.stream(model="scripted", input="Hello there, friend.",
                              instructions="Be brief.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Hello there, friend."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Hello there, friend." and final.instructions == "Be brief."
    cut = oai.responses.create(model="scripted", input="Hello there, friend.",
                               max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "Hello th"


def test_responses_function_calls_and_previous_response(oai, node):
    r = oai.responses.create(model="scripted", input="Looking." + CALL, tools=[RESP_TOOL])
    kinds = [item.type for item in r.output]
    assert kinds == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    # The tool's answer goes back with previous_response_id: the engine sees it all.
    follow = oai.responses.create(
        model="scripted", previous_response_id=r.id, tools=[RESP_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "history"}])
    seen = json.loads(follow.output_text)
    assert seen[0] == {"role": "user", "content": "Looking." + CALL}
    assert seen[1]["role"] == "assistant" and seen[1]["content"] == "Looking."
    assert seen[1]["tool_calls"][0]["id"] == call.call_id
    assert seen[2] == {"role": "tool", "content": "history", "tool_call_id": call.call_id}
    assert follow.previous_response_id == r.id
    # Instructions are not carried over; input items as a list; stored chains go on.
    third = oai.responses.create(model="scripted", previous_response_id=follow.id,
                                 instructions="Be brief.",
                                 input=[{"role": "user", "content": [
                                     {"type": "input_text", "text": "history"}]}])
    seen = json.loads(third.output_text)
    assert [m["role"] for m in seen] == ["system", "user", "assistant", "tool", "assistant",
                                         "user"]
    assert seen[0]["content"] == "Be brief."


def test_responses_stream_function_call_events(oai):
    with oai.responses.stream(model="scripted", input=CALL, tools=[RESP_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert events[2].item.arguments == "" and events[2].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert [o.type for o in final.output] == ["function_call"]
    assert final.output[0].call_id == events[2].item.call_id


def test_responses_errors(oai):
    import openai
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model="scripted", input="x", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model="scripted", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="scripted", input="x", previous_response_id=unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="scripted", input="x", tools=[
            {"type": "function", "name": "f", "parameters": {"type": "object",
                                                             "required": "x"}}])
    assert info.value.body["param"] == "tools[0].parameters.required"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="scripted", input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="scripted", input=[{"type": "reasoning", "summary": []}])
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="scripted", input="x", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"


def test_response_store_bounds():
    store = ResponseStore(max_count=3, max_bytes=1000)
    msg = (Message("user", "x" * 100),)
    for i in range(5):
        assert store.put(f"r{i}", msg)
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # used: kept over r3 next time
    assert store.put("big", (Message("user", "y" * 700),))
    assert store.bytes <= 1000 and store.get("r3") is None and store.get("r2") is not None
    assert not store.put("huge", (Message("user", "z" * 2000),))
    assert store.get("huge") is None and store.bytes <= 1000
