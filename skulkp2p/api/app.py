"""The HTTP application: which routes exist, and how a request reaches the model that serves it.

The API does not decide where a model runs: it is given a `ModelResolver` that names, per
request, the local `ModelEndpoint` or a `Remote` node to forward to (the composition root in
skulkp2p/node/ builds one from the cluster's placements; `serve` below uses one model, here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from skulkp2p.api import anthropic, dashboard, openai, responses
from skulkp2p.api.auth import OPEN, READ, NodeAuth
from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import ApiError
from skulkp2p.api.relay import forward
from skulkp2p.api.server import (
    ErrorShape,
    HttpRequest,
    HttpServer,
    Response,
    Router,
    ServerConfig,
    StreamingResponse,
)
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.protocol import Engine
from skulkp2p.runtime.worker import ModelWorker
from skulkp2p.telemetry import Telemetry

Handler = Callable[[ModelEndpoint, HttpRequest], Awaitable[Response | StreamingResponse]]

# The generation routes every node answers (OpenAI and Anthropic), and the shape of their
# errors where it is not the default one.
MODEL_ROUTES: tuple[tuple[str, str, Handler, ErrorShape | None], ...] = (
    ("POST", "/v1/chat/completions", openai.chat_completions, None),
    ("POST", "/v1/completions", openai.completions, None),
    ("POST", "/v1/responses", responses.responses, None),
    ("POST", "/v1/messages", anthropic.messages, anthropic.error_response),
)


@dataclass(frozen=True)
class Remote:
    """The model is served by another node: forward the request to its HTTP address."""
    node: str
    http_addr: str
    alive: Callable[[], str | None]  # None while that node is fine, else why it is not
    node_auth: NodeAuth | None = None  # signs the forwarded request (the cluster secret's)
    # Called once when the relay is over, with whether the node was lost on the way (the
    # resolver counts what it sent each replica, and avoids one that just failed).
    on_end: Callable[[bool], None] | None = None


class ModelResolver(Protocol):
    def resolve(self, req: HttpRequest) -> tuple[HttpRequest, ModelEndpoint | Remote]:
        """Where the request's model is served (the request may come back rewritten, e.g. the
        model named by its cluster-wide id); raises ApiError when nowhere."""
        ...


def routed(handler: Handler, resolver: ModelResolver, error_shape: ErrorShape | None = None
           ) -> Callable[[HttpRequest], Awaitable[Response | StreamingResponse]]:
    """`handler` behind `resolver`; what the resolver refuses (a body that is no JSON, a model
    that is nowhere) and what the relay to another node fails with are answered in
    `error_shape` when the route has its own."""
    async def route(req: HttpRequest) -> Response | StreamingResponse:
        try:
            req, where = resolver.resolve(req)
            if isinstance(where, Remote):
                return await forward(req, where.http_addr, where.node, where.alive,
                                     node_auth=where.node_auth, on_end=where.on_end)
        except ApiError as e:
            if error_shape is None:
                raise
            return error_shape(e)
        return await handler(where, req)

    return route


def add_model_routes(router: Router, resolver: ModelResolver) -> None:
    """The generation routes (each asks for a key when the node has keys)."""
    for method, path, handler, error_shape in MODEL_ROUTES:
        router.add(method, path, routed(handler, resolver, error_shape),
                   error_shape=error_shape)


class OneModel:
    """A resolver for a node that serves one model itself (the handlers check its name)."""

    def __init__(self, endpoint: ModelEndpoint):
        self.endpoint = endpoint

    def resolve(self, req: HttpRequest) -> tuple[HttpRequest, ModelEndpoint]:
        return req, self.endpoint


def one_model_router(endpoint: ModelEndpoint) -> Router:
    r = Router()
    r.add("GET", "/health", endpoint.health, OPEN)

    async def models(req: HttpRequest) -> Response:
        return Response.json(200, {"object": "list", "data": [endpoint.listing()]})

    r.add("GET", "/v1/models", models, READ)
    add_model_routes(r, OneModel(endpoint))
    return r


async def serve(worker: ModelWorker, host: str, port: int, stop: asyncio.Event, *,
                aliases: tuple[str, ...] = (), keepalive_s: float = 10.0,
                config: ServerConfig | None = None,
                on_listening: Callable[[str, int], None] | None = None,
                on_ready: Callable[[Engine], None] | None = None, stop_timeout: float = 10.0
                ) -> tuple[bool, BaseException | None]:
    """Serve one model's API until `stop` is set: listen at once (health says 503 while
    loading), load the model on its worker thread, serve. Returns (worker ended cleanly, load
    error)."""
    endpoint = ModelEndpoint(worker.model_id, worker, aliases, keepalive_s)
    router = one_model_router(endpoint)
    worker.telemetry = Telemetry()
    worker.telemetry.watch_blas_threads(blas_threads.counts)  # the process's, as /metrics shows
    dashboard.add_routes(router, worker.telemetry, lambda: None,
                         lambda: {worker.model_id: worker})
    server = HttpServer(router, config)
    bound_host, bound_port = await server.start(host, port)
    if on_listening:
        on_listening(bound_host, bound_port)
    ready = worker.start()
    load_error: BaseException | None = None
    stopper = asyncio.ensure_future(stop.wait())
    try:
        waiting: set[asyncio.Future[Any]] = {ready, stopper}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
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
