"""The one error shape of the HTTP API: `{"error": {"message", "type", "param", "code"}}` with a
real status code (OpenAI's shape; the Anthropic route adds its top-level `"type": "error"`)."""

from __future__ import annotations

import orjson

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.protocol import EngineFailed, EngineUnavailable
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.body_fields import FormatError
from skulkp2p.runtime.worker import RingFailed, TensorGroupFailed, WorkerStopped

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "invalid_request_error",
    503: "service_unavailable",
    505: "invalid_request_error",
}

_CODES = {
    401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
    413: "payload_too_large", 414: "uri_too_long", 415: "unsupported_media_type",
    417: "expectation_failed", 421: "misdirected_request",
    429: "queue_full", 431: "headers_too_large", 500: "internal_error",
    501: "not_implemented", 503: "unavailable", 505: "http_version_not_supported",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")
        self.param = param
        self.code = code or _CODES.get(status)
        self.headers = list(headers or [])

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    @classmethod
    def from_request_error(cls, e: RequestError, rename: dict[str, str] | None = None
                           ) -> ApiError:
        """A request-parsing error, with its param renamed to the API's own field name (a
        FormatError names it already, and says its own status and code)."""
        if isinstance(e, FormatError):
            return cls(e.status, e.message, param=e.param, code=e.code)
        param = (rename or {}).get(e.param, e.param) if e.param else e.param
        code = "invalid_value" if e.type == "invalid_request_error" else e.type
        return cls(e.status, e.message, "invalid_request_error" if e.status < 500
                   else "server_error", param, code)


def engine_error(e: BaseException, rename: dict[str, str] | None = None) -> ApiError:
    """The status an engine's error gets: the engine raises its own errors (engine/protocol.py),
    the API decides what they mean in HTTP."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        return ApiError.from_request_error(e, rename)
    if isinstance(e, WorkerStopped):  # the model moved while the request waited or ran
        return ApiError(503, str(e), code="model_moved", headers=[("Retry-After", "1")])
    if isinstance(e, RingFailed):  # a member of the model's ring died or moved: transient
        return ApiError(503, str(e), code="ring_failed", headers=[("Retry-After", "1")])
    if isinstance(e, TensorGroupFailed):  # a member of its tensor group died or moved: same
        return ApiError(503, str(e), code="tensor_group_failed",
                        headers=[("Retry-After", "1")])
    if isinstance(e, EngineUnavailable):
        headers = [("Retry-After", str(e.retry_after))] if e.retry_after else []
        return ApiError(503, e.message, code="model_unavailable", headers=headers)
    if isinstance(e, EngineFailed):
        return ApiError(502, e.message)
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}")
