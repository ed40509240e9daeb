"""Anthropic Messages: POST /v1/messages, whole and streaming.

The body is mapped onto the engine's request (`system` becomes the first chat message,
`stop_sequences` the stop strings) and checked by the same parser as every other front end;
errors name the Anthropic field. Streaming follows Anthropic's event sequence: message_start,
content_block_start, content_block_delta per token, content_block_stop, message_delta (stop
reason and output tokens), message_stop; a failure after the head ends with an `error` event.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.api.worker import Failed, Finished, Produced, Started
from skulkp2p.engine.request import GenerationRequest, RequestError, parse_request
from skulkp2p.engine.results import GenerationResult

# Fields passed on to the engine's parser under the same name.
_PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
           "repetition_penalty", "speculation")

# field -> (is this value harmless?, why another value is refused)
_OPTIONS = {
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be a boolean"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "'metadata' must be an object"),
    "tools": (lambda v: v is None or v == [], "tools are not supported yet"),
    "tool_choice": (lambda v: v is None or v in ({"type": "none"}, {"type": "auto"}),
                    "tools are not supported yet"),
    "thinking": (lambda v: v is None or v == {"type": "disabled"},
                 "extended thinking is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "standard_only"),
                     "only service_tier 'auto' or 'standard_only' is supported"),
    "container": (lambda v: v is None, "containers are not supported"),
    "mcp_servers": (lambda v: v is None or v == [], "MCP servers are not supported"),
    "context_management": (lambda v: v is None, "context management is not supported"),
}

_KNOWN = {*_PASSED, *_OPTIONS, "messages", "system", "stop_sequences"}

_RENAME = {"stop": "stop_sequences"}

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def _anthropic_error(e: ApiError) -> ApiError:
    """The same error with Anthropic's type names (the SDK maps statuses, people read types)."""
    e.type = _ERROR_TYPES.get(e.status, e.type)
    return e


def _text_blocks(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be a string or a list of content blocks",
                       param=where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict):
            raise ApiError(400, f"'{where}[{i}]' must be a content block object", param=where)
        kind = block.get("type")
        if kind != "text":
            raise ApiError(400, f"'{where}[{i}]': content blocks of type {kind!r} are not "
                                "supported (text only)", param=where)
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"'{where}[{i}].text' must be a string", param=where)
        parts.append(block["text"])
    return "".join(parts)


def parse_messages_request(node: ModelEndpoint, body: Any) -> tuple[GenerationRequest, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0],
                       code="unsupported_parameter")
    for key, (ok, why) in _OPTIONS.items():
        if key in body and not ok(body[key]):
            raise ApiError(400, f"unsupported value for '{key}': {why}", param=key,
                           code="unsupported_parameter")
    node.check_model(body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    chat: list[dict[str, str]] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system")
        if system:
            chat.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"'messages[{i}]' must be an object with role 'user' or "
                                "'assistant' (the system prompt goes in 'system')",
                           param="messages")
        chat.append({"role": m["role"],
                     "content": _text_blocks(m.get("content"), f"messages[{i}].content")})
    if chat[-1]["role"] != "user":
        raise ApiError(400, "the last message must be from the user (continuing a prefilled "
                            "assistant turn is not supported)", param="messages")
    inner = {k: body[k] for k in _PASSED if k in body}
    inner["messages"] = chat
    if body.get("stop_sequences") is not None:
        inner["stop"] = body["stop_sequences"]
    try:
        req = parse_request(inner)
    except RequestError as e:
        raise ApiError.from_request_error(e, _RENAME) from None
    return req, bool(body.get("stream"))


def _stop_reason(result: GenerationResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence else "end_turn"


async def messages(node: ModelEndpoint, http_req: HttpRequest) -> Response | StreamingResponse:
    try:
        return await _messages(node, http_req)
    except ApiError as e:
        return Response.error(_anthropic_error(e), extra={"type": "error"})


async def _messages(node: ModelEndpoint, http_req: HttpRequest) -> Response | StreamingResponse:
    req, stream = parse_messages_request(node, http_req.json())
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if not stream:
        n_prompt, result = await node.run_to_end(req, _RENAME)
        return Response.json(200, {
            "id": msg_id, "type": "message", "role": "assistant", "model": node.model_id,
            "content": [{"type": "text", "text": result.text}],
            "stop_reason": _stop_reason(result), "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.usage.prompt_tokens,
                      "output_tokens": result.usage.completion_tokens,
                      "cache_read_input_tokens": result.usage.cached_tokens},
            **result.extras()})
    job, first = await node.open_stream(req, _RENAME)

    async def events() -> AsyncIterator[bytes]:
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, Started):
                yield sse.event({"type": "message_start", "message": {
                    "id": msg_id, "type": "message", "role": "assistant", "content": [],
                    "model": node.model_id, "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": event.prompt_tokens, "output_tokens": 0}}},
                    "message_start")
                yield sse.event({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}},
                                "content_block_start")
            elif isinstance(event, Produced):
                if event.chunk.text:
                    yield sse.event({"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": event.chunk.text}},
                                    "content_block_delta")
            elif isinstance(event, Finished):
                result = event.result
                yield sse.event({"type": "content_block_stop", "index": 0}, "content_block_stop")
                yield sse.event({
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(result),
                              "stop_sequence": result.stop_sequence},
                    "usage": {"output_tokens": result.usage.completion_tokens,
                              "cache_read_input_tokens": result.usage.cached_tokens},
                    **result.extras()}, "message_delta")
                yield sse.event({"type": "message_stop"}, "message_stop")
            elif isinstance(event, Failed):
                err = _anthropic_error(engine_error(event.error, _RENAME))
                yield sse.event({"type": "error", **err.body()}, "error")

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)
