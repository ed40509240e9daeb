"""Tool use through a real `join` on 127.0.0.1 with the real `openai` and `anthropic` clients:
a tiny random model whose chat template renders tools (the code paths: forced calls, exactness
with and without speculation, the Responses API), the real Qwen2.5-Coder-0.5B card (its own
template renders tools; real calls), and the same model served by llama-server (calls parsed by
the child, relayed by our proxy)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.models import test_data_dir
from tests.helpers.procs import JoinNode as Node
from tests.helpers.tool_models import TOOL_TEMPLATE, clients

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARIS = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def tiny_tools(tiny_models, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-tools") / "tools"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def tiny_node(tiny_tools, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools-node")
    n = Node(str(tiny_tools), tmp, "--data-dir", str(tmp))
    yield n
    assert n.stop() == 0, n.text()[-3000:]


def calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(chunks) -> tuple[str, list[tuple[str, str]], str, dict]:
    """(content, calls, finish_reason, speculation) of an OpenAI stream, checking the shape of
    its tool-call deltas on the way."""
    text, found, finish, spec = "", {}, None, None
    for c in chunks:
        spec = c.model_extra.get("speculation") or spec
        if not c.choices:
            continue
        d = c.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(found) and tc.function.arguments == ""
                found[tc.index] = [tc.function.name, ""]
            else:
                found[tc.index][1] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    return text, [tuple(v) for v in found.values()], finish, spec


def test_tiny_forced_call_is_exact_with_and_without_speculation(tiny_node):
    """A named tool_choice opens the call in the prompt; random weights then write what they
    write: a call if it parses, else plain text (the opening included) with finish "stop" or
    "length", never a 500. Greedy output is the same byte for byte with speculation off,
    lookup, and auto, whole and streamed."""
    oai, _ = clients(tiny_node)
    outs = []
    for spec in ("off", {"drafter": "lookup", "depth": 3}, "auto"):
        kw = dict(model="tools", messages=PARIS, tools=[WEATHER], tool_choice=NAMED,
                  max_tokens=24, extra_body={"speculation": spec})
        r = oai.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        if msg.tool_calls:
            assert finish == "tool_calls"
        else:
            assert msg.content.startswith('<tool_call>\n{"name": "get_weather", "arguments":')
            assert finish in ("stop", "length")
        whole = (msg.content, calls(msg), finish)
        text, found, s_finish, s_spec = streamed(oai.chat.completions.create(**kw,
                                                                            stream=True))
        assert (text or None, found, s_finish) == whole
        if spec != "off":  # the drafters ran over the forced call's tokens
            assert s_spec["drafted"] > 0 and r.model_extra["speculation"]["drafted"] > 0
        outs.append(whole)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.process
def test_tiny_pipe_gives_what_http_gives(tiny_node, tiny_tools):
    from tests.helpers.procs import run_cli

    oai, _ = clients(tiny_node)
    line = {"id": 1, "messages": PARIS, "tools": [WEATHER], "tool_choice": NAMED,
            "max_tokens": 12}
    proc = run_cli("pipe", "--model", str(tiny_tools), input=json.dumps(line) + "\n",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    piped = json.loads(proc.stdout)
    r = oai.chat.completions.create(model="tools", messages=PARIS, tools=[WEATHER],
                                    tool_choice=NAMED, max_tokens=12)
    assert piped["finish_reason"] == r.choices[0].finish_reason
    assert piped["text"] == (r.choices[0].message.content or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in
            piped.get("tool_calls", [])] == calls(r.choices[0].message)


def test_tiny_tools_on_every_route_and_plain_text_unchanged(tiny_node):
    oai, claude = clients(tiny_node)
    plain = oai.chat.completions.create(model="tools", messages=PARIS, max_tokens=16)
    with_tools = oai.chat.completions.create(model="tools", messages=PARIS, max_tokens=16,
                                             tools=[WEATHER], tool_choice="none")
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    msg = claude.messages.create(model="tools", max_tokens=16, messages=PARIS, tools=[{
        "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason in ("tool_use", "end_turn", "max_tokens")
    r = oai.responses.create(model="tools", input="What is the weather like in Paris today?",
                             max_output_tokens=16, tools=[{
                                 "type": "function", "name": "get_weather",
                                 "parameters": WEATHER["function"]["parameters"]}],
                             tool_choice={"type": "function", "name": "get_weather"})
    assert r.status in ("completed", "incomplete") and r.output


def test_tiny_responses_stream_and_previous_response(tiny_node):
    oai, _ = clients(tiny_node)
    first = oai.responses.create(model="tools", input="Tell me a story.", max_output_tokens=12,
                                 instructions="Be brief.")
    assert first.status == "incomplete" and first.usage.output_tokens == 12
    with oai.responses.stream(model="tools", input="Tell me a story.", max_output_tokens=12,
                              instructions="Be brief.") as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Cut at max_output_tokens, a stream ends with response.incomplete, as OpenAI's does.
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert "".join(deltas) == first.output_text == final.response.output_text
    assert final.response.model_extra["timing"]["ttft_s"] >= 0
    second = oai.responses.create(model="tools", input="And then?", max_output_tokens=4,
                                  previous_response_id=first.id)
    # The whole first exchange is in the prompt (its instructions are not).
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8


# ---- the real Qwen2.5-Coder-0.5B ------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_node(tmp_path_factory):
    from skulkp2p.models.store import ModelStore

    ModelStore(test_data_dir()).pull("qwen2.5-coder-0.5b")
    tmp = tmp_path_factory.mktemp("qwen-node")
    n = Node("qwen2.5-coder-0.5b", tmp, "--data-dir", str(test_data_dir()),
             ready_timeout=300)
    yield n
    assert n.stop() == 0, n.text()[-3000:]


@pytest.mark.slow
def test_qwen_openai_tool_calls(qwen_node):
    oai, _ = clients(qwen_node)
    r = oai.chat.completions.create(model="qwen2.5-coder-0.5b", messages=PARIS,
                                    tools=[WEATHER], max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    ((name, arguments),) = calls(r.choices[0].message)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert r.model_extra["speculation"]["drafted"] > 0  # lookup ran over the call's tokens
    text, found, finish, spec = streamed(oai.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=PARIS, tools=[WEATHER], max_tokens=60,
        stream=True))
    assert (text, found, finish) == ("", calls(r.choices[0].message), "tool_calls")
    assert spec["drafted"] > 0

    # Greedy calls are the same byte for byte without speculation and with each drafter.
    for choice in ("auto", "required", NAMED):
        outs = []
        for spec in ("off", {"drafter": "lookup", "depth": 4}, "auto"):
            r = oai.chat.completions.create(model="qwen2.5-coder-0.5b", messages=PARIS,
                                            tools=[WEATHER], tool_choice=choice,
                                            max_tokens=60, extra_body={"speculation": spec})
            m = r.choices[0].message
            outs.append((m.content, calls(m), r.choices[0].finish_reason))
        assert outs[0] == outs[1] == outs[2], (choice, outs)
        assert outs[0][1] and json.loads(outs[0][1][0][1]) == {"city": "Paris"}

    # The tool's result goes back in the history; parallel_tool_calls false: at most one call.
    first = r.choices[0].message
    history = [*PARIS, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    r = oai.chat.completions.create(model="qwen2.5-coder-0.5b", messages=history,
                                    tools=[WEATHER], max_tokens=60, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls or []) <= 1
    assert r.usage.prompt_tokens > 200


@pytest.mark.slow
def test_qwen_anthropic_tool_use(qwen_node):
    _, claude = clients(qwen_node)
    tool = {"name": "get_weather", "description": "Get the current weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    msg = claude.messages.create(model="qwen2.5-coder-0.5b", max_tokens=60, tools=[tool],
                                 messages=PARIS)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with claude.messages.stream(model="qwen2.5-coder-0.5b", max_tokens=60, tools=[tool],
                                messages=PARIS) as s:
        events = list(s)
        final = s.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}
    follow = claude.messages.create(
        model="qwen2.5-coder-0.5b", max_tokens=40, tools=[tool],
        messages=[*PARIS, {"role": "assistant", "content": msg.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id,
                       "content": "21 degrees, sunny"}]}])
    assert follow.usage.input_tokens > msg.usage.input_tokens
    assert follow.stop_reason in ("end_turn", "tool_use", "max_tokens")


@pytest.mark.slow
def test_qwen_responses_function_call_and_output(qwen_node):
    oai, _ = clients(qwen_node)
    tool = {"type": "function", "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
    r = oai.responses.create(model="qwen2.5-coder-0.5b", input=PARIS[0]["content"],
                             tools=[tool], max_output_tokens=60)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.model_extra["speculation"]["drafted"] > 0
    with oai.responses.stream(model="qwen2.5-coder-0.5b", input=PARIS[0]["content"],
                              tools=[tool], max_output_tokens=60) as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    assert [o.type for o in final.output] == ["function_call"]
    follow = oai.responses.create(
        model="qwen2.5-coder-0.5b", previous_response_id=r.id, tools=[tool],
        max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "21 degrees, sunny"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


# ---- the same model served by llama-server --------------------------------------------------

@pytest.fixture(scope="module")
def served_qwen(tmp_path_factory):
    from skulkp2p.served.binary import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: install skulkp2p[served] or set SKULKP2P_LLAMA_SERVER_BIN")
    tmp = tmp_path_factory.mktemp("served-qwen")
    # One llama.cpp thread unless told otherwise: with one per core its threads spin at every
    # op's barrier, and on a busy 2-core machine one descheduled stalls the other (the test's
    # requests ran several times slower with two threads beside other work).
    env = {"SKULKP2P_LLAMA_SERVER_THREADS": os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS")
           or "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        n = Node("qwen2.5-coder-0.5b-gguf", tmp, "--data-dir", str(test_data_dir()),
                 ready_timeout=600)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield n
    assert n.stop() == 0, n.text()[-3000:]


@pytest.mark.slow
def test_served_qwen_tool_calls_through_the_proxy(served_qwen):
    """llama-server renders the tools with the GGUF's template (--jinja) and parses the calls;
    a forced call is prefilled as the assistant's turn, which it continues and parses."""
    oai, claude = clients(served_qwen)
    model = "qwen2.5-coder-0.5b-gguf"
    r = oai.chat.completions.create(model=model, messages=PARIS, tools=[WEATHER],
                                    tool_choice=NAMED, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    ((name, arguments),) = calls(r.choices[0].message)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert r.model_extra["timing"]["engine"] == "llama_server"
    assert r.model_extra["speculation"]["drafter"] == "llama_server:ngram-simple"
    text, found, finish, _ = streamed(oai.chat.completions.create(
        model=model, messages=PARIS, tools=[WEATHER], tool_choice=NAMED, max_tokens=60,
        stream=True))
    assert (found, finish) == (calls(r.choices[0].message), "tool_calls")
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    with claude.messages.stream(model=model, max_tokens=60, tools=[tool], messages=PARIS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}
    # Unforced, this model writes the call's JSON without its tags, which llama-server leaves
    # as text (the MLX engine reads it as a call): tools pass through either way.
    r = oai.chat.completions.create(model=model, messages=PARIS, tools=[WEATHER],
                                    max_tokens=60)
    assert r.choices[0].finish_reason in ("tool_calls", "stop")
