"""POST /v1/cluster/generate: one JSONL-pipe request over HTTP, answered with the pipe's own
result (or error) object (used by `pipe --peer`).

A failure the caller should retry (the model's ring or tensor group broke, the model moved, it
is loading or its group is forming) is a 503 with Retry-After, as on the other routes, with
the pipe's error object: its `type` is the HTTP API's code (`ring_failed`,
`tensor_group_failed`, `model_moved`, `model_unavailable`), so a pipe line that gives up
retrying says what the HTTP API would have. Other failures are the pipe's error object with
status 200 (a bad request, as the local pipe answers it; a failed engine)."""

from __future__ import annotations

from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import engine_error
from skulkp2p.api.server import HttpRequest, Response
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.pipe_format import error_json, parse_request, request_id, result_json
from skulkp2p.runtime.worker import Failed, Finished

# The pipe's error type for a failure that is not the caller's to retry, by HTTP status (the
# local pipe calls a failed engine model_unavailable too).
_PIPE_TYPE_BY_STATUS = {502: "model_unavailable"}


async def pipe_generate(endpoint: ModelEndpoint, req: HttpRequest) -> Response:
    obj = req.json()
    req_id = request_id(obj)

    def error(type_: str, message: str, param: str | None = None) -> Response:
        return Response.json(200, error_json(req_id, type_, message, param))

    try:
        greq = parse_request(obj)
    except RequestError as e:
        return error(e.type, e.message, e.param)
    job = endpoint.submit(greq)  # 429 / 503 as ApiError
    try:
        while True:
            event = await job.next()
            if isinstance(event, Finished):
                return Response.json(200, result_json(event.result, greq.id, endpoint.model_id))
            if isinstance(event, Failed):
                if isinstance(event.error, RequestError):
                    return error(event.error.type, event.error.message, event.error.param)
                api = engine_error(event.error)
                if api.status == 503:  # transient: the caller retries as Retry-After says
                    code = api.code or "unavailable"
                    return Response.json(503, error_json(req_id, code, api.message, code=code),
                                         api.headers)
                return error(_PIPE_TYPE_BY_STATUS.get(api.status, "internal_error"),
                             api.message)
    finally:
        job.cancel()
