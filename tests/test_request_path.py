"""The request path does each step once: a body is read from JSON once, by the node's resolver,
and every route reads that value (node/serving.py, api/server.py: HttpRequest.json); a chat's
template is rendered once per request, by the engine's prompt_length, and its generation reuses
the tokens, on the batched path too (engine/runner/mlx_engine.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import orjson
import pytest

from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.http import Headers
from skulkp2p.api.relay import FORWARDED_HEADER
from skulkp2p.api.server import HttpRequest, StreamingResponse
from skulkp2p.engine.runner.generate import prompt_tokens
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.node.serving import ClusterServing
from skulkp2p.node.stages import LocalPlacements
from skulkp2p.runtime.worker import Failed, Finished, ModelWorker, Started
from tests.helpers.batch import loaded
from tests.helpers.fake_engine import FakeEngine, Script

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "tokens=2"}]},
    "/v1/completions": {"prompt": "tokens=2"},
    "/v1/messages": {"max_tokens": 2, "messages": [{"role": "user", "content": "tokens=2"}]},
    "/v1/responses": {"input": "tokens=2", "store": False},
    "/v1/cluster/generate": {"id": 1, "prompt": "tokens=2"},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_body_is_read_once_on_its_way_to_the_engine(path, stream, monkeypatch):
    """Through the node's real router and resolver (a request forwarded to this node, which
    serves its model itself: no cluster needed, the body names no model), to the real worker:
    the body's bytes go through orjson.loads once."""
    reads: list[bytes] = []
    loads = orjson.loads

    def counted(data):
        reads.append(data)
        return loads(data)

    body = dict(BODIES[path])
    if stream and path != "/v1/cluster/generate":
        body["stream"] = True
    raw = orjson.dumps(body)
    local = LocalPlacements(None, "fake", "fake", lambda spec: FakeEngine(Script()))
    serving = ClusterServing(local)

    async def main() -> int:
        worker = ModelWorker("fake", lambda: FakeEngine(Script()))
        await worker.start()
        local.workers["fake"] = worker
        local.apis["fake"] = ModelEndpoint("fake", worker)
        try:
            route = serving.router().resolve("POST", path)
            monkeypatch.setattr(orjson, "loads", counted)
            response = await route(HttpRequest(
                "POST", path, path, "", Headers([(FORWARDED_HEADER, "n0"),
                                                ("content-type", "application/json")]), raw))
            monkeypatch.setattr(orjson, "loads", loads)
            if isinstance(response, StreamingResponse):
                out = b"".join([piece async for piece in response.body])
                assert b"w1 " in out
            else:
                assert b"w1 " in response.body, response.body
            return response.status
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop, 5)

    assert asyncio.run(main()) == 200
    assert reads.count(raw) == 1


def _spy_template(lm):
    """`lm` with its real tokenizer behind a counter of chat-template renders."""
    tokenizer = lm.tokenizer
    renders: list[int] = []

    class Counted:
        def apply_chat_template(self, *args, **kwargs):
            renders.append(threading.get_ident())
            return tokenizer.apply_chat_template(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    return dataclasses.replace(lm, tokenizer=Counted()), renders


def test_a_chat_template_is_rendered_once_per_request_on_the_batched_path(tiny_model):
    """Two chat requests decoded together through the real worker (prompt_length, then the
    generation, on each runner thread) over a tiny llama's real tokenizer and ChatML template:
    two renders, and each prompt's length as the template gives it."""
    lm, renders = _spy_template(loaded(tiny_model("llama")))
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=2)
    assert engine.scheduler is not None and engine.max_concurrent == 2
    questions = ["Name a river.", "Count to three, please."]
    reqs = [parse_request({"messages": [{"role": "user", "content": q}], "max_tokens": 6,
                           "speculation": "off"}) for q in questions]
    expected = [len(prompt_tokens(lm, r)) for r in reqs]
    renders.clear()

    async def main() -> list[tuple[int, object]]:
        worker = ModelWorker("llama", lambda: engine)
        await worker.start()
        try:
            jobs = [worker.submit(r) for r in reqs]
            out = []
            for job in jobs:
                n_prompt, result = 0, None
                while result is None:
                    event = await job.next()
                    if isinstance(event, Started):
                        n_prompt = event.prompt_tokens
                    elif isinstance(event, Finished):
                        result = event.result
                    elif isinstance(event, Failed):
                        raise event.error
                out.append((n_prompt, result))
            return out
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop, 10)

    done = asyncio.run(main())
    assert len(renders) == 2
    for (n_prompt, result), n in zip(done, expected, strict=True):
        assert n_prompt == n == result.usage.prompt_tokens
        assert 1 <= result.usage.completion_tokens <= 6
    assert engine._rendered == {}  # every kept prompt was taken by its generation
