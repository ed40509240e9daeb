"""OpenAI's Responses API: POST /v1/responses, whole and streaming.

The body is read into the engine's request by its format (formats/responses_api.py); here the
request runs on the model's worker, its answer goes out whole or as the API's typed events, and
the conversation it ends is kept for `previous_response_id` (response_store.py: per node,
bounded; 404 for one that is not there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.response_store import ResponseStore, node_store
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import Message, RequestError
from skulkp2p.engine.results import GenerationResult
from skulkp2p.formats.responses_api import (
    RENAME,
    ResponseShape,
    ResponsesRequest,
    ResponseStream,
    response_request,
    stored_conversation,
)
from skulkp2p.runtime.worker import Failed, Finished, Produced


def parse_response_request(node: ModelEndpoint, body: object, store: ResponseStore
                           ) -> ResponsesRequest:
    def stored(response_id: str) -> tuple[Message, ...]:
        entry = store.get(response_id)
        if entry is None:
            raise ApiError(404, f"no stored response {response_id!r} on this node (responses "
                                f"are kept in memory, at most {store.max_count} of them)",
                           param="previous_response_id", code="response_not_found")
        return entry.messages

    try:
        return response_request(body, node.check_model, stored)
    except RequestError as e:
        raise ApiError.from_request_error(e, RENAME) from None


def _store(store: ResponseStore, shape: ResponseShape, parsed: ResponsesRequest,
           result: GenerationResult, model: str) -> None:
    if parsed.store:
        store.put(shape.id, stored_conversation(parsed, result), model)


async def responses(node: ModelEndpoint, http_req: HttpRequest,
                    store: ResponseStore | None = None) -> Response | StreamingResponse:
    store = store if store is not None else node_store()
    parsed = parse_response_request(node, http_req.json(), store)
    shape = ResponseShape(parsed, node.model_id)
    if not parsed.stream:
        _, result = await node.run_to_end(parsed.req, RENAME)
        _store(store, shape, parsed, result, node.model_id)
        return Response.json(200, shape.whole(result))
    job, first = await node.open_stream(parsed.req, RENAME)
    stream = ResponseStream(shape)

    async def events() -> AsyncIterator[bytes]:
        for name, data in stream.started():
            yield sse.event(data, name)
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
                continue
            if isinstance(event, Produced):
                out = stream.produced(event.chunk)
            elif isinstance(event, Finished):
                _store(store, shape, parsed, event.result, node.model_id)
                out = stream.finished(event.result)
            elif isinstance(event, Failed):
                err = engine_error(event.error, RENAME)
                out = stream.failed(err.code, err.message, err.param)
            else:
                continue
            for name, data in out:
                yield sse.event(data, name)

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)
