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
        assert r.status == 405 and r.headers["allow"] == "GET"
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
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
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
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
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
    raw = raw_exchange(node.port, [b"GET /health HTTP/1.1\r\n", b"Host: x\r\n"], pause=0.4,
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
    raw = raw_exchange(node.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 10\r\n\r\n{", timeout=5)
    (r,) = parse_responses(raw)
    assert r.status == 408 and 0.9 < time.monotonic() - t0 < 3


def test_expect_100_continue_and_early_refusal(node):
    body = json.dumps(chat("tokens=1")).encode()
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        buf = b""
        while b"w0" not in buf:
            buf += s.recv(4096)
        assert buf.startswith(b"HTTP/1.1 200 OK")
    raw = raw_exchange(node.port, b"POST /nope HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                  b"Content-Length: 5\r\n\r\n")
    (r,) = parse_responses(raw)  # refused before the body was sent, then closed
    assert r.status == 404 and r.headers["connection"] == "close"


def test_pipelined_requests_in_order(node):
    one = json.dumps(chat("tokens=2")).encode()
    raw = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
           b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (len(one), one))
    replies = parse_responses(raw_exchange(node.port, raw))
    assert [r.status for r in replies] == [200, 200, 200, 404]
    assert replies[1].json()["object"] == "chat.completion"
    assert replies[2].json()["object"] == "list"


def test_no_task_or_connection_leaks_after_abuse(node):
    for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 3000,
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"zz\r\n"):
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
