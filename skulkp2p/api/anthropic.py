"""Anthropic Messages: POST /v1/messages, whole and streaming.

The body is read into the engine's request by its format (formats/anthropic_messages.py); here
the request runs on the model's worker and its answer goes out whole or as Anthropic's events.
Every error has Anthropic's envelope and type names (`{"type": "error", "error": {...}}`); one
after the head ends the stream as an `error` event.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.anthropic_messages import (
    RENAME,
    AnthropicRequest,
    MessageStream,
    error_json,
    error_type,
    message_json,
    messages_request,
)
from skulkp2p.runtime.worker import Failed, Finished, Produced, Started


def _anthropic_error(e: ApiError) -> ApiError:
    """The same error with Anthropic's type names (a missing or wrong key is its
    `authentication_error`)."""
    e.type = "authentication_error" if e.status == 401 else error_type(e.status, e.type)
    return e


def parse_messages_request(node: ModelEndpoint, body: object) -> AnthropicRequest:
    try:
        return messages_request(body, node.check_model)
    except RequestError as e:
        raise ApiError.from_request_error(e, RENAME) from None


def error_response(e: ApiError) -> Response:
    """An error as this route answers it: Anthropic's envelope and type names."""
    err = _anthropic_error(e)
    return Response.json(err.status, error_json(err.body()), err.headers)


async def messages(node: ModelEndpoint, http_req: HttpRequest) -> Response | StreamingResponse:
    try:
        return await _messages(node, http_req)
    except ApiError as e:
        return error_response(e)


async def _messages(node: ModelEndpoint, http_req: HttpRequest) -> Response | StreamingResponse:
    parsed = parse_messages_request(node, http_req.json())
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if not parsed.stream:
        _, result = await node.run_to_end(parsed.req, RENAME)
        return Response.json(200, message_json(result, msg_id, node.model_id))
    job, first = await node.open_stream(parsed.req, RENAME)
    stream = MessageStream(msg_id, node.model_id)

    async def events() -> AsyncIterator[bytes]:
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
                continue
            if isinstance(event, Started):
                out = stream.started(event.prompt_tokens)
            elif isinstance(event, Produced):
                out = stream.produced(event.chunk)
            elif isinstance(event, Finished):
                out = stream.finished(event.result)
            else:
                assert isinstance(event, Failed)
                out = stream.failed(_anthropic_error(engine_error(event.error, RENAME)).body())
            for name, data in out:
                yield sse.event(data, name)

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)
