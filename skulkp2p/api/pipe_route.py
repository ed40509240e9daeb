"""POST /v1/cluster/generate: one JSONL-pipe request over HTTP, answered with the pipe's own
result (or error) object (used by `pipe --peer`)."""

from __future__ import annotations

from typing import Any

from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import engine_error
from skulkp2p.api.server import HttpRequest, Response
from skulkp2p.api.worker import Failed, Finished
from skulkp2p.engine.request import RequestError, parse_request


async def pipe_generate(endpoint: ModelEndpoint, req: HttpRequest) -> Response:
    obj = req.json()
    req_id = obj.get("id") if isinstance(obj, dict) else None

    def error(type_: str, message: str, param: str | None = None) -> Response:
        out: dict[str, Any] = {"error": {"type": type_, "message": message, "param": param}}
        return Response.json(200, {"id": req_id, **out} if req_id is not None else out)

    try:
        greq = parse_request(obj)
    except RequestError as e:
        return error(e.type, e.message, e.param)
    job = endpoint.submit(greq)  # 429 / 503 as ApiError
    try:
        while True:
            event = await job.next()
            if isinstance(event, Finished):
                return Response.json(200, event.result.to_pipe_dict(greq.id, endpoint.model_id))
            if isinstance(event, Failed):
                if isinstance(event.error, RequestError):
                    return error(event.error.type, event.error.message, event.error.param)
                return error("internal_error", engine_error(event.error).message)
    finally:
        job.cancel()
