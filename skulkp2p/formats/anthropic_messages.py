"""Anthropic Messages (POST /v1/messages): the body read into the engine's request, the result
written as a message or streamed as Anthropic's events.

The body maps onto the request: `system` becomes the first chat message, `stop_sequences` the
stop strings, `tools` with `input_schema` the request's tools (`strict` holds a call's input
to its schema), `output_config.format` (structured outputs) the response format, an assistant's `tool_use` blocks
its tool calls and a user's `tool_result` blocks tool results; the chat then goes through the
checks every API's does (chat_messages.check_chat). A reply with tool calls has stop_reason
"tool_use". Streaming follows Anthropic's event sequence: message_start, then per content block
content_block_start, its deltas (`text_delta`, or `input_json_delta` for a tool_use block) and
content_block_stop, then message_delta (stop reason and output tokens), message_stop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.request import GenerationRequest, Message, RequestError, Tool, ToolChoice
from skulkp2p.engine.results import Chunk, GenerationResult, ToolCall
from skulkp2p.formats.body_fields import (
    Body,
    FormatError,
    Options,
    check_body,
    disk_cache,
    max_tokens,
    sampling,
    speculation,
    stop_strings,
)
from skulkp2p.formats.chat_messages import check_chat
from skulkp2p.formats.openai_chat import CheckModel
from skulkp2p.formats.response_format import parse_output_config
from skulkp2p.formats.result_extras import extras
from skulkp2p.formats.tool_specs import check_tool_list, make_tool, tool_entries, with_tools

# Fields read as the pipe's fields of the same name.
PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "repetition_penalty", "speculation", "disk_cache")

OPTIONS: Options = {
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

KNOWN = {*PASSED, *OPTIONS, "messages", "system", "stop_sequences", "tools", "tool_choice",
         "output_config", "output_format"}

# The request's fields as Anthropic names them, for the errors an engine raises later.
RENAME = {"stop": "stop_sequences"}

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}

Event = tuple[str, JSONObject]  # (event name, its data)


def error_type(status: int, default: str) -> str:
    """Anthropic's name for an error of this status (the SDK maps statuses, people read
    types)."""
    return _ERROR_TYPES.get(status, default)


def error_json(error: JSONObject) -> JSONObject:
    """An error body ({"error": {...}}) in Anthropic's envelope."""
    return {"type": "error", **error}


# ---- the request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AnthropicRequest:
    req: GenerationRequest
    stream: bool


def _text_blocks(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise FormatError(f"'{where}' must be a string or a list of content blocks", where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict):
            raise FormatError(f"'{where}[{i}]' must be a content block object", where)
        kind = block.get("type")
        if kind != "text":
            raise FormatError(f"'{where}[{i}]': content blocks of type {kind!r} are not "
                              "supported here (text only)", where)
        text = block.get("text")
        if not isinstance(text, str):
            raise FormatError(f"'{where}[{i}].text' must be a string", where)
        parts.append(text)
    return "".join(parts)


def _turn(role: str, content: object, i: int) -> list[Message]:
    """One Anthropic message as chat messages: an assistant's text and tool_use blocks become
    one assistant message with tool calls; a user's tool_result blocks become tool results
    (in order), its text user messages between them."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise FormatError(f"'{where}' must be a string or a list of content blocks", "messages")
    out: list[Message] = []
    text: list[str] = []
    calls: list[ToolCall] = []

    def flush_text() -> None:
        if text:
            out.append(Message(role, "".join(text)))
            text.clear()

    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict):
            kind = None
        else:
            kind = block.get("type")
            value = block.get("text")
            if kind == "text" and isinstance(value, str):
                text.append(value)
                continue
            if kind == "tool_use" and role == "assistant":
                call_id, name, given = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(call_id, str) or not isinstance(name, str):
                    raise FormatError(f"'{at}': a tool_use block needs 'id' and 'name'",
                                      "messages")
                if not isinstance(given, dict):
                    raise FormatError(f"'{at}.input' must be an object", "messages")
                calls.append(ToolCall(call_id, name, json.dumps(given, ensure_ascii=False)))
                continue
            if kind == "tool_result" and role == "user":
                answers = block.get("tool_use_id")
                if not isinstance(answers, str):
                    raise FormatError(f"'{at}.tool_use_id' must name the tool_use it answers",
                                      "messages")
                flush_text()
                result = _text_blocks(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append(Message("tool", result, tool_call_id=answers))
                continue
        raise FormatError(f"'{at}': content blocks of type {kind!r} are not supported "
                          f"in a {role} message (text, tool_use from the assistant, "
                          "tool_result from the user)", "messages")
    if role == "assistant":
        return [Message("assistant", "".join(text), tuple(calls))]
    flush_text()
    return out


def _tools(value: object) -> tuple[Tool, ...]:
    """Anthropic's `tools`: [{name, description, input_schema}] (custom tools only)."""
    tools = []
    for where, t in tool_entries(value):
        if t.get("type", "custom") != "custom":
            raise RequestError(f"'{where}.type': only custom tools (with input_schema) are "
                               f"supported, got {t.get('type')!r}", f"{where}.type")
        unknown = sorted(set(t) - {"type", "name", "description", "input_schema",
                                   "cache_control", "strict"})
        if unknown:
            raise RequestError(f"'{where}' has unsupported fields: {', '.join(unknown)}",
                               f"{where}.{unknown[0]}")
        tools.append(make_tool(t.get("name"), t.get("description"), t.get("input_schema"),
                               t.get("strict"), where, params_key="input_schema",
                               params_required=True))
    return check_tool_list(tools)


def _tool_choice(value: object) -> tuple[ToolChoice, bool]:
    """Anthropic's `tool_choice` -> (the request's, parallel tool use allowed)."""
    if value is None:
        return ToolChoice("auto"), True
    modes = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(kind, str) or kind not in modes:
        raise RequestError("'tool_choice' must be {\"type\": \"auto\"|\"any\"|\"tool\"|"
                           "\"none\"}", "tool_choice")
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise RequestError("'tool_choice' of type \"tool\" needs 'name'", "tool_choice")
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise RequestError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                           "tool_choice")
    return ToolChoice(modes[kind], name if kind == "tool" and isinstance(name, str) else None), \
        not disable


def messages_request(body: object, check_model: CheckModel) -> AnthropicRequest:
    """The request a Messages body asks for. FormatError for what Anthropic's shape refuses,
    RequestError (its param in RENAME's names) for a field's value."""
    fields: Body = check_body(body, KNOWN, OPTIONS)
    model = fields.get("model")
    check_model(model)
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FormatError("'messages' must be a non-empty list", "messages")
    chat: list[Message] = []
    role: str | None = None
    if fields.get("system") is not None:
        system = _text_blocks(fields["system"], "system")
        if system:
            chat.append(Message("system", system))
    for i, m in enumerate(messages):
        given = m.get("role") if isinstance(m, dict) else None
        if not isinstance(m, dict) or given not in ("user", "assistant"):
            raise FormatError(f"'messages[{i}]' must be an object with role 'user' or "
                              "'assistant' (the system prompt goes in 'system')", "messages")
        role = str(given)
        chat.extend(_turn(role, m.get("content"), i))
    if role != "user":  # the last message's
        raise FormatError("the last message must be from the user (continuing a prefilled "
                          "assistant turn is not supported)", "messages")
    req = GenerationRequest(
        model=model if isinstance(model, str) else None,
        messages=check_chat(chat, "messages"), max_tokens=max_tokens(fields),
        sampling=sampling(fields), stop=stop_strings(fields.get("stop_sequences")),
        speculation=speculation(fields.get("speculation")),
        disk_cache=disk_cache(fields.get("disk_cache")),
        response_format=parse_output_config(fields.get("output_config"),
                                            fields.get("output_format")))
    if fields.get("tools") is not None or fields.get("tool_choice") is not None:
        choice, parallel = _tool_choice(fields.get("tool_choice"))
        tools = _tools(fields["tools"]) if fields.get("tools") is not None else ()
        req = with_tools(req, tools, choice, parallel)
    return AnthropicRequest(req, bool(fields.get("stream")))


# ---- the response ----------------------------------------------------------------------------

_CALL_ID = re.compile(r"call_")


def tool_use_id(call_id: str) -> str:
    """Our call ids as Anthropic spells them (toolu_...)."""
    return _CALL_ID.sub("toolu_", call_id, count=1) if call_id.startswith("call_") else call_id


def _tool_use(call: ToolCall) -> JSONObject:
    arguments: JSONValue
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # the MLX engine checks calls; llama-server's could be cut off
        arguments = None
    if not isinstance(arguments, dict):
        arguments = {"arguments": call.arguments}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments}


def stop_reason(result: GenerationResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if result.stop_sequence else "end_turn"


def message_json(result: GenerationResult, msg_id: str, model: str) -> JSONObject:
    """The whole reply: its text block (none beside calls, unless there is text), then a
    tool_use block per call."""
    content: list[JSONValue] = [{"type": "text", "text": result.text}] if result.text or not \
        result.tool_calls else []
    content += [_tool_use(call) for call in result.tool_calls]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(result),
            "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.usage.prompt_tokens,
                      "output_tokens": result.usage.completion_tokens,
                      "cache_read_input_tokens": result.usage.cached_tokens},
            **extras(result)}


class MessageStream:
    """The events of a streamed reply: message_start, the content blocks as the engine's chunks
    arrive (a text block opened at the first text, a tool_use block per call, its input
    streamed as input_json_delta; each closed before the next opens), message_delta and
    message_stop."""

    def __init__(self, msg_id: str, model: str):
        self.msg_id = msg_id
        self.model = model
        self.index = -1
        self.open: JSONValue = None  # the open block's type: "text" | "tool_use"

    def started(self, prompt_tokens: int) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})]

    def _start(self, block: JSONObject) -> Event:
        self.index += 1
        self.open = block["type"]
        return ("content_block_start", {"type": "content_block_start", "index": self.index,
                                        "content_block": block})

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def produced(self, chunk: Chunk) -> list[Event]:
        out: list[Event] = []
        call = chunk.tool_call
        if call is not None:
            if call.id is not None:
                out += self._stop()
                out.append(self._start({"type": "tool_use", "id": tool_use_id(call.id),
                                        "name": call.name, "input": {}}))
            if call.arguments:
                out.append(("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        elif chunk.text:
            if self.open != "text":
                out += self._stop()
                out.append(self._start({"type": "text", "text": ""}))
            out.append(("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "text_delta", "text": chunk.text}}))
        return out

    def finished(self, result: GenerationResult) -> list[Event]:
        """Close the last block (a reply with no block and no call gets one empty text
        block), then message_delta and message_stop."""
        if self.index < 0 and not result.tool_calls:
            out = [self._start({"type": "text", "text": ""}), *self._stop()]
        else:
            out = self._stop()
        out.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(result), "stop_sequence": result.stop_sequence},
            "usage": {"output_tokens": result.usage.completion_tokens,
                      "cache_read_input_tokens": result.usage.cached_tokens},
            **extras(result)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def failed(error: JSONObject) -> list[Event]:
        """An error after the head: the error body ({"error": {...}}) as Anthropic's event."""
        return [("error", error_json(error))]
