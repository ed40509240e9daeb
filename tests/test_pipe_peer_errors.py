"""`pipe --peer` and POST /v1/cluster/generate when the model's ring or tensor group breaks: the
route answers 503 with Retry-After and the pipe's error object typed with the HTTP API's code
(`ring_failed`, `tensor_group_failed`), the real `pipe --peer` process retries such a line for
up to `--retry-for` seconds, then writes that error result and goes on. The engine is the
scripted fake (no MLX) raising the engine's real RingError / TensorError, behind the real
worker (which wraps them as RingFailed / TensorGroupFailed), the real route and a real loopback
socket. A real tensor group broken under a `pipe --peer` line: tests/test_tensor_cluster.py."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from skulkp2p.api.app import OneModel, routed
from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.pipe_route import pipe_generate
from skulkp2p.api.server import HttpServer, Router
from skulkp2p.runtime.worker import ModelWorker
from tests.helpers.fake_engine import FakeEngine, Script
from tests.helpers.http_client import call
from tests.helpers.procs import run_cli


class PipeRouteNode:
    """The fake engine's worker behind POST /v1/cluster/generate alone, on its own event-loop
    thread, on a free loopback port."""

    def __init__(self, script: Script):
        self.worker = ModelWorker("fake", lambda: FakeEngine(script), max_queue=2)
        endpoint = ModelEndpoint("fake", self.worker, (), keepalive_s=0.3)
        self.router = Router()
        self.router.add("POST", "/v1/cluster/generate",
                        routed(pipe_generate, OneModel(endpoint)))
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        server = HttpServer(self.router)
        _, self.port = await server.start("127.0.0.1", 0)
        await self.worker.start()
        self.ready.set()
        try:
            await self.stop.wait()
        finally:
            await server.close()
            await self.loop.run_in_executor(None, self.worker.stop, 5.0)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture
def script():
    return Script()


@pytest.fixture
def node(script):
    n = PipeRouteNode(script)
    yield n
    n.close()


def _pipe_peer(node: PipeRouteNode, lines: list[dict], retry_for: str) -> list[dict]:
    proc = run_cli("pipe", "--peer", f"http://{node.addr}", "--retry-for", retry_for,
                   input="".join(json.dumps(line) + "\n" for line in lines), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_the_route_answers_a_broken_group_or_ring_503_with_the_http_apis_code(node):
    for prompt, code, cause in (("tokens=5 tensorfail=2", "tensor_group_failed",
                                 "node n1 is dead"),
                                ("tokens=5 ringfail=1", "ring_failed", "dropped the frame")):
        status, headers, out = call(node.addr, "POST", "/v1/cluster/generate",
                                    {"id": 7, "model": "fake", "prompt": prompt})
        assert status == 503 and headers["retry-after"] == "1", out
        err = out["error"]
        assert out["id"] == 7 and err["type"] == code and err["code"] == code, out
        assert err["message"].startswith("model fake: its ") and cause in err["message"], err
        assert err["message"].endswith("retry"), err
    # A bad request stays the pipe's 200 error object, and the engine still serves.
    status, _, out = call(node.addr, "POST", "/v1/cluster/generate",
                          {"id": 8, "model": "fake", "prompt": "x", "max_tokens": "four"})
    assert status == 200 and out["error"]["param"] == "max_tokens", out
    status, _, out = call(node.addr, "POST", "/v1/cluster/generate",
                          {"id": 9, "model": "fake", "prompt": "tokens=2"})
    assert status == 200 and out["text"] == "w0 w1 " and out["id"] == 9, out


@pytest.mark.process
def test_pipe_peer_without_retries_writes_the_codes_and_goes_on(node, script):
    out = _pipe_peer(node, [
        {"id": "g", "model": "fake", "prompt": "tokens=5 tensorfail=2"},
        {"id": "r", "model": "fake", "prompt": "tokens=5 ringfail=0"},
        {"id": "f", "model": "fake", "prompt": "tokens=5 fail=1"},
        {"id": "ok", "model": "fake", "prompt": "tokens=3"},
    ], retry_for="0")
    assert [o["id"] for o in out] == ["g", "r", "f", "ok"]
    assert out[0]["error"]["type"] == "tensor_group_failed", out[0]
    assert "node n1 is dead" in out[0]["error"]["message"], out[0]
    assert out[1]["error"]["type"] == "ring_failed", out[1]
    assert "dropped the frame" in out[1]["error"]["message"], out[1]
    # A bug in the engine is not the caller's to retry: the pipe's internal_error at once.
    assert out[2]["error"]["type"] == "internal_error", out[2]
    assert out[3]["text"] == "w0 w1 w2 " and "error" not in out[3]
    assert len(script.started) == 4  # one attempt each


@pytest.mark.process
def test_pipe_peer_retries_a_broken_group_then_says_so(node, script):
    prompt = "tokens=5 tensorfail=2"
    out = _pipe_peer(node, [{"id": 1, "model": "fake", "prompt": prompt}], retry_for="2.5")
    assert out[0]["id"] == 1 and out[0]["error"]["type"] == "tensor_group_failed", out
    # Retried as Retry-After says (1 s) until the window closed: more than one attempt.
    assert script.started.count(prompt) >= 2, script.started


@pytest.mark.process
@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_a_bad_retry_for_is_refused(value):
    bad = run_cli("pipe", "--peer", "127.0.0.1:1", "--retry-for", value, input="")
    assert bad.returncode == 2, bad.stderr
    assert f"--retry-for: must be a number of seconds, 0 or more, got {value!r}" in bad.stderr
