"""A scripted fake engine (the Engine protocol, no MLX) behind the real single-model HTTP app,
on its own event-loop thread: deterministic readiness, timing, failures and cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

from skulkp2p.api.app import serve
from skulkp2p.api.server import ServerConfig
from skulkp2p.engine.parallel.ring.frames import RingError
from skulkp2p.engine.parallel.tensor.group_errors import TensorError
from skulkp2p.engine.protocol import EngineInfo, Generation
from skulkp2p.engine.request import RequestError
from skulkp2p.engine.results import Chunk, GenerationResult, Timing, Usage
from skulkp2p.runtime.worker import ModelWorker


class Script:
    """What the fake engine does, from the prompt: `tokens=5 prefill=2.0 delay=0.01 fail=3
    ringfail=3 tensorfail=3 block` (block: wait for `release` before the first token; ringfail:
    the engine's RingError, as a broken ring of nodes raises it; tensorfail: its TensorError,
    as a broken tensor-parallel group raises it)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    @staticmethod
    def params(text: str) -> dict:
        out = {"tokens": 3, "prefill": 0.0, "delay": 0.0, "fail": -1, "ringfail": -1,
               "tensorfail": -1, "block": False}
        for word in text.split():
            key, _, value = word.partition("=")
            if key in out:
                out[key] = True if key == "block" else type(out[key])(value)
        return out

    def prompt_length(self, req) -> int:
        text = req.prompt if req.prompt is not None else req.messages[-1].content
        if "too-long" in text:
            raise RequestError("prompt is too long", "prompt")
        return len(text.split())

    def run(self, req, interrupt):
        text = req.prompt if req.prompt is not None else req.messages[-1].content
        p = self.params(text)
        self.started.append(text)
        try:
            end = time.monotonic() + p["prefill"]
            while time.monotonic() < end:  # "prefill chunks", the flag checked between them
                interrupt()
                time.sleep(0.02)
            if p["block"]:
                while not self.release.wait(0.02):
                    interrupt()
            n = min(p["tokens"], req.max_tokens or p["tokens"])
            for i in range(n):
                interrupt()
                if i == p["fail"]:
                    raise RuntimeError("the engine broke")
                if i == p["ringfail"]:
                    raise RingError("a stage dropped the frame")
                if i == p["tensorfail"]:
                    raise TensorError("tensor-parallel group of fake (n0, n1) broke "
                                      "mid-request: node n1 is dead")
                time.sleep(p["delay"])
                yield Chunk(f"w{i} ", [i])
        except BaseException:
            self.cancelled.append(text)
            raise
        self.finished.append(text)
        return GenerationResult(text="".join(f"w{i} " for i in range(n)), tokens=list(range(n)),
                                finish_reason="length", usage=Usage(len(text.split()), n),
                                timing=Timing(0.0, 0.0, None))


class FakeEngine:
    """The Engine protocol, run by the script (no MLX)."""
    id = "fake"
    context_length = 10_000
    runs_on_loop = False
    max_concurrent = 1

    def __init__(self, script: Script):
        self.script = script

    def info(self) -> EngineInfo:
        return EngineInfo(self.id, "fake", "none", self.context_length)

    def prompt_length(self, req) -> int:
        return self.script.prompt_length(req)

    def generate(self, req) -> Generation:
        return Generation(lambda interrupt: self.script.run(req, interrupt))

    def close(self) -> None:
        pass


class LiveNode:
    """`serve()` on its own event-loop thread, on a free port."""

    def __init__(self, script: Script | None = None, load_gate: threading.Event | None = None,
                 max_queue: int = 2, keepalive_s: float = 0.3, engine=None,
                 model_id: str = "fake", **config):
        """Serves `engine`, or a FakeEngine run by `script`; `config` overrides the (strict,
        short) ServerConfig."""
        self.script = script
        self.engine = engine

        def load():
            if load_gate is not None:
                load_gate.wait(30)
            return engine if engine is not None else FakeEngine(script)

        self.worker = ModelWorker(model_id, load, max_queue=max_queue)
        self.config = ServerConfig(**{"header_timeout": 1.0, "idle_timeout": 1.0,
                                      "body_timeout": 1.0, "max_body_bytes": 4096, **config})
        self.keepalive_s = keepalive_s
        self.listening = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.listening.wait(10)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()

        def listening(host, port):
            self.port = port
            self.listening.set()

        self.result = await serve(self.worker, "127.0.0.1", 0, self.stop, aliases=("alias",),
                                  keepalive_s=self.keepalive_s, config=self.config,
                                  on_listening=listening, stop_timeout=5)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while self.worker.state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)
        assert not self.thread.is_alive()
        assert self.result[0], "the worker thread did not end"


def chat(content: str, **kw) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **kw}


def wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)
