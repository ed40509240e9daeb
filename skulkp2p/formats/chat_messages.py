"""OpenAI chat's messages, tools and tool_choice, read into the engine's values and written back
(the pipe and llama-server speak them too), and the checks every API's chat goes through.

A chat is a tuple of `Message`s. OpenAI chat's `messages` are read here field by field; the
other APIs build their messages from their own items (Anthropic's content blocks, the Responses
API's input items) and hand them to `check_chat`, which checks what they carry of tool use the
same way, naming the message by its place in the chat.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import ROLES, Message, RequestError, Tool, ToolChoice
from skulkp2p.engine.results import ToolCall
from skulkp2p.formats.body_fields import check_depth, parse_json_text
from skulkp2p.formats.tool_specs import check_tool_list, make_tool, tool_entries

# ---- reading ---------------------------------------------------------------------------------


def content_text(content: object, where: str) -> str:
    """A message's content: a string, or OpenAI's content parts (only text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    text, str):
                raise RequestError(f"'{where}[{i}]' must be a text part "
                                   "({\"type\": \"text\", \"text\": ...})", where)
            parts.append(text)
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or a list of text parts", where)


def arguments_text(value: object, where: str, key: str) -> str:
    """A call's arguments as JSON text of an object (given as that text, or as the object),
    bounded as every JSON a request holds (body_fields.parse_json_text, check_depth)."""
    if isinstance(value, dict):
        check_depth(value, where, key)
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise RequestError(f"'{where}' must be a JSON object as a string", key)
    parsed = parse_json_text(value, where, key) if value.strip() else {}
    if not isinstance(parsed, dict):
        raise RequestError(f"'{where}' must be a JSON object", key)
    return value if value.strip() else "{}"


def call_id(value: object, at: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{at}.id' must be a non-empty string", key)
    return value


def call_name(value: object, at: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{at}.function.name' must be a non-empty string", key)
    return value


def answered_call(value: object, at: str, key: str) -> str:
    """A tool result's `tool_call_id`: the call it answers."""
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{at}.tool_call_id' must name the call this message answers", key)
    return value


def _tool_calls(value: object, where: str, key: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise RequestError(f"'{where}' must be a list of tool calls", key)
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict):
            raise RequestError(f"'{at}' must be an object with 'id' and 'function'", key)
        if call.get("type", "function") != "function":
            raise RequestError(f"'{at}.type' must be \"function\"", key)
        cid = call_id(call.get("id"), at, key)
        name = call_name(fn.get("name"), at, key)
        out.append(ToolCall(cid, name, arguments_text(fn.get("arguments", "{}"),
                                                      f"{at}.function.arguments", key)))
    return tuple(out)


def parse_messages(value: object, key: str = "messages") -> tuple[Message, ...]:
    """OpenAI chat's messages: role, content, and what chat templates render of tool use (an
    assistant's tool_calls, a tool's result)."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"'{key}' must be a non-empty list of messages", key)
    out: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RequestError(f"'{key}[{i}]' must be an object with role and content", key)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(f"'{key}[{i}].role' must be one of {', '.join(ROLES)}, "
                               f"got {role!r}", key)
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise RequestError(f"'{key}[{i}].tool_calls' is only for assistant messages", key)
        content = m.get("content")
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        text = content_text(content, f"{key}[{i}].content")
        tool_calls = _tool_calls(calls, f"{key}[{i}].tool_calls", key) if calls else ()
        answers = name = None
        if role == "tool":
            answers = answered_call(m.get("tool_call_id"), f"{key}[{i}]", key)
            given = m.get("name")
            name = given if isinstance(given, str) else None
        out.append(Message(role, text, tool_calls, answers, name))
    return tuple(out)


def check_chat(messages: Sequence[Message], key: str) -> tuple[Message, ...]:
    """A chat another API built from its own items, checked as OpenAI chat's messages are (the
    calls' ids and names given, their arguments JSON objects, every tool result answering a
    call); errors name the message by its place in the chat, under `key`."""
    if not messages:
        raise RequestError(f"'{key}' must be a non-empty list of messages", key)
    out = []
    for i, m in enumerate(messages):
        calls = []
        for j, call in enumerate(m.tool_calls):
            at = f"{key}[{i}].tool_calls[{j}]"
            calls.append(ToolCall(call_id(call.id, at, key), call_name(call.name, at, key),
                                  arguments_text(call.arguments, f"{at}.function.arguments",
                                                 key)))
        answers = m.tool_call_id
        if m.role == "tool":
            answers = answered_call(answers, f"{key}[{i}]", key)
        out.append(Message(m.role, m.content, tuple(calls), answers, m.name))
    return tuple(out)


def parse_tools(value: object, key: str = "tools") -> tuple[Tool, ...]:
    """OpenAI chat's `tools`: [{"type": "function", "function": {name, description,
    parameters, strict}}]."""
    if value is None:
        return ()
    tools = []
    for where, entry in tool_entries(value, key):
        if entry.get("type") != "function":
            raise RequestError(f"'{where}.type' must be \"function\" (the only tools "
                               f"supported), got {entry.get('type')!r}", f"{where}.type")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"'{where}.function' must be an object with name and "
                               "parameters", f"{where}.function")
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                               fn.get("strict"), f"{where}.function"))
    return check_tool_list(tools, key)


def parse_tool_choice(value: object, key: str = "tool_choice") -> ToolChoice:
    """OpenAI's `tool_choice`: "auto" | "none" | "required" | {"type": "function", "function":
    {"name": ...}} (the Responses API's {"type": "function", "name": ...} too)."""
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value == "none" or value == "required":
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("function", name)
    raise RequestError(f"'{key}' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", key)


# ---- writing ---------------------------------------------------------------------------------


def tool_call_json(call: ToolCall) -> JSONObject:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def message_json(m: Message) -> JSONObject:
    out: JSONObject = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [tool_call_json(call) for call in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def tool_json(tool: Tool) -> JSONObject:
    """OpenAI chat's `tools` entry."""
    fn: JSONObject = {"name": tool.name}
    if tool.description is not None:
        fn["description"] = tool.description
    fn["parameters"] = (tool.parameters if tool.parameters is not None
                        else {"type": "object", "properties": {}})
    return {"type": "function", "function": fn}
