"""Anthropic Messages: POST /v1/messages, whole and streaming.

The body is mapped onto the engine's request (`system` becomes the first chat message,
`stop_sequences` the stop strings, `tools` with `input_schema` the engine's tools, `tool_use`
blocks an assistant's tool calls and `tool_result` blocks tool messages) and checked by the same
parser as every other front end; errors name the Anthropic field. Streaming follows Anthropic's
event sequence: message_start, then per content block content_block_start, its deltas
(`text_delta`, or `input_json_delta` for a tool_use block) and content_block_stop, then
message_delta (stop reason and output tokens), message_stop; a failure after the head ends with
an `error` event. A reply with tool calls has stop_reason "tool_use".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.fields import check_body
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import (
    GenerationRequest,
    RequestError,
    Tool,
    ToolChoice,
    check_tool_list,
    make_tool,
    parse_request,
    tool_entries,
    with_tools,
)
from skulkp2p.engine.results import Chunk, GenerationResult, ToolCall
from skulkp2p.runtime.worker import Failed, Finished, Produced, Started

# Fields passed on to the engine's parser under the same name.
_PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
           "repetition_penalty", "speculation")

# field -> (is this value harmless?, why another value is refused)
_OPTIONS = {
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be a boolean"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "'metadata' must be an object"),
    "thinking": (lambda v: v is None or v == {"type": "disabled"},
                 "extended thinking is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "standard_only"),
                     "only service_tier 'auto' or 'standard_only' is supported"),
    "container": (lambda v: v is None, "containers are not supported"),
    "mcp_servers": (lambda v: v is None or v == [], "MCP servers are not supported"),
    "context_management": (lambda v: v is None, "context management is not supported"),
}

_KNOWN = {*_PASSED, *_OPTIONS, "messages", "system", "stop_sequences", "tools", "tool_choice"}

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
                                "supported here (text only)", param=where)
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"'{where}[{i}].text' must be a string", param=where)
        parts.append(block["text"])
    return "".join(parts)


def _turn(m: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text and tool_use blocks become
    one assistant message with tool calls; a user's tool_result blocks become tool messages
    (in order), its text a user message."""
    role, content = m["role"], m.get("content")
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or a list of content blocks",
                       param="messages")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if text:
            out.append({"role": role, "content": "".join(text)})
            text.clear()

    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ApiError(400, f"'{at}': a tool_use block needs 'id' and 'name'",
                               param="messages")
            if not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"'{at}.input' must be an object", param="messages")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"],
                "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"'{at}.tool_use_id' must name the tool_use it answers",
                               param="messages")
            flush_text()
            result = _text_blocks(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": result})
        else:
            raise ApiError(400, f"'{at}': content blocks of type {kind!r} are not supported "
                                f"in a {role} message (text, tool_use from the assistant, "
                                "tool_result from the user)", param="messages")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    flush_text()
    return out


def _tools(value: Any) -> tuple[Tool, ...]:
    """Anthropic's `tools`: [{name, description, input_schema}] (custom tools only)."""
    tools = []
    for where, t in tool_entries(value):
        if t.get("type", "custom") != "custom":
            raise RequestError(f"'{where}.type': only custom tools (with input_schema) are "
                               f"supported, got {t.get('type')!r}", f"{where}.type")
        unknown = sorted(set(t) - {"type", "name", "description", "input_schema",
                                   "cache_control"})
        if unknown:
            raise RequestError(f"'{where}' has unsupported fields: {', '.join(unknown)}",
                               f"{where}.{unknown[0]}")
        tools.append(make_tool(t.get("name"), t.get("description"), t.get("input_schema"),
                               None, where, params_key="input_schema", params_required=True))
    return check_tool_list(tools)


def _tool_choice(value: Any) -> tuple[ToolChoice, bool]:
    """Anthropic's `tool_choice` -> (the engine's, parallel tool use allowed)."""
    if value is None:
        return ToolChoice("auto"), True
    modes = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if not isinstance(value, dict) or value.get("type") not in modes:
        raise RequestError("'tool_choice' must be {\"type\": \"auto\"|\"any\"|\"tool\"|"
                           "\"none\"}", "tool_choice")
    name = value.get("name")
    if value["type"] == "tool" and not isinstance(name, str):
        raise RequestError("'tool_choice' of type \"tool\" needs 'name'", "tool_choice")
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise RequestError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                           "tool_choice")
    return ToolChoice(modes[value["type"]], name if value["type"] == "tool" else None), \
        not disable


def parse_messages_request(node: ModelEndpoint, body: Any) -> tuple[GenerationRequest, bool]:
    body = check_body(body, _KNOWN, _OPTIONS)
    node.check_model(body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    chat: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system")
        if system:
            chat.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"'messages[{i}]' must be an object with role 'user' or "
                                "'assistant' (the system prompt goes in 'system')",
                           param="messages")
        chat.extend(_turn(m, i))
    if messages[-1]["role"] != "user":
        raise ApiError(400, "the last message must be from the user (continuing a prefilled "
                            "assistant turn is not supported)", param="messages")
    inner = {k: body[k] for k in _PASSED if k in body}
    inner["messages"] = chat
    if body.get("stop_sequences") is not None:
        inner["stop"] = body["stop_sequences"]
    try:
        req = parse_request(inner)
        if body.get("tools") is not None or body.get("tool_choice") is not None:
            choice, parallel = _tool_choice(body.get("tool_choice"))
            tools = _tools(body["tools"]) if body.get("tools") is not None else ()
            req = with_tools(req, tools, choice, parallel)
    except RequestError as e:
        raise ApiError.from_request_error(e, _RENAME) from None
    return req, bool(body.get("stream"))


_CALL_ID = re.compile(r"call_")


def tool_use_id(call_id: str) -> str:
    """Our call ids as Anthropic spells them (toolu_...)."""
    return _CALL_ID.sub("toolu_", call_id, count=1) if call_id.startswith("call_") else call_id


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # the MLX engine checks calls; llama-server's could be cut off
        arguments = None
    if not isinstance(arguments, dict):
        arguments = {"arguments": call.arguments}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments}


def _stop_reason(result: GenerationResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if result.stop_sequence else "end_turn"


class _Blocks:
    """The content blocks of a streamed reply: a text block opened at the first text, a
    tool_use block per call (its input streamed as input_json_delta), each closed before the
    next opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" | "tool_use"

    def _start(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open = block["type"]
        return sse.event({"type": "content_block_start", "index": self.index,
                          "content_block": block}, "content_block_start")

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse.event({"type": "content_block_stop", "index": self.index},
                          "content_block_stop")]

    def chunk(self, chunk: Chunk) -> list[bytes]:
        out: list[bytes] = []
        call = chunk.tool_call
        if call is not None:
            if call.id is not None:
                out += self._stop()
                out.append(self._start({"type": "tool_use", "id": tool_use_id(call.id),
                                        "name": call.name, "input": {}}))
            if call.arguments:
                out.append(sse.event({"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "input_json_delta",
                                                "partial_json": call.arguments}},
                                     "content_block_delta"))
        elif chunk.text:
            if self.open != "text":
                out += self._stop()
                out.append(self._start({"type": "text", "text": ""}))
            out.append(sse.event({"type": "content_block_delta", "index": self.index,
                                  "delta": {"type": "text_delta", "text": chunk.text}},
                                 "content_block_delta"))
        return out

    def close(self, empty_text: bool) -> list[bytes]:
        """Close the last block; a reply with no block at all gets one empty text block."""
        if self.index < 0 and empty_text:
            return [self._start({"type": "text", "text": ""}), *self._stop()]
        return self._stop()


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
        content = [{"type": "text", "text": result.text}] if result.text or not \
            result.tool_calls else []
        return Response.json(200, {
            "id": msg_id, "type": "message", "role": "assistant", "model": node.model_id,
            "content": content + [_tool_use(call) for call in result.tool_calls],
            "stop_reason": _stop_reason(result), "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.usage.prompt_tokens,
                      "output_tokens": result.usage.completion_tokens,
                      "cache_read_input_tokens": result.usage.cached_tokens},
            **result.extras()})
    job, first = await node.open_stream(req, _RENAME)

    async def events() -> AsyncIterator[bytes]:
        blocks = _Blocks()
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, Started):
                yield sse.event({"type": "message_start", "message": {
                    "id": msg_id, "type": "message", "role": "assistant", "content": [],
                    "model": node.model_id, "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": event.prompt_tokens, "output_tokens": 0}}},
                    "message_start")
            elif isinstance(event, Produced):
                for out in blocks.chunk(event.chunk):
                    yield out
            elif isinstance(event, Finished):
                result = event.result
                for out in blocks.close(empty_text=not result.tool_calls):
                    yield out
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
