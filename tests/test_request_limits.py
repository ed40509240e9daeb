"""What a request may hold, bounded before it costs anything: JSON nested too deep or too long
anywhere in a request is a 400 naming the field (every HTTP route, the pipe), and a prompt too
long for the model's context is refused by its characters before it is tokenised, else by its
tokens, tokenised once, with the memory given back (a real node's RSS stays near its baseline).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import sys

import pytest

from skulkp2p.engine.request import RequestError
from skulkp2p.engine.runner.generate import CHARS_PER_TOKEN_MARGIN, max_token_chars
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.anthropic_messages import messages_request
from skulkp2p.formats.body_fields import MAX_JSON_DEPTH, MAX_JSON_TEXT, FormatError
from skulkp2p.formats.openai_chat import chat_request
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.responses_api import response_request
from tests.helpers.batch import loaded
from tests.helpers.http_client import H11Client
from tests.helpers.procs import JoinNode, run_cli


def _nested(levels: int) -> str:
    """JSON text of an object `levels` levels deep: {"a": {"a": ... {} ...}}."""
    return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)


def _call(arguments: object) -> list[dict]:
    """A chat whose assistant called a tool with these arguments, and the call's result."""
    return [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def _no_model(name: object) -> None:
    return None


DEEP = _nested(5000)  # past any parser's recursion
TOO_DEEP = _nested(MAX_JSON_DEPTH + 1)


# ---- the formats, in process ------------------------------------------------------------------


@pytest.mark.parametrize("arguments,says", [
    (DEEP, "nests deeper than"), (TOO_DEEP, "nests deeper than"),
    ('{"x": "' + "y" * MAX_JSON_TEXT + '"}', "characters of JSON"),
    ('{"x": ', "is not valid JSON"),
], ids=["5000 levels", "one level too deep", "too long", "cut off"])
def test_a_call_s_arguments_are_parsed_bounded(arguments, says):
    with pytest.raises(FormatError) as e:
        parse_request({"messages": _call(arguments)})
    assert e.value.param == "messages" and e.value.status == 400 and says in e.value.message
    assert "messages[1].tool_calls[0].function.arguments" in e.value.message


def test_arguments_as_deep_as_allowed_are_taken():
    req = parse_request({"messages": _call(_nested(MAX_JSON_DEPTH))})
    assert req.messages is not None and req.messages[1].tool_calls[0].arguments.startswith("{")


@pytest.mark.parametrize("build,param", [
    (lambda deep: {"messages": _call(deep)}, "messages"),  # arguments given as an object
    (lambda deep: {"messages": [{"role": "user", "content": "hi"}], "metadata": deep},
     "metadata"),
    (lambda deep: {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "x-extra": deep}}}]}, "tools"),
], ids=["arguments object", "metadata", "a schema's unknown keyword"])
def test_deep_values_anywhere_in_a_chat_body_are_refused_by_field(build, param):
    deep = json.loads(_nested(600))  # (a body as deep is still read: orjson takes 1024)
    with pytest.raises(FormatError) as e:
        chat_request(build(deep), _no_model)
    assert e.value.param == param and "nests deeper than" in e.value.message


def test_responses_and_messages_bodies_are_bounded_too():
    with pytest.raises(FormatError) as e:
        response_request({"input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
            _no_model, lambda rid: ())
    assert e.value.param == "input" and "input[0].tool_calls[0].function.arguments" in str(e.value)
    with pytest.raises(FormatError) as e:
        response_request({"input": "hi", "metadata": json.loads(_nested(300))}, _no_model,
                         lambda rid: ())
    assert e.value.param == "metadata"
    with pytest.raises(FormatError) as e:
        messages_request({"max_tokens": 4, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": json.loads(_nested(600))}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}, _no_model)
    assert e.value.param == "messages" and "messages[1].content[0].input" in str(e.value)


# ---- the prompt's size, in process --------------------------------------------------------------


class Tokenised:
    """The real tokenizer of a model, counting the calls that tokenise (a chat template
    rendered to ids, a text encoded)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.calls = 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += bool(kwargs.get("tokenize", True))
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _counted_engine(tiny_model, memory_tokens: int = 4096):
    lm = loaded(tiny_model("llama"))
    counted = Tokenised(lm.tokenizer)
    lm = dataclasses.replace(lm, tokenizer=counted, runtime=dict(lm.runtime))
    return MlxEngine(lm, 0, memory_tokens=memory_tokens, max_batch=1), counted


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "prompt"])
def test_a_prompt_too_long_by_its_characters_is_never_tokenised(tiny_model, chat):
    engine, counted = _counted_engine(tiny_model)
    limit = (engine.context_length - 1) * max_token_chars(engine.loaded) * CHARS_PER_TOKEN_MARGIN
    text = "a" * (limit + 1)
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    req = parse_request(body)
    for ask in (engine.prompt_length, lambda r: list(engine.generate(r))):
        with pytest.raises(RequestError) as e:
            ask(req)
        assert f"prompt is {limit + 1} characters" in e.value.message
        assert e.value.param == ("messages" if chat else "prompt")
    assert counted.calls == 0


def test_a_prompt_too_long_by_its_tokens_is_tokenised_once(tiny_model):
    engine, counted = _counted_engine(tiny_model)
    req = parse_request({"messages": [{"role": "user", "content": "lorem ipsum " * 4000}]})
    assert req.text_length <= (engine.context_length - 1) * max_token_chars(engine.loaded)
    with pytest.raises(RequestError) as e:
        engine.prompt_length(req)
    assert "tokens; model" in e.value.message and counted.calls == 1


def test_a_request_is_tokenised_once_with_the_draft_memory_on(tiny_model):
    """prompt_length, then the generation: its stream, its drafter and the draft memory share
    the one tokenisation (a request the worker never asked the length of tokenises once too)."""
    engine, counted = _counted_engine(tiny_model)
    assert engine.memory.enabled
    req = parse_request({"messages": [{"role": "user", "content": "one two three one two"}],
                         "max_tokens": 6})
    n = engine.prompt_length(req)
    generation = engine.generate(req)
    list(generation)
    assert generation.result is not None and generation.result.usage.prompt_tokens == n
    assert counted.calls == 1
    assert engine.memory.tokens >= n  # (the memory took the same prompt and the answer)
    again = engine.generate(parse_request({"prompt": "one two three", "max_tokens": 3}))
    list(again)
    assert counted.calls == 2


# ---- through HTTP and the pipe ------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    n = JoinNode(str(tiny_models["llama"]), tmp, "--data-dir", str(tmp))
    yield n
    assert n.stop() == 0, n.text()[-3000:]


def _post(port: int, path: str, body: bytes):
    with H11Client(port, timeout=120) as c:
        return c.request("POST", path, body)


def _body(obj: dict, marker: str, deep: str) -> bytes:
    """`obj` as JSON with the string "<marker>" replaced by raw JSON text `deep` (a value too
    deep for json.dumps to write)."""
    return json.dumps(obj).replace(f'"{marker}"', deep).encode()


HTTP_CASES = [
    ("/v1/chat/completions", {"messages": _call(DEEP)}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": _call("DEEP")}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "metadata": "DEEP"}, "metadata", "metadata.a.a"),
    ("/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "input",
     "input[0].tool_calls[0].function.arguments"),
    ("/v1/responses", {"input": "hi", "metadata": "DEEP"}, "metadata", "metadata.a.a"),
    ("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": "DEEP"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}, "messages",
     "messages[1].content[0].input"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": "f", "input_schema": {"type": "object",
                                                                "properties": "DEEP"}}]},
     "tools", "tools[0].input_schema.properties"),
]


@pytest.mark.process
@pytest.mark.parametrize("path,obj,param,where", HTTP_CASES,
                         ids=["chat arguments text", "chat arguments object", "chat metadata",
                              "responses arguments", "responses metadata",
                              "messages tool_use input", "messages schema"])
def test_deep_json_is_a_400_naming_the_field_on_every_route(node, path, obj, param, where):
    r = _post(node.port, path, _body(obj, "DEEP", _nested(600)))
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == param and where in error["message"]
    assert "nests deeper than" in error["message"]
    assert node.healthy()


@pytest.mark.process
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_deep_body_naming_its_model_by_path_is_a_400(node, tiny_models, path):
    """The node names the model by its cluster-wide id and writes the body again (for the node
    that serves it): a body too deep to write is refused by field there, not a 500."""
    r = _post(node.port, path, _body(
        {"model": str(tiny_models["llama"]), "max_tokens": 2,
         "messages": [{"role": "user", "content": "hi"}], "metadata": "DEEP"}, "DEEP",
        _nested(300)))
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == "metadata"


@pytest.mark.process
def test_a_body_deeper_than_the_parser_takes_is_a_400(node):
    r = _post(node.port, "/v1/chat/completions", _body(
        {"messages": [{"role": "user", "content": "hi"}], "metadata": "DEEP"}, "DEEP",
        _nested(2000)))
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "depth" in r.json()["error"]["message"]


@pytest.mark.process
def test_the_pipe_answers_deep_arguments_with_an_error_line_and_goes_on(tiny_models):
    lines = [json.dumps({"id": "deep", "messages": _call(DEEP), "max_tokens": 2}),
             _body({"id": "object", "messages": _call("DEEP")}, "DEEP", _nested(600)).decode(),
             json.dumps({"id": "next", "prompt": "hello", "max_tokens": 2})]
    proc = run_cli("pipe", "--model", str(tiny_models["llama"]),
                   input="".join(line + "\n" for line in lines))
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    for answer, name in zip(out[:2], ["deep", "object"], strict=True):
        assert answer["id"] == name and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] == "messages"
        assert "nests deeper than" in answer["error"]["message"]
    assert out[2]["id"] == "next" and out[2]["usage"]["completion_tokens"] == 2
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr


def _rss_mb(pid: int) -> float:
    if sys.platform.startswith("linux"):
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip()) / 1024


# RSS a node may keep after the refused requests below, over its baseline, in MB: what their
# bodies' buffers leave (before prompts were bounded, the same requests kept hundreds of MB).
RSS_MARGIN_MB = 64


@pytest.mark.process
def test_refused_over_long_prompts_give_their_memory_back(node):
    """Over-long prompts, some refused by their characters (1 MB each, never tokenised), some
    by their tokens (tokenised, then refused), four at a time: each is a 400 naming its size,
    and the node's RSS ends within RSS_MARGIN_MB of where it was."""
    def ask(i: int, chars: int) -> tuple[int, str]:
        text = (f"{i} " + "lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
        r = _post(node.port, "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": text}], "max_tokens": 2}).encode())
        return r.status, r.json()["error"]["message"]

    sizes = [1_000_000, 50_000] * 8
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        warm = list(pool.map(ask, range(4), sizes[:4]))  # (the node's buffers, first use)
        baseline = _rss_mb(node.proc.pid)
        answers = list(pool.map(ask, range(len(sizes)), sizes))
    after = _rss_mb(node.proc.pid)
    for status, message in warm + answers:
        assert status == 400, message
    assert all("characters; model" in m for (_, m), n in zip(answers, sizes, strict=True)
               if n == 1_000_000)
    assert all("tokens; model" in m for (_, m), n in zip(answers, sizes, strict=True)
               if n == 50_000)
    assert after <= baseline + RSS_MARGIN_MB, (baseline, after)
    assert node.healthy()
