"""The node's HTTP application: routes, readiness, and the glue between a request and a job.

What runs concurrently: HTTP parsing, health, model listing and the streaming of every open
response run on the event loop, all at once. Generation runs on one worker thread per model, one
request at a time, first in first out; up to `max_queue` more wait their turn, and one more gets
429. (Plain requests are not batched together yet.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from skulkp2p.api.errors import ApiError
from skulkp2p.api.server import HttpRequest, Response, Router
from skulkp2p.api.worker import Job, ModelWorker, NotReady, QueueFull
from skulkp2p.engine.request import GenerationRequest, RequestError

log = logging.getLogger("skulkp2p.api")

LOADING_RETRY_AFTER = "2"


class ApiNode:
    def __init__(self, model_id: str, worker: ModelWorker, aliases: tuple[str, ...] = (),
                 keepalive_s: float = 10.0):
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.worker = worker
        self.keepalive_s = keepalive_s
        self.created = int(time.time())

    def router(self) -> Router:
        from skulkp2p.api import anthropic, openai

        r = Router()
        r.add("GET", "/health", self.health)
        r.add("GET", "/v1/models", self.models)
        r.add("POST", "/v1/chat/completions", lambda req: openai.chat_completions(self, req))
        r.add("POST", "/v1/completions", lambda req: openai.completions(self, req))
        r.add("POST", "/v1/messages", lambda req: anthropic.messages(self, req))
        return r

    # ---- routes ----------------------------------------------------------------------------

    async def health(self, req: HttpRequest) -> Response:
        state = self.worker.state
        if state == "ready":
            return Response.json(200, {"status": "ok", "model": self.model_id,
                                       "waiting": self.worker.waiting,
                                       "busy": self.worker.current is not None})
        if state == "loading":
            raise ApiError(503, f"model {self.model_id} is loading", code="model_loading",
                           headers=[("Retry-After", LOADING_RETRY_AFTER)])
        raise ApiError(503, f"model {self.model_id} is not available ({state}){self._why()}",
                       code="model_unavailable")

    def _why(self) -> str:
        """Why the model failed to load (e.g. llama-server's own reason), for the client."""
        err = self.worker.load_error
        return f": {err}" if err is not None else ""

    async def models(self, req: HttpRequest) -> Response:
        return Response.json(200, {"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created,
            "owned_by": "skulkp2p", "ready": self.worker.state == "ready"}]})

    # ---- shared by the generation routes ---------------------------------------------------

    def check_model(self, name: Any) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here (this node serves "
                                f"{self.model_id!r})", param="model", code="model_not_found")

    def submit(self, req: GenerationRequest) -> Job:
        try:
            return self.worker.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", code="queue_full",
                           headers=[("Retry-After", str(e.retry_after))]) from None
        except NotReady:
            if self.worker.state == "loading":
                raise ApiError(503, f"model {self.model_id} is loading", code="model_loading",
                               headers=[("Retry-After", LOADING_RETRY_AFTER)]) from None
            raise ApiError(503, f"model {self.model_id} is not available{self._why()}",
                           code="model_unavailable") from None


def job_error(e: BaseException, rename: dict[str, str] | None = None) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return ApiError.from_request_error(e, rename)
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}")


async def run_to_end(node: ApiNode, req: GenerationRequest, rename: dict[str, str] | None = None
                     ) -> tuple[int, dict[str, Any]]:
    """A non-streaming request: (prompt tokens, result). Fails as a whole or not at all, so the
    client gets a real error status, never a 200 with half a body."""
    job = node.submit(req)
    n_prompt = 0
    try:
        while True:
            event = await job.next()
            assert event is not None
            kind, payload = event
            if kind == "start":
                n_prompt = payload
            elif kind == "done":
                return n_prompt, payload
            elif kind == "error":
                raise job_error(payload, rename)
    finally:
        job.cancel()  # no-op when it finished; frees the model when the client went away


async def open_stream(node: ApiNode, req: GenerationRequest,
                      rename: dict[str, str] | None = None) -> tuple[Job, tuple[str, Any] | None]:
    """Submit, and wait up to one keep-alive interval for the job to start, so that what fails
    early (queue full, bad prompt) still gets a real status before the 200 head is committed."""
    job = node.submit(req)
    try:
        first = await job.next(node.keepalive_s)
    except BaseException:
        job.cancel()
        raise
    if first is not None and first[0] == "error":
        job.cancel()
        raise job_error(first[1], rename)
    return job, first


async def job_events(job: Job, first: tuple[str, Any] | None, keepalive_s: float
                     ) -> AsyncIterator[tuple[str, Any]]:
    """The job's events, with ("keepalive", None) whenever it was silent for an interval."""
    event = first
    while True:
        if event is None:
            yield "keepalive", None
        else:
            yield event
            if event[0] in ("done", "error"):
                return
        event = await job.next(keepalive_s)


async def serve(worker: ModelWorker, host: str, port: int, stop: asyncio.Event, *,
                aliases: tuple[str, ...] = (), keepalive_s: float = 10.0, config: Any = None,
                on_listening: Callable[[str, int], None] | None = None,
                on_ready: Callable[[Any], None] | None = None, stop_timeout: float = 10.0
                ) -> tuple[bool, BaseException | None]:
    """Run a node's API until `stop` is set: listen at once (health says 503 while loading),
    load the model on its worker thread, serve. Returns (worker ended cleanly, load error)."""
    from skulkp2p.api.server import HttpServer

    node = ApiNode(worker.model_id, worker, aliases, keepalive_s)
    router = node.router()
    from skulkp2p.api import dashboard  # GET /, /metrics, /v1/stats
    from skulkp2p.telemetry import Telemetry
    worker.telemetry = Telemetry()
    dashboard.add_routes(router, worker.telemetry, lambda: None, lambda: {worker.model_id: worker})
    server = HttpServer(router, config)
    bound_host, bound_port = await server.start(host, port)
    if on_listening:
        on_listening(bound_host, bound_port)
    ready = worker.start()
    load_error: BaseException | None = None
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            load_error = ready.exception()
            if load_error is None and on_ready:
                on_ready(ready.result())
        if load_error is None:
            await stopper
    finally:
        stopper.cancel()
        await server.close()
        loop = asyncio.get_running_loop()
        clean = await loop.run_in_executor(None, worker.stop, stop_timeout)
    return clean, load_error
