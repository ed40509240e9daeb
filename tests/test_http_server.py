"""The HTTP server and the API glue in-process, on a real loopback socket, with a scripted fake
engine (no MLX): readiness, timeouts, queueing, cancellation, keep-alives and failures, each
deterministic. The real engine behind a real `join` is tested in test_api_node.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from tests.helpers.fake_engine import LiveNode, Script, chat, wait_until
from tests.helpers.http_client import H11Client, parse_responses, raw_exchange


@pytest.fixture
def node():
    n = LiveNode(Script())
    n.wait_ready()
    yield n
    n.close()


def test_health_503_while_loading_then_200():
    gate = threading.Event()
    n = LiveNode(Script(), load_gate=gate)
    try:
        with H11Client(n.port) as c:
            r = c.request("GET", "/health")
            assert r.status == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "model_loading"
            r = c.request("POST", "/v1/chat/completions", chat("hi"))
            assert r.status == 503 and "retry-after" in r.headers
            assert c.request("GET", "/v1/models").json()["data"][0]["ready"] is False
            gate.set()
            n.wait_ready()
            r = c.request("GET", "/health")
            assert r.status == 200 and r.json()["status"] == "ok"
    finally:
        gate.set()
        n.close()


def test_routes_errors_and_keep_alive(node):
    with H11Client(node.port) as c:  # one connection throughout: every answer keeps it
        r = c.request("GET", "/nope")
        assert r.status == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = c.request("DELETE", "/v1/chat/completions")
        assert r.status == 405 and r.headers["allow"] == "POST"
        r = c.request("POST", "/health", b"{}")
        assert r.status == 405 and r.headers["allow"] == "GET, HEAD"
        r = c.request("POST", "/v1/chat/completions", b"{not json")
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.request("POST", "/v1/chat/completions", chat("hi", model="other"))
        assert r.status == 404 and r.json()["error"]["param"] == "model"
        r = c.request("POST", "/v1/chat/completions", chat("hi", model="alias"))
        assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "
        r = c.request("POST", "/v1/chat/completions", chat("too-long"))
        assert r.status == 400 and r.json()["error"]["param"] == "prompt"


def test_non_streaming_failure_is_a_500_not_a_truncated_200(node):
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 fail=2"))
        assert r.status == 500 and "the engine broke" in r.json()["error"]["message"]
        r = c.request("POST", "/v1/messages", {**chat("tokens=5 fail=2"), "max_tokens": 5})
        assert r.status == 500 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "api_error"
        assert c.request("GET", "/health").status == 200


def test_a_broken_ring_is_a_503_to_retry(node):
    """A ring of nodes breaking under a request is transient (the leader re-places the model):
    503 ring_failed with Retry-After, naming the model, on every route; a stream already
    started ends with the same code in its error event."""
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 ringfail=2"))
        err = r.json()["error"]
        assert r.status == 503 and r.headers["retry-after"] == "1", r.json()
        assert err["code"] == "ring_failed" and err["type"] == "service_unavailable"
        assert "model fake" in err["message"] and "retry" in err["message"]
        assert "dropped the frame" in err["message"]
        r = c.request("POST", "/v1/messages", {**chat("tokens=5 ringfail=0"), "max_tokens": 5})
        assert r.status == 503 and r.headers["retry-after"] == "1" and r.json()["type"] == "error"
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 ringfail=2", stream=True))
        events = r.sse()
        assert r.status == 200 and json.loads(events[-1][1])["error"]["code"] == "ring_failed"
        assert c.request("GET", "/health").status == 200


def test_a_broken_tensor_group_is_a_503_to_retry(node):
    """A tensor-parallel group breaking under a request (a member killed or frozen, the group
    torn down by a re-placement) is transient like a broken ring: 503 tensor_group_failed with
    Retry-After, naming the model and the cause, on every route; a stream already started ends
    with the same code in its error event."""
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 tensorfail=2"))
        err = r.json()["error"]
        assert r.status == 503 and r.headers["retry-after"] == "1", r.json()
        assert err["code"] == "tensor_group_failed" and err["type"] == "service_unavailable"
        assert "model fake" in err["message"] and "retry" in err["message"]
        assert "node n1 is dead" in err["message"]
        r = c.request("POST", "/v1/completions",
                      {"model": "fake", "prompt": "tokens=5 tensorfail=0"})
        assert r.status == 503 and r.json()["error"]["code"] == "tensor_group_failed"
        r = c.request("POST", "/v1/messages",
                      {**chat("tokens=5 tensorfail=0"), "max_tokens": 5})
        assert r.status == 503 and r.headers["retry-after"] == "1" and r.json()["type"] == "error"
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 tensorfail=2", stream=True))
        events = r.sse()
        assert r.status == 200
        assert json.loads(events[-1][1])["error"]["code"] == "tensor_group_failed"
        assert [json.loads(d)["choices"][0]["delta"].get("content") for _, d in events[1:-1]] \
            == ["w0 ", "w1 "]
        assert c.request("GET", "/health").status == 200


def test_streaming_failure_ends_with_an_error_event(node):
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/chat/completions", chat("tokens=5 fail=2", stream=True))
        events = r.sse()
        assert r.status == 200 and json.loads(events[-1][1])["error"]["type"] == "server_error"
        assert [json.loads(d)["choices"][0]["delta"].get("content") for _, d in events[1:-1]] \
            == ["w0 ", "w1 "]
        r = c.request("POST", "/v1/messages", {**chat("tokens=5 fail=1"), "max_tokens": 9,
                                               "stream": True})
        names = [name for name, _ in r.sse()]
        assert names == ["message_start", "content_block_start", "content_block_delta", "error"]
        assert c.request("GET", "/health").status == 200


def test_keepalive_comments_during_long_prefill(node):
    with H11Client(node.port) as c:
        r = c.request("POST", "/v1/completions",
                      {"model": "fake", "prompt": "prefill=1.2 tokens=2", "stream": True})
        assert r.status == 200
        assert r.body.startswith(b": keep-alive\n\n")
        assert r.body.count(b": keep-alive") >= 2
        assert r.sse()[-1] == (None, "[DONE]")


def test_queue_bound_gives_429_with_retry_after():
    n = LiveNode(Script(), max_queue=2)
    n.wait_ready()
    clients = []
    try:
        for i in range(3):  # one runs (blocked), two wait
            c = H11Client(n.port)
            clients.append(c)
            c.send("POST", "/v1/chat/completions", chat(f"block {i}"))
            wait_until(lambda: n.script.started)
        wait_until(lambda: n.worker.waiting == 2)
        with H11Client(n.port) as c:
            r = c.request("POST", "/v1/chat/completions", chat("one too many"))
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        n.script.release.set()
        for c in clients:  # first in, first out
            assert c.receive().status == 200
        assert n.script.started == ["block 0", "block 1", "block 2"]
    finally:
        n.script.release.set()
        for c in clients:
            c.sock.close()
        n.close()


def test_disconnect_during_prefill_cancels_at_once(node):
    s = socket.create_connection(("127.0.0.1", node.port))
    body = json.dumps(chat("prefill=30 tokens=1")).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
              % (len(body), body))
    wait_until(lambda: node.script.started)
    t0 = time.monotonic()
    s.close()
    wait_until(lambda: node.script.cancelled, timeout=5)
    with H11Client(node.port) as c:  # the model is free: the next request runs now
        r = c.request("POST", "/v1/chat/completions", chat("tokens=2"))
        assert r.status == 200
    assert time.monotonic() - t0 < 5  # far less than the 30 s the cancelled one wanted


def test_disconnect_while_queued_drops_the_job(node):
    node.script.release.clear()
    with H11Client(node.port) as running:
        running.send("POST", "/v1/chat/completions", chat("block first"))
        wait_until(lambda: node.script.started)
        s = socket.create_connection(("127.0.0.1", node.port))
        body = json.dumps(chat("queued")).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                  % (len(body), body))
        wait_until(lambda: node.worker.waiting == 1)
        s.close()
        wait_until(lambda: node.worker.waiting == 0)
        node.script.release.set()
        assert running.receive().status == 200
    assert node.script.started == ["block first"]


@pytest.mark.slow
def test_slow_headers_and_bodies_get_408_and_idle_connections_close(node):
    t0 = time.monotonic()
    raw = raw_exchange(node.port, [b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"], pause=0.4,
                       timeout=5)
    (r,) = parse_responses(raw)
    assert r.status == 408 and 0.9 < time.monotonic() - t0 < 3
    t0 = time.monotonic()
    assert raw_exchange(node.port, b"", timeout=5) == b""  # silent: closed without a word
    assert time.monotonic() - t0 < 3
    with H11Client(node.port) as c:
        assert c.request("GET", "/health").status == 200
        time.sleep(1.5)  # past the idle keep-alive timeout
        assert c.sock.recv(10) == b""
    t0 = time.monotonic()  # a body announced but never sent
    raw = raw_exchange(node.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Content-Length: 10\r\n\r\n{", timeout=5)
    (r,) = parse_responses(raw)
    assert r.status == 408 and 0.9 < time.monotonic() - t0 < 3


def test_expect_100_continue_and_early_refusal(node):
    body = json.dumps(chat("tokens=1")).encode()
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Expect: 100-continue\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        buf = b""
        while b"w0" not in buf:
            buf += s.recv(4096)
        assert buf.startswith(b"HTTP/1.1 200 OK")
    raw = raw_exchange(node.port, b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    (r,) = parse_responses(raw)  # refused before the body was sent, then closed
    assert r.status == 404 and r.headers["connection"] == "close"


def test_pipelined_requests_in_order(node):
    one = json.dumps(chat("tokens=2")).encode()
    raw = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
           b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
           b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
           b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % (len(one), one))
    replies = parse_responses(raw_exchange(node.port, raw))
    assert [r.status for r in replies] == [200, 200, 200, 404]
    assert replies[1].json()["object"] == "chat.completion"
    assert replies[2].json()["object"] == "list"


def test_no_task_or_connection_leaks_after_abuse(node):
    host = b"Host: 127.0.0.1\r\n"
    for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\n" + host + b"X: y\r\n" * 3000,
                 b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Length: 99999\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\n" + host
                 + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"):
        (r,) = parse_responses(raw_exchange(node.port, data))
        assert r.status in (400, 413, 431)
    for _ in range(5):  # abrupt disconnects mid-stream
        with H11Client(node.port) as c:
            c.send("POST", "/v1/chat/completions", chat("tokens=200 delay=0.01", stream=True))
            c.receive(stop_after=200)
    wait_until(lambda: node.worker.current is None and node.worker.waiting == 0)
    with H11Client(node.port) as c:
        assert c.request("GET", "/health").status == 200

    async def server_tasks():
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                if t.get_coro().__qualname__.startswith("HttpServer.")]

    # Every connection closed: no connection, handler or watcher task is left behind.
    wait_until(lambda: asyncio.run_coroutine_threadsafe(server_tasks(), node.loop).result() == [])
    assert node.worker.current is None


# ---- who may ask: Host, Content-Type; HEAD; the chunk-size line ------------------------------

def _one(port: int, raw: bytes):
    (r,) = parse_responses(raw_exchange(port, raw))
    return r


def test_a_host_the_server_does_not_serve_gets_421(node):
    """A page whose DNS name was pointed at 127.0.0.1 (DNS rebinding) sends that name as the
    Host: refused before any route runs, with the API's error shape, and the connection
    closes. The node's own addresses pass."""
    p = node.port
    for host in (b"evil.example:%d" % p, b"evil.example", b"127.0.0.1:%d" % (p + 1),
                 b"sub.localhost:%d" % p):
        r = _one(p, b"GET /health HTTP/1.1\r\nHost: %b\r\n\r\n" % host)
        assert r.status == 421, host
        assert r.json()["error"]["code"] == "misdirected_request"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.headers["connection"] == "close"
    body = json.dumps(chat("tokens=1")).encode()
    r = _one(p, b"POST /v1/chat/completions HTTP/1.1\r\nHost: evil.example:%d\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
             % (p, len(body), body))
    assert r.status == 421 and node.script.started == []
    for host in (b"127.0.0.1:%d" % p, b"localhost:%d" % p, b"[::1]:%d" % p, b"127.0.0.1",
                 b"LOCALHOST:%d" % p):
        r = _one(p, b"GET /health HTTP/1.1\r\nHost: %b\r\nConnection: close\r\n\r\n" % host)
        assert r.status == 200, host
    r = _one(p, b"GET /health HTTP/1.0\r\n\r\n")  # HTTP/1.0 without a Host
    assert r.status == 200


def test_allowed_hosts_are_answered_too():
    n = LiveNode(Script(), allowed_hosts=("api.example", "proxy.lan:8443"))
    try:
        n.wait_ready()
        for host, status in ((b"api.example", 200), (b"api.example:443", 200),
                             (b"proxy.lan:8443", 200), (b"proxy.lan:8444", 421),
                             (b"localhost:%d" % n.port, 200), (b"other.example", 421)):
            r = _one(n.port, b"GET /health HTTP/1.1\r\nHost: %b\r\nConnection: close\r\n\r\n"
                     % host)
            assert r.status == status, host
    finally:
        n.close()
    n = LiveNode(Script(), allowed_hosts=("*",))
    try:
        n.wait_ready()
        r = _one(n.port, b"GET /health HTTP/1.1\r\nHost: anything\r\nConnection: close\r\n\r\n")
        assert r.status == 200
    finally:
        n.close()


def test_a_json_body_must_say_application_json(node):
    """What a browser may post across sites without asking (text/plain, a form) is 415 in the
    route's own error shape, before the model sees it; application/json with parameters
    passes."""
    body = json.dumps(chat("tokens=1")).encode()
    with H11Client(node.port) as c:
        for ctype in ("text/plain", "text/plain;charset=UTF-8",
                      "application/x-www-form-urlencoded", "multipart/form-data; boundary=b"):
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
                r = c.request("POST", path, body, [("Content-Type", ctype)])
                err = r.json()["error"]
                assert r.status == 415 and err["code"] == "unsupported_media_type", (path, r)
                assert err["type"] == "invalid_request_error" and ctype in err["message"]
            r = c.request("POST", "/v1/messages", {**chat("tokens=1"), "max_tokens": 1},
                          [("Content-Type", ctype)])
            assert r.status == 415 and r.json()["type"] == "error"  # Anthropic's shape
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.request("POST", "/v1/chat/completions", body,
                      [("Content-Type", "application/json; charset=utf-8")])
        assert r.status == 200
    assert node.script.started == ["tokens=1"]
    r = _one(node.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    assert r.status == 415 and "has none" in r.json()["error"]["message"]
    assert node.script.started == ["tokens=1"]


def test_head_answers_a_get_routes_status_and_headers_without_the_body(node):
    with H11Client(node.port) as c:  # one connection: every HEAD answer keeps it
        for path in ("/health", "/v1/models", "/metrics", "/v1/stats", "/"):
            got = c.request("GET", path)
            head = c.request("HEAD", path)
            assert head.status == got.status == 200, path
            assert head.body == b""
            assert head.headers["content-type"] == got.headers["content-type"]
            if path != "/metrics" and path != "/v1/stats":  # (those change between requests)
                assert head.headers["content-length"] == str(len(got.body))
        r = c.request("HEAD", "/v1/chat/completions")
        assert r.status == 405 and r.headers["allow"] == "POST" and r.body == b""
        r = c.request("HEAD", "/nope")
        assert r.status == 404 and r.body == b""
        assert c.request("GET", "/health").status == 200


def test_head_on_a_streaming_get_route_sends_the_head_only():
    """A streaming GET route's body is never started for HEAD; its on_close still runs."""
    from skulkp2p.api.server import HttpServer, Router, StreamingResponse

    started: list[str] = []
    closed: list[str] = []

    async def events():
        started.append("body")
        yield b"data: 1\n\n"

    async def stream(req):
        return StreamingResponse(200, events(), [("Content-Type", "text/event-stream")],
                                 on_close=lambda: closed.append(req.method))

    async def main() -> list:
        router = Router()
        router.add("GET", "/events", stream)
        server = HttpServer(router)
        _, port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"HEAD /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                         b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            raw = await asyncio.wait_for(reader.read(-1), 10)
            writer.close()
            return raw
        finally:
            await server.close()

    raw = asyncio.run(main())
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert rest.startswith(b"HTTP/1.1 200")  # nothing between the HEAD's head and the next
    assert rest.endswith(b"data: 1\n\n\r\n0\r\n\r\n")
    assert started == ["body"] and closed == ["HEAD", "GET"]


@pytest.mark.parametrize("pieces", [1, 64])
def test_chunk_size_line_limit_on_a_socket(node, pieces):
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"2;" + b"e" * 5000 + b"\r\n{}\r\n0\r\n\r\n")
    step = -(-len(raw) // pieces)
    r = _one(node.port, [raw[i:i + step] for i in range(0, len(raw), step)])
    assert r.status == 400 and "chunk size line too long" in r.json()["error"]["message"]
    assert node.script.started == []


def test_the_real_openai_and_anthropic_clients_pass_the_checks(node):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    for base in (node.base, f"http://localhost:{node.port}"):
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
        r = oai.chat.completions.create(model="fake", max_tokens=2,
                                        messages=[{"role": "user", "content": "tokens=2"}])
        assert r.choices[0].message.content == "w0 w1 "
        ant = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=30)
        msg = ant.messages.create(model="fake", max_tokens=2,
                                  messages=[{"role": "user", "content": "tokens=2"}])
        assert msg.content[0].text == "w0 w1 "


def test_an_error_mid_upload_reaches_the_client_still_sending(node):
    """An error that ends the connection while the client still sends its body (here a chunk
    size line too long, then 512 KiB more): the server reads what keeps coming and drops it
    before it closes (a lingering close), so the client finishes sending and reads the 400
    instead of a reset."""
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"2;" + b"e" * 5000 + b"\r\n" + b"x" * (512 * 1024))
    for _ in range(3):
        r = _one(node.port, [raw[i:i + 16384] for i in range(0, len(raw), 16384)])
        assert r.status == 400 and "chunk size line too long" in r.json()["error"]["message"]
    assert node.script.started == []
