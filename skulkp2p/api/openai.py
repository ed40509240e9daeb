"""OpenAI-compatible routes: POST /v1/chat/completions and POST /v1/completions.

The body is read into the engine's request by its format (formats/openai_chat.py,
formats/completions.py: what each takes and refuses); here the request runs on the model's
worker and its answer goes out whole or as Server-Sent Events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.completions import CompletionShape, completion_request
from skulkp2p.formats.openai_chat import OpenAIRequest, OpenAIShape, chat_request
from skulkp2p.runtime.worker import Failed, Finished, Produced, Started


def parse_chat(node: ModelEndpoint, body: object) -> OpenAIRequest:
    try:
        return chat_request(body, node.check_model)
    except RequestError as e:
        raise ApiError.from_request_error(e) from None


def parse_completion(node: ModelEndpoint, body: object) -> OpenAIRequest:
    try:
        return completion_request(body, node.check_model)
    except RequestError as e:
        raise ApiError.from_request_error(e) from None


async def _handle(node: ModelEndpoint, http_req: HttpRequest, chat: bool
                  ) -> Response | StreamingResponse:
    parsed = (parse_chat if chat else parse_completion)(node, http_req.json())
    shape = (OpenAIShape if chat else CompletionShape)(node.model_id, parsed.include_usage)
    if not parsed.stream:
        _, result = await node.run_to_end(parsed.req)
        return Response.json(200, shape.whole(result))
    job, first = await node.open_stream(parsed.req)

    async def events() -> AsyncIterator[bytes]:
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, Started):
                for obj in shape.started():
                    yield sse.event(obj)
            elif isinstance(event, Produced):
                for obj in shape.produced(event.chunk):
                    yield sse.event(obj)
            elif isinstance(event, Finished):
                for obj in shape.finished(event.result):
                    yield sse.event(obj)
                yield sse.DONE
            elif isinstance(event, Failed):
                yield sse.event(engine_error(event.error).body())

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)


async def chat_completions(node: ModelEndpoint, req: HttpRequest) -> Response | StreamingResponse:
    return await _handle(node, req, chat=True)


async def completions(node: ModelEndpoint, req: HttpRequest) -> Response | StreamingResponse:
    return await _handle(node, req, chat=False)
