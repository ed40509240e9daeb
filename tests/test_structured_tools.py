"""Tool calls held to their format (engine/decode/tool_grammar.py), in process on a tiny model
whose Hermes-style chat template renders tools: the lazy grammar's life (free text until a call
opens, the call grammar to its end, free again), forced calls whose arguments fit the schema,
exactness (greedy with speculation == constrained plain decoding; before a call, the output
is unconstrained decoding's), the bounded parse of the model's call text, and the front ends'
errors (a strict tool's schema, Anthropic's output_config)."""

from __future__ import annotations

import json

import pytest

from skulkp2p.engine.decode.loop import decode
from skulkp2p.engine.decode.sampling import make_rng
from skulkp2p.engine.decode.tool_calls import (
    MAX_CALL_DEPTH,
    MAX_CALL_TEXT,
    ToolCallParser,
    ToolFormat,
)
from skulkp2p.engine.decode.tool_grammar import ToolCallGrammar
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.request import (
    GenerationRequest,
    Message,
    RequestError,
    ResponseFormat,
    SamplingParams,
    Speculation,
    Tool,
    ToolChoice,
)
from skulkp2p.formats.anthropic_messages import messages_request
from skulkp2p.formats.openai_chat import chat_request
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.responses_api import response_request
from tests.helpers.tool_models import FORECAST, conforms, tools_model

TOOLS = (Tool("forecast", "The forecast", FORECAST, True),
         Tool("ping", None, {"type": "object", "properties": {}}, None))
ASK = (Message("user", "What is the weather like in Paris today?"),)
SPECS = [Speculation(mode="off"), Speculation(mode="explicit", drafter="lookup", depth=4),
         Speculation(mode="auto")]


@pytest.fixture(scope="module")
def lm(tiny_models, tmp_path_factory):
    from skulkp2p.engine.model.loaded import load_model

    d = tools_model(tiny_models["llama"], tmp_path_factory.mktemp("tiny-tools") / "tools")
    return load_model(d, "tools")


AUTO, TEXT, GREEDY = ToolChoice(), ResponseFormat(), SamplingParams()


def _grammar(lm, choice: ToolChoice = AUTO, fmt: ResponseFormat = TEXT) -> ToolCallGrammar:
    from skulkp2p.engine.runner.generate import constraint

    g = constraint(lm, GenerationRequest(messages=ASK, tools=TOOLS, tool_choice=choice,
                                         response_format=fmt))
    assert isinstance(g, ToolCallGrammar)
    return g


def _ids(lm, text: str) -> list[int]:
    return list(lm.tokenizer.encode(text, add_special_tokens=False))


def test_lazy_grammar_is_free_until_a_call_opens_then_holds_it(lm):
    g = _grammar(lm)
    call = '<tool_call>\n{"name": "forecast", "arguments": {"unit": "c", "days": 3, ' \
           '"rain": false}}\n</tool_call>'
    ids = _ids(lm, "Let me see. " + call + " Done")
    # (a draft is checked up to the call's end: what follows is decided once it is emitted)
    assert g.valid_prefix(ids) == len(ids) - len(_ids(lm, " Done"))
    states = []
    for t in ids:
        m = g.mask()
        assert m is None or m[t]
        states.append(m is not None)
        g.accept(t)
    # Free text, then held from the marker's last token to the end marker, then free again.
    assert states[0] is False and states[-1] is False and any(states)
    first, last = states.index(True), len(states) - states[::-1].index(True)
    assert all(states[first:last])
    held = lm.tokenizer.decode(ids[first:last])
    assert held.startswith("\n") and held.rstrip().endswith("</tool_call>")
    # Arguments the schema refuses are cut from a draft; so is a function not offered.
    for bad in ('"unit": "k", "days": 3', '"unit": "c", "days": 9'):
        g = _grammar(lm)
        bad_ids = _ids(lm, '<tool_call>\n{"name": "forecast", "arguments": {' + bad + "}}")
        assert g.valid_prefix(bad_ids) < len(bad_ids)
    g = _grammar(lm)
    other = _ids(lm, '<tool_call>\n{"name": "other", "arguments": {}}')
    assert g.valid_prefix(other) < len(other)
    # A non-strict tool takes any object; the bare form (no markers) opens a call too.
    g = _grammar(lm)
    bare = _ids(lm, '{"name": "ping", "arguments": {"any": [1, "x"]}}')
    assert g.valid_prefix(bare) == len(bare)
    for t in bare:
        g.accept(t)
    assert g.mask() is None  # the call ended: free again
    g.rollback(len(bare))
    assert g.accepted == 0 and g.mask() is None


def test_forced_and_answer_grammars_start_at_the_first_token(lm):
    eos = sorted(lm.tokenizer.eos_token_ids)
    g = _grammar(lm, ToolChoice("function", "forecast"))
    assert lm.tokenizer.decode(g.forced()).startswith(' {"unit": "')  # the opening's rest
    g = _grammar(lm, ToolChoice("required"))
    m = g.mask()
    assert m is not None and not m[eos].any()
    g = _grammar(lm, fmt=ResponseFormat("json_schema", {"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"]}))
    assert g.valid_prefix(_ids(lm, '{"ok": true}')) == len(_ids(lm, '{"ok": true}'))
    assert g.valid_prefix(_ids(lm, "hello")) == 0


def _run(lm, choice: ToolChoice, spec: Speculation, fmt: ResponseFormat = TEXT,
         sampling: SamplingParams = GREEDY, max_tokens: int = 80):
    from skulkp2p.engine.runner.generate import run

    return run(lm, GenerationRequest(messages=ASK, tools=TOOLS, tool_choice=choice,
                                     speculation=spec, response_format=fmt,
                                     sampling=sampling, max_tokens=max_tokens))


@pytest.mark.parametrize("choice", [ToolChoice("function", "forecast"), ToolChoice("required")],
                         ids=["named", "required"])
def test_forced_calls_fit_the_schema_and_speculation_is_exact(lm, choice):
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        plain = _run(lm, choice, SPECS[0], sampling=sampling)
        # (random weights may write on after the call, to the length)
        assert plain.finish_reason in ("tool_calls", "length") and plain.tool_calls, plain
        for call in plain.tool_calls:
            args = json.loads(call.arguments)
            if call.name == "forecast":
                conforms(args, FORECAST)
            else:
                assert call.name == "ping" and isinstance(args, dict)
        if choice.mode == "function":
            assert plain.tool_calls[0].name == "forecast"
        for spec in SPECS[1:]:
            got = _run(lm, choice, spec, sampling=sampling)
            assert got.tokens == plain.tokens, (spec, sampling)


def test_auto_tools_output_is_unconstrained_until_a_call(lm):
    """With tools offered (auto), the grammar leaves every row free until a call opens: the
    random model writes no call here, so its tokens are plain decoding's without any grammar,
    and speculation gives the same tokens."""
    from skulkp2p.engine.runner.generate import constraint, prompt_tokens

    req = GenerationRequest(messages=ASK, tools=TOOLS, max_tokens=30)
    prompt = prompt_tokens(lm, req)
    runs = []
    for grammar in (None, constraint(lm, req)):
        fwd = LocalForward(lm.model, 512)
        runs.append(list(decode(fwd, prompt, SamplingParams(), 30, make_rng(None),
                                grammar=grammar)))
    assert runs[0] == runs[1]
    plain = _run(lm, ToolChoice(), SPECS[0], max_tokens=30)
    for spec in SPECS[1:]:
        assert _run(lm, ToolChoice(), spec, max_tokens=30).tokens == plain.tokens


def test_tools_with_a_response_format_give_calls_or_a_fitting_answer(lm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = ResponseFormat("json_schema", schema, name="answer")
    for seed in range(3):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        got = _run(lm, ToolChoice(), SPECS[0], fmt, sampling)
        for call in got.tool_calls:
            conforms(json.loads(call.arguments), FORECAST if call.name == "forecast" else {})
        if got.finish_reason == "length":  # (random weights may call on, cut at the length)
            assert got.text.startswith(("<tool_call>", "{")) or got.text == ""
        elif got.tool_calls:
            assert got.text == ""
        else:
            conforms(json.loads(got.text), schema)
        assert _run(lm, ToolChoice(), SPECS[1], fmt, sampling).tokens == got.tokens


def test_pipe_line_with_required_tool_gives_a_fitting_call(lm):
    from skulkp2p.engine.runner.generate import run

    req = parse_request({"messages": [{"role": "user", "content": "weather?"}],
                         "tools": [{"type": "function", "function": {
                             "name": "forecast", "parameters": FORECAST, "strict": True}}],
                         "tool_choice": "required", "max_tokens": 80,
                         "parallel_tool_calls": False})
    got = run(lm, req)
    assert got.finish_reason == "tool_calls"
    conforms(json.loads(got.tool_calls[0].arguments), FORECAST)


# ---- the model's call text, bounded ----------------------------------------------------------

def _parser() -> ToolCallParser:
    fmt = ToolFormat("json_tools", "<tool_call>", "</tool_call>",
                     lambda text, tools: json.loads(text.strip()), json_object=True)
    return ToolCallParser(fmt, TOOLS)


@pytest.mark.parametrize("arguments", [
    "[" * (MAX_CALL_DEPTH + 1) + "]" * (MAX_CALL_DEPTH + 1),
    "[" * 100_000 + "]" * 100_000,  # deeper than Python's recursion
    '{"x": "' + "a" * MAX_CALL_TEXT + '"}',
], ids=["deep", "very-deep", "long"])
def test_call_text_past_the_bounds_comes_back_as_text(arguments):
    for text in (f'<tool_call>\n{{"name": "ping", "arguments": {{"a": {arguments}}}}}\n'
                 "</tool_call>", f'{{"name": "ping", "arguments": {{"a": {arguments}}}}}',
                 f'<tool_call>\n{{"name": "ping", "arguments": {json.dumps(arguments)}}}'
                 "\n</tool_call>"):
        p = _parser()
        out = p.feed(text) + p.finish()
        assert p.calls == [] and "".join(e for e in out if isinstance(e, str)) == text


# ---- the front ends --------------------------------------------------------------------------

def _check(model: object) -> None:
    return None


def test_a_strict_tool_schema_the_grammar_refuses_is_a_400_naming_its_path():
    bad = {"type": "object", "properties": {"x": {"type": "string", "minLength": -1}}}
    with pytest.raises(RequestError) as e:
        chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"type": "function", "function": {
                          "name": "f", "parameters": bad, "strict": True}}]}, _check)
    assert e.value.param == "tools[0].function.parameters.properties.x.minLength"
    with pytest.raises(RequestError) as e:
        response_request({"model": "m", "input": "x", "tools": [{
            "type": "function", "name": "f", "parameters": bad, "strict": True}]}, _check,
            lambda rid: ())
    assert e.value.param == "tools[0].parameters.properties.x.minLength"
    with pytest.raises(RequestError) as e:
        messages_request({"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"}], "tools": [{
                "name": "f", "input_schema": bad, "strict": True}]}, _check)
    assert e.value.param == "tools[0].input_schema.properties.x.minLength"
    # Not strict: the schema is only shown to the model, any object is taken.
    chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]},
                 _check)


@pytest.mark.parametrize("body, param", [
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "intger"}}}},
     "output_config.format.schema.type"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"nope": 1}}, "output_config.nope"),
    ({"output_format": {"type": "json_schema", "schema": {"minLength": -1, "type": "string"}}},
     "output_format.schema.minLength"),
])
def test_anthropic_output_format_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as e:
        messages_request({"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"}], **body}, _check)
    assert e.value.param == param


def test_anthropic_output_config_is_a_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                 {"output_format": {"type": "json_schema", "schema": schema}}):
        got = messages_request({"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"}], **body}, _check)
        assert got.req.response_format.type == "json_schema"
        assert got.req.response_format.schema == schema


def test_llama_server_child_refuses_tools_with_a_format():
    from skulkp2p.served.served_engine import child_body

    req = GenerationRequest(messages=ASK, tools=TOOLS,
                            response_format=ResponseFormat("json_object"))
    with pytest.raises(RequestError) as e:
        child_body(req, 16)
    assert e.value.param == "response_format"
