"""The served proxy against a scripted stand-in for llama-server (no binary needed): the relay
the worker runs on the event loop gives the same chunks, result, speculation stats and errors as
the blocking `ServedModel.stream`, and a cancelled job closes its connection to the child."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types

import pytest

from skulkp2p.api.errors import engine_error
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.result_extras import speculation_json
from skulkp2p.models.cards import Card, Source
from skulkp2p.runtime.worker import Failed, Finished, ModelWorker, Produced, Started
from skulkp2p.served.child import free_port
from skulkp2p.served.served_engine import ServedModel

PIECES = ["Hel", "lo", " wor", "ld ", "\u00e9\u4e16", "!"]
TIMINGS = {"prompt_n": 7, "prompt_ms": 3.5, "predicted_n": 6, "predicted_per_second": 99.0,
           "draft_n": 4, "draft_n_accepted": 3, "cache_n": 5}


def _chat_events(pieces: list[str]) -> list[bytes]:
    def ev(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"
    out = [ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})]
    out += [ev({"choices": [{"index": 0, "finish_reason": None, "delta": {"content": p}}]})
            for p in pieces]
    out.append(ev({"choices": [{"index": 0, "finish_reason": "length", "delta": {}}]}))
    out.append(ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 6},
                   "timings": TIMINGS}))
    out.append(b"data: [DONE]\n\n")
    return out


class FakeChild:
    """Answers each connection with the next scripted reply: ("stream", events, delay),
    ("status", code, body) or ("drop", events) (the connection dies after those events)."""

    host = "127.0.0.1"
    ready_timeout_s = 5

    def __init__(self, spec: bool = True):
        self.args = ["-m", "x"] + (["--spec-type", "ngram-simple"] if spec else [])
        self.replies: list[tuple] = []
        self.requests: list[bytes] = []
        self.closed = threading.Event()  # the proxy closed a connection mid-stream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def wait_ready(self, timeout: float) -> None:
        pass

    def stop(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += conn.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        self.requests.append(head + b"\r\n\r\n" + body)
        kind, *rest = self.replies.pop(0)
        try:
            if kind == "status":
                code, payload = rest
                conn.sendall(b"HTTP/1.1 %d Bad\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (code, len(payload), payload))
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            events, delay = (rest[0], rest[1]) if kind == "stream" else (rest[0], 0)
            for ev in events:
                conn.sendall(b"%x\r\n%b\r\n" % (len(ev), ev))
                time.sleep(delay)
            if kind == "stream":
                conn.sendall(b"0\r\n\r\n")
        except OSError:
            self.closed.set()
        finally:
            conn.close()


def _model(child: object) -> ServedModel:
    card = Card("fake", "llama", "gguf", Source("local", path="/fake.gguf"), layers=1,
                hidden_size=64, kv_heads=1, context_length=2048, size_bytes=1)
    return ServedModel(card, child, ())


REQ = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}


def _pair(event: object) -> tuple[str, object]:
    """A job's typed event as (kind, payload), to compare sequences briefly."""
    if isinstance(event, Started):
        return "start", event.prompt_tokens
    if isinstance(event, Produced):
        return "chunk", event.chunk
    if isinstance(event, Finished):
        return "done", event.result
    assert isinstance(event, Failed), event
    return "error", event.error


async def _job(worker: ModelWorker, body: dict) -> tuple[list, object]:
    """Submit, collect (kind, payload) until done or error."""
    job = worker.submit(parse_request(body))
    events = []
    while True:
        kind, payload = _pair(await job.next(10))
        events.append((kind, payload))
        if kind in ("done", "error"):
            return events, job


def test_relay_matches_blocking_stream_and_errors():
    child = FakeChild()
    model = _model(child)

    # the blocking path, for reference
    child.replies.append(("stream", _chat_events(PIECES), 0))
    generation = model.generate(parse_request(REQ))
    ref_text = [c.text for c in generation]
    ref = generation.result

    async def main() -> None:
        worker = ModelWorker("fake", lambda: model)
        await worker.start()
        try:
            child.replies.append(("stream", _chat_events(PIECES), 0.002))
            events, _ = await _job(worker, REQ)
            kinds = [k for k, _ in events]
            assert kinds == ["start"] + ["chunk"] * len(PIECES) + ["done"]
            assert [p.text for k, p in events if k == "chunk"] == ref_text == PIECES
            result = events[-1][1]
            for key in ("text", "usage", "finish_reason", "speculation", "stop_sequence"):
                assert getattr(result, key) == getattr(ref, key), key
            assert result.finish_reason == "length"
            assert result.usage.cached_tokens == 5  # llama-server's own prompt cache
            assert speculation_json(result.speculation) == {
                "drafter": "llama_server:ngram-simple", "mode": "explicit", "drafted": 4,
                "accepted": 3, "acceptance": 0.75}
            # the same request went to the child both ways
            assert child.requests[0] == child.requests[1]

            # a refusal is the client's fault (400), with the child's words
            child.replies.append(("status", 400, b'{"error":{"message":"too long"}}'))
            events, _ = await _job(worker, REQ)
            kind, err = events[-1]
            assert kind == "error" and isinstance(err, RequestError) and "too long" in str(err)

            # an error event mid-stream: 502
            bad = _chat_events(PIECES[:2])[:3] + [b'data: {"error":{"message":"boom"}}\n\n']
            child.replies.append(("stream", bad, 0))
            events, _ = await _job(worker, REQ)
            kind, err = events[-1]
            assert kind == "error" and engine_error(err).status == 502
            assert "boom" in engine_error(err).message

            # the child dies mid-stream: 503, retry
            child.replies.append(("drop", _chat_events(PIECES)[:3]))
            events, _ = await _job(worker, REQ)
            kind, err = events[-1]
            assert kind == "error" and engine_error(err).status == 503
            assert engine_error(err).code == "model_unavailable"

            # a cancelled job closes its connection, and the next job is served
            child.replies.append(("stream", _chat_events(PIECES * 100), 0.005))
            job = worker.submit(parse_request(REQ))
            assert isinstance(await job.next(10), Started)
            job.cancel()
            assert await asyncio.get_running_loop().run_in_executor(None, child.closed.wait, 10)
            child.replies.append(("stream", _chat_events(PIECES), 0))
            events, _ = await _job(worker, REQ)
            assert events[-1][0] == "done" and events[-1][1].text == "".join(PIECES)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    asyncio.run(main())


def test_relay_child_not_listening_is_503():
    child = types.SimpleNamespace(host="127.0.0.1", port=free_port(), args=[], ready_timeout_s=5,
                                  wait_ready=lambda timeout: None,
                                  stop=lambda: None)  # nothing listens on that port
    model = _model(child)

    async def main() -> None:
        worker = ModelWorker("fake", lambda: model)
        await worker.start()
        try:
            events, _ = await _job(worker, REQ)
            kind, err = events[-1]
            assert kind == "error" and engine_error(err).status == 503
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    asyncio.run(main())


@pytest.mark.parametrize("cut", [1, 5, 64])
def test_relay_reads_events_split_anywhere(cut):
    """Events split across chunks (and chunks holding several events) parse the same."""
    child = FakeChild(spec=False)
    model = _model(child)
    whole = b"".join(_chat_events(PIECES))
    pieces = [whole[i:i + cut] for i in range(0, len(whole), cut)]

    async def main() -> None:
        worker = ModelWorker("fake", lambda: model)
        await worker.start()
        try:
            child.replies.append(("stream", pieces, 0))
            events, _ = await _job(worker, REQ)
            assert "".join(p.text for k, p in events if k == "chunk") == "".join(PIECES)
            assert events[-1][0] == "done" and events[-1][1].speculation is None
            assert events[-1][1].usage.completion_tokens == 6
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    asyncio.run(main())


def test_relay_maps_the_childs_tool_call_deltas():
    """llama-server streams calls as delta.tool_calls (its first delta may carry the name and
    the first fragment together): they become our typed deltas, id and name first, then the
    fragments, both ways (relay and blocking), and the request carries the tools."""
    def ev(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def call(delta: dict) -> bytes:
        return ev({"choices": [{"index": 0, "finish_reason": None,
                                "delta": {"tool_calls": [delta]}}]})

    events = [ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}),
              ev({"choices": [{"index": 0, "delta": {"content": "Sure."}}]}),
              call({"index": 0, "id": "abc", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"ci'}}),
              call({"index": 0, "function": {"arguments": 'ty": "Paris"}'}}),
              call({"index": 1, "id": "def", "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}),
              call({"index": 1, "function": {"arguments": '{"city": "Rome"}'}}),
              ev({"choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {}}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 20}, "timings": TIMINGS}),
              b"data: [DONE]\n\n"]
    child = FakeChild()
    model = _model(child)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {**REQ, "tools": [tool], "parallel_tool_calls": False}

    def check(chunks: list, result) -> None:
        deltas = [c.tool_call for c in chunks if c.tool_call is not None]
        assert [(d.index, d.id, d.name, d.arguments) for d in deltas] == [
            (0, "abc", "get_weather", ""), (0, None, None, '{"ci'),
            (0, None, None, 'ty": "Paris"}'), (1, "def", "get_weather", ""),
            (1, None, None, '{"city": "Rome"}')]
        assert result.text == "Sure." and result.finish_reason == "tool_calls"
        assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
            ("abc", "get_weather", '{"city": "Paris"}'), ("def", "get_weather",
                                                           '{"city": "Rome"}')]

    child.replies.append(("stream", events, 0))
    generation = model.generate(parse_request(body))
    check(list(generation), generation.result)
    sent = json.loads(child.requests[0].split(b"\r\n\r\n", 1)[1])
    assert sent["tools"] == [tool] and sent["tool_choice"] == "auto"
    assert sent["parallel_tool_calls"] is False

    async def main() -> None:
        worker = ModelWorker("fake", lambda: model)
        await worker.start()
        try:
            child.replies.append(("stream", events, 0))
            got, _ = await _job(worker, body)
            check([p for k, p in got if k == "chunk"], got[-1][1])
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    asyncio.run(main())
