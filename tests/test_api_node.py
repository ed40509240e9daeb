"""The HTTP API of a real `join` (a subprocess on a tiny model, on loopback): the real openai and
anthropic clients, strict parsing with h11, a table of hostile inputs, cancellation on
disconnect, and greedy equality with the pipe."""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest

from tests.helpers.http_client import H11Client, parse_responses, raw_exchange
from tests.helpers.procs import JoinNode, run_cli

CHAT = [{"role": "user", "content": "Tell me a story about a dog."}]


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node")
    n = JoinNode(str(tiny_models["llama"]), tmp, "--data-dir", str(tmp),
                 "--http-header-timeout", "1", "--http-idle-timeout", "3", "--max-body-bytes",
                 "65536", "--sse-keepalive", "0.5")
    yield n
    assert n.stop() == 0, n.text()[-3000:]
    assert "stopped" in n.text()


@pytest.fixture
def oai(node):
    import openai
    return openai.OpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.process
def test_health_503_while_loading_then_200(node):
    statuses = [s for s, _ in node.health_while_loading]
    assert statuses and statuses[0] == 503, statuses  # the API was up before the model
    assert all(h.get("retry-after") for s, h in node.health_while_loading if s == 503)
    with H11Client(node.port) as c:
        r = c.request("GET", "/health")
        assert r.status == 200 and r.json()["model"] == "llama"
    assert "http: OpenAI/Anthropic API on http://127.0.0.1:" in node.text()


@pytest.mark.process
def test_openai_chat(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["llama"]
    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=12,
                                    extra_body={"speculation": "off"})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    text = r.choices[0].message.content
    assert text

    chunks = list(oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=12,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len(chunks) >= 10  # flushed per token, not in one piece

    # Speculation stats ride along (lookup by default on this node).
    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=12)
    assert r.choices[0].message.content == text  # greedy with or without a drafter
    assert r.model_extra["speculation"]["drafter"] == "lookup"


@pytest.mark.process
def test_openai_stop_and_seed(oai):
    full = oai.completions.create(model="llama", prompt="Once upon a time", max_tokens=20,
                                  temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens == 20
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = oai.completions.create(model="llama", prompt="Once upon a time", max_tokens=20,
                                 stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = list(oai.completions.create(model="llama", prompt="Once upon a time",
                                           max_tokens=20, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"

    kw = dict(model="llama", messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95)
    a = oai.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = oai.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
        seed=7, stream=True, **kw))
    assert a == b == c


@pytest.mark.process
def test_openai_unsupported_options_are_refused_by_name(oai):
    import openai

    cases = [
        (dict(n=2), "n"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
         "tools"),
        (dict(logprobs=True), "logprobs"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(extra_body={"banana": 1}), "banana"),
        (dict(max_tokens="many"), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(extra_body={"speculation": {"drafter": "oracle"}}), "speculation"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="llama", messages=CHAT, **kw)
        assert info.value.body["param"] == param, (kw, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:  # refused by the engine, still a 400
        oai.chat.completions.create(model="llama", messages=CHAT, stream=True,
                                    extra_body={"speculation": {"drafter": "mtp"}})
    assert info.value.body["param"] == "speculation"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=CHAT)
    # Harmless defaults pass.
    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, n=1, user="u",
                                    tool_choice="none", logprobs=False,
                                    response_format={"type": "text"}, presence_penalty=0)
    assert r.usage.completion_tokens == 2


@pytest.mark.process
def test_anthropic_messages(node):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=node.base, api_key="none", max_retries=0, timeout=60)
    kw = dict(model="llama", max_tokens=16, system="You are terse.",
              messages=[{"role": "user", "content": "Tell me a story."}])
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 16 and msg.usage.input_tokens > 5
    text = msg.content[0].text
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.usage.output_tokens == 16
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.messages.create(stop_sequences=[stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**{**kw, "stop_sequences": [123]})
    assert info.value.body["error"]["param"] == "stop_sequences"


@pytest.mark.process
def test_prefix_cache_usage_over_http(node, oai):
    """A repeated prompt comes from the prefix cache: OpenAI says so in
    usage.prompt_tokens_details.cached_tokens (also in a stream's usage chunk), Anthropic in
    usage.cache_read_input_tokens (also in message_delta); the text is the same."""
    messages = [{"role": "user", "content": "Count the herons by the mill pond. " * 12}]
    first = oai.chat.completions.create(model="llama", messages=messages, max_tokens=6)
    again = oai.chat.completions.create(model="llama", messages=messages, max_tokens=6)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached == again.usage.prompt_tokens - 1
    chunks = list(oai.chat.completions.create(model="llama", messages=messages, max_tokens=6,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=node.base, api_key="none", max_retries=0, timeout=60)
    msg = client.messages.create(model="llama", max_tokens=6, messages=messages)
    assert msg.usage.cache_read_input_tokens == msg.usage.input_tokens - 1
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/messages", {"model": "llama", "max_tokens": 6, "stream": True,
                                               "messages": messages})
    delta = [json.loads(d) for n, d in r.sse() if n == "message_delta"][0]
    assert delta["usage"]["cache_read_input_tokens"] == msg.usage.input_tokens - 1


@pytest.mark.process
def test_anthropic_event_sequence_raw(node):
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/messages", {"model": "llama", "max_tokens": 5, "stream": True,
                                               "messages": CHAT})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.sse()
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    datas = [json.loads(d) for _, d in events]
    assert all(d["type"] == n for (n, _), d in zip(events, datas, strict=True))
    assert datas[-2]["usage"]["output_tokens"] == 5
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.process
def test_h11_strict_keep_alive_streaming_and_errors(node):
    """One connection, every reply parsed strictly by h11 as a client."""
    with H11Client(node.port) as c:
        assert c.request("GET", "/health").status == 200
        r = c.request("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
        assert r.status == 200 and "content-length" in r.headers
        r = c.request("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6,
                                                       "stream": True})
        assert r.status == 200 and r.headers["transfer-encoding"] == "chunked"
        events = r.sse()
        assert events[-1] == (None, "[DONE]") and len(r.chunks) >= 6  # one write per token
        r = c.request("POST", "/v1/chat/completions", {"messages": "hi"})
        assert r.status == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = c.request("GET", "/v1/nothing")
        assert r.status == 404 and r.json()["error"]["code"] == "not_found"
        r = c.request("PUT", "/v1/models")
        assert r.status == 405 and r.headers["allow"] == "GET, HEAD"
        assert c.request("GET", "/v1/models").status == 200  # still the same connection


def _post(path: str, body: bytes, close: bool = False) -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    return (b"POST %b HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%b\r\n%b"
            % (path.encode(), len(body), extra, body))


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


CHAT_PATH = "/v1/chat/completions"
ONE = json.dumps({"messages": CHAT, "max_tokens": 2}).encode()

HOSTILE = [
    ("oversize headers", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: "
     + b"a" * 17000 + b"\r\n\r\n", [431]),
    ("oversize body", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Content-Length: 100000\r\n\r\n" + b"{" * 1000, [413]),
    ("oversize chunked body", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n" + (b"8000\r\n" + b"a" * 0x8000 + b"\r\n") * 3, [413]),
    ("bad chunk size", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nxyz\r\nabc\r\n0\r\n\r\n", [400]),
    ("chunk without CRLF", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", [400]),
    ("unknown transfer coding", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Transfer-Encoding: br\r\n\r\n", [501]),
    ("conflicting lengths", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", [400]),
    ("malformed request line", b"HELLO\r\n\r\n", [400]),
    ("binary garbage", bytes(range(256)) + b"\r\n\r\n", [400]),
    ("bad JSON", _post(CHAT_PATH, b'{"messages": [}', True), [400]),
    ("not UTF-8", _post(CHAT_PATH, b'{"prompt": "\xff\xfe"}', True), [400]),
    ("JSON array", _post(CHAT_PATH, b"[1, 2, 3]", True), [400]),
    ("wrong type", _post(CHAT_PATH, b'{"messages": "hi"}', True), [400]),
    ("negative max_tokens", _post(CHAT_PATH, json.dumps(
        {"messages": CHAT, "max_tokens": -5}).encode(), True), [400]),
    ("bool temperature", _post("/v1/completions", b'{"prompt": "a", "temperature": true}',
                               True), [400]),
    ("empty body", _post(CHAT_PATH, b"", True), [400]),
    ("chunked JSON request", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
     + _chunked([b'{"prompt": "abc"', b', "max_tokens": 2', b"}"]), [200]),
    ("pipelined", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + _post(CHAT_PATH, ONE)
     + b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
     + b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
     [200, 200, 404, 200]),
    ("unknown route", b"GET /admin HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
     [404]),
    ("wrong method", b"GET /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"Connection: close\r\n\r\n", [405]),
]


@pytest.mark.process
@pytest.mark.parametrize("name,raw,statuses", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_inputs(node, name, raw, statuses):
    replies = parse_responses(raw_exchange(node.port, raw))
    assert [r.status for r in replies] == statuses, name
    for r in replies:
        if r.status >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert node.healthy()


@pytest.mark.process
def test_hostile_slow_headers_get_408(node):
    t0 = time.monotonic()
    replies = parse_responses(raw_exchange(node.port, [b"GET /health HTTP/1.1\r\n", b"Host:",
                                                       b" x\r\n"], pause=0.6))
    assert [r.status for r in replies] == [408] and time.monotonic() - t0 < 5
    assert node.healthy()


def _stream_then_vanish(port: int, body: dict, chunks: int) -> float:
    """Start a streaming request, read a few chunks, drop the connection abruptly (RST).
    Returns the token rate seen (chunks per second)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(_post(CHAT_PATH, data))
    buf, t_first, seen = b"", None, 0
    while seen < chunks:
        got = s.recv(65536)
        assert got, buf
        buf += got
        seen = buf.count(b'"content"')
        if t_first is None and seen:
            t_first, first_seen = time.monotonic(), seen
    rate = (seen - first_seen) / max(time.monotonic() - t_first, 1e-3)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # linger 0: a reset, as a killed client gives
    return rate


@pytest.mark.process
def test_disconnect_mid_stream_frees_the_engine(node, oai):
    long = {"messages": CHAT, "max_tokens": 3000, "speculation": "off", "stream": True}
    rate = _stream_then_vanish(node.port, long, chunks=30)
    would_take = 3000 / rate
    t0 = time.monotonic()
    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=20)
    took = time.monotonic() - t0
    assert r.usage.completion_tokens == 20
    assert took < would_take / 4, (took, would_take)
    deadline = time.monotonic() + 10
    while "job" not in node.text() or "cancelled after" not in node.text():
        assert time.monotonic() < deadline, node.text()[-2000:]
        time.sleep(0.05)


@pytest.mark.process
def test_disconnect_of_a_non_streaming_request_frees_the_engine(node, oai):
    """No byte is written before the end here: the read side tells us the client left."""
    s = socket.create_connection(("127.0.0.1", node.port))
    s.sendall(_post(CHAT_PATH, json.dumps({"messages": CHAT, "max_tokens": 3000,
                                           "speculation": "off"}).encode()))
    before = node.text().count("cancelled after")
    time.sleep(0.5)
    s.close()
    t0 = time.monotonic()
    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=20)
    assert r.usage.completion_tokens == 20 and time.monotonic() - t0 < 5
    assert node.text().count("cancelled after") == before + 1


@pytest.mark.process
def test_greedy_http_equals_pipe(node, oai, tiny_models):
    reqs = [{"id": "chat", "messages": CHAT, "max_tokens": 24},
            {"id": "raw", "prompt": "The capital of France is", "max_tokens": 24},
            {"id": "stop", "prompt": "The capital of France is", "max_tokens": 24, "stop": ["e"]}]
    proc = run_cli("pipe", "--model", str(tiny_models["llama"]),
                   input="".join(json.dumps(r) + "\n" for r in reqs), timeout=120)
    assert proc.returncode == 0, proc.stderr
    piped = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    chat = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=24)
    assert chat.choices[0].message.content == piped["chat"]["text"]
    assert chat.usage.completion_tokens == len(piped["chat"]["tokens"])
    for rid in ("raw", "stop"):
        kw = {"stop": ["e"]} if rid == "stop" else {}
        r = oai.completions.create(model="llama", prompt="The capital of France is",
                                   max_tokens=24, **kw)
        assert r.choices[0].text == piped[rid]["text"], rid
        assert r.choices[0].finish_reason == piped[rid]["finish_reason"]
        assert r.usage.prompt_tokens == piped[rid]["usage"]["prompt_tokens"]


@pytest.mark.process
@pytest.mark.slow
def test_smollm2_over_http(smollm2_path, tmp_path):
    import openai

    n = JoinNode("smollm2-135m", tmp_path, "--data-dir", str(smollm2_path.parent.parent),
                 "--engine", "mlx", ready_timeout=300)
    try:
        client = openai.OpenAI(base_url=n.base + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smollm2-135m", messages=chat, max_tokens=40)
        text = r.choices[0].message.content
        assert "Paris" in text and r.usage.completion_tokens <= 40
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions
                           .create(model="smollm2-135m", messages=chat, max_tokens=40,
                                   stream=True))
        assert streamed == text
        cut = client.chat.completions.create(model="smollm2-135m", messages=chat, max_tokens=40,
                                             stop=["Paris"])
        assert cut.choices[0].finish_reason == "stop" and "Paris" not in cut.choices[0].message\
            .content
    finally:
        assert n.stop() == 0
    assert os.path.exists(n.log)
