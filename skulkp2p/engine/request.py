"""Generation requests: one parser for every front end (pipe, HTTP), and the sampling settings.

No mlx here: the API and the served engine import this without the MLX engine.

Every field is checked for type and range; a bad one raises RequestError naming the field, so each
front end can turn it into its own error shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context: int = 20  # mlx-lm's default window
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


DRAFTERS = ("lookup", "mtp", "draft", "assistant")
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None,
                 type: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type
        self.status = status

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "param": self.param}


@dataclass(frozen=True)
class Speculation:
    mode: str = "auto"  # auto | off | explicit
    drafter: str | None = None
    depth: int | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call: name, description and a JSON Schema of its arguments."""
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The shape chat templates and llama-server take (OpenAI's chat `tools` entry)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = (self.parameters if self.parameters is not None
                            else {"type": "object", "properties": {}})
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """auto: the model decides; none: tools are not offered (not rendered, no calls parsed);
    required: the model must call one; function: it must call `name`."""
    mode: str = "auto"  # auto | none | required | function
    name: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    id: Any = None
    model: str | None = None
    # Chat messages in OpenAI's shape: role and content (a string), plus an assistant's
    # `tool_calls` ([{id, type, function: {name, arguments (JSON text)}}]) and a tool result's
    # `tool_call_id` (and `name`, when given).
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculation: Speculation = field(default_factory=Speculation)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True

    @property
    def uses_tools(self) -> bool:
        """Tools are offered to the model and its calls are parsed."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def _number(obj: dict, key: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {type(v).__name__}", key)
    if v != v:  # NaN
        raise RequestError(f"'{key}' must be a number, got NaN", key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise RequestError(f"'{key}' must be <= {hi}, got {v}", key)
    return float(v)


def _integer(obj: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if lo is not None and v < lo:
        raise RequestError(f"'{key}' must be >= {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise RequestError(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(f"'{where}[{i}]' must be a text part "
                                   "({\"type\": \"text\", \"text\": ...})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or a list of text parts", where)


def _arguments_text(value: Any, where: str, key: str) -> str:
    """A call's arguments as JSON text of an object (given as that text, or as the object)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise RequestError(f"'{where}' must be a JSON object as a string", key)
    try:
        parsed = json.loads(value) if value.strip() else {}
    except ValueError:
        raise RequestError(f"'{where}' is not valid JSON", key) from None
    if not isinstance(parsed, dict):
        raise RequestError(f"'{where}' must be a JSON object", key)
    return value if value.strip() else "{}"


def _tool_calls(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise RequestError(f"'{where}' must be a list of tool calls", key)
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f"'{at}' must be an object with 'id' and 'function'", key)
        if call.get("type", "function") != "function":
            raise RequestError(f"'{at}.type' must be \"function\"", key)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError(f"'{at}.id' must be a non-empty string", key)
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"'{at}.function.name' must be a non-empty string", key)
        out.append({"id": call_id, "type": "function", "function": {
            "name": name,
            "arguments": _arguments_text(fn.get("arguments", "{}"), f"{at}.function.arguments",
                                         key)}})
    return out


def parse_messages(value: Any, key: str = "messages") -> list[dict[str, Any]]:
    """Chat messages in OpenAI's shape (the other APIs map theirs onto it): role, content, and
    what chat templates render of tool use (an assistant's tool_calls, a tool's result)."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"'{key}' must be a non-empty list of messages", key)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RequestError(f"'{key}[{i}]' must be an object with role and content", key)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"'{key}[{i}].role' must be one of {', '.join(ROLES)}, "
                               f"got {role!r}", key)
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise RequestError(f"'{key}[{i}].tool_calls' is only for assistant messages", key)
        content = m.get("content")
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        msg: dict[str, Any] = {"role": role,
                               "content": _content_text(content, f"{key}[{i}].content")}
        if calls:
            msg["tool_calls"] = _tool_calls(calls, f"{key}[{i}].tool_calls", key)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"'{key}[{i}].tool_call_id' must name the call this "
                                   "message answers", key)
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


# ---- tools ----------------------------------------------------------------------------------

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("not", "if", "then", "else", "contains", "propertyNames")


def check_schema(node: Any, where: str, depth: int = 0) -> None:
    """A JSON Schema, checked for shape where a chat template or a constrained decoder reads it:
    a malformed one raises RequestError naming the exact field (`param` is the path)."""
    if depth > 32:
        raise RequestError(f"'{where}' nests too deep (more than 32 levels)", where)
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise RequestError(f"'{where}' must be a JSON Schema object, got "
                           f"{type(node).__name__}", where)
    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise RequestError(f"'{where}.type' must be one of {', '.join(JSON_TYPES)} (or a "
                               f"list of them), got {kind!r}", f"{where}.type")
    for key in _SCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise RequestError(f"'{where}.{key}' must be an object of schemas",
                                   f"{where}.{key}")
            for name, sub in node[key].items():
                check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise RequestError(f"'{where}.{key}' must be a non-empty list of schemas",
                                   f"{where}.{key}")
            for j, sub in enumerate(node[key]):
                check_schema(sub, f"{where}.{key}[{j}]", depth + 1)
    for key in _SCHEMA_ONE:
        if key in node:
            check_schema(node[key], f"{where}.{key}", depth + 1)
    if "items" in node:
        items = node["items"]
        for j, sub in enumerate(items if isinstance(items, list) else [items]):
            check_schema(sub, f"{where}.items" + (f"[{j}]" if isinstance(items, list) else ""),
                         depth + 1)
    if "additionalProperties" in node:
        check_schema(node["additionalProperties"], f"{where}.additionalProperties", depth + 1)
    required = node.get("required")
    if required is not None and (not isinstance(required, list) or not all(
            isinstance(r, str) for r in required)):
        raise RequestError(f"'{where}.required' must be a list of property names",
                           f"{where}.required")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise RequestError(f"'{where}.enum' must be a non-empty list", f"{where}.enum")
    if "description" in node and not isinstance(node["description"], str):
        raise RequestError(f"'{where}.description' must be a string", f"{where}.description")


def make_tool(name: Any, description: Any, parameters: Any, strict: Any, where: str,
              name_key: str = "name", params_key: str = "parameters",
              params_required: bool = False) -> Tool:
    """One function tool from its parts, each checked; errors name `where`.<field> as the API
    spells it (OpenAI chat nests them under `function`, Responses and Anthropic do not)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise RequestError(f"'{where}.{name_key}' must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}", f"{where}.{name_key}")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"'{where}.description' must be a string", f"{where}.description")
    if parameters is None:
        if params_required:
            raise RequestError(f"'{where}.{params_key}' is required", f"{where}.{params_key}")
    else:
        at = f"{where}.{params_key}"
        if not isinstance(parameters, dict):
            raise RequestError(f"'{at}' must be a JSON Schema object, got "
                               f"{type(parameters).__name__}", at)
        if parameters.get("type", "object") != "object":
            raise RequestError(f"'{at}.type' must be \"object\" (a function takes named "
                               f"arguments), got {parameters.get('type')!r}", f"{at}.type")
        check_schema(parameters, at)
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    return Tool(name, description, parameters, strict)


def check_tool_list(tools: list[Tool], key: str = "tools") -> tuple[Tool, ...]:
    seen = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise RequestError(f"'{key}[{i}]': a function named {tool.name!r} is already given",
                               f"{key}[{i}]")
        seen.add(tool.name)
    return tuple(tools)


def tool_entries(value: Any, key: str = "tools") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, entry) for each object of an API's tool list, in every API's shape: the list and
    each entry being an object are checked here, the entry's own fields by the caller."""
    if not isinstance(value, list):
        raise RequestError(f"'{key}' must be a list of tools", key)
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise RequestError(f"'{where}' must be an object", where)
        yield where, entry


def parse_tools(value: Any, key: str = "tools") -> tuple[Tool, ...]:
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


def parse_tool_choice(value: Any, key: str = "tool_choice") -> ToolChoice:
    """OpenAI's `tool_choice`: "auto" | "none" | "required" | {"type": "function", "function":
    {"name": ...}} (the Responses API's {"type": "function", "name": ...} too)."""
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value in ("none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("function", name)
    raise RequestError(f"'{key}' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", key)


def with_tools(req: GenerationRequest, tools: tuple[Tool, ...], choice: ToolChoice,
               parallel: bool = True, key: str = "tools", choice_key: str = "tool_choice"
               ) -> GenerationRequest:
    """The request with its tools, checked against each other and the rest of the request."""
    if choice.mode in ("required", "function") and not tools:
        raise RequestError(f"'{choice_key}' {choice.mode!r} needs '{key}'", choice_key)
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise RequestError(f"'{choice_key}' names {choice.name!r}, which is not among "
                           f"'{key}'", choice_key)
    if tools and req.messages is None:
        raise RequestError(f"'{key}' need 'messages' (the chat template renders them)", key)
    return replace(req, tools=tools, tool_choice=choice, parallel_tool_calls=parallel)


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop")
    if len(value) > 16:
        raise RequestError("'stop' takes at most 16 strings", "stop")
    return tuple(value)


def parse_speculation(value: Any) -> Speculation:
    if value is None or value == "auto":
        return Speculation("auto")
    if value == "off":
        return Speculation("off")
    if isinstance(value, dict):
        unknown = set(value) - {"drafter", "depth"}
        if unknown:
            raise RequestError(f"'speculation' has unknown fields: {', '.join(sorted(unknown))}",
                               "speculation")
        drafter = value.get("drafter")
        if drafter not in DRAFTERS:
            raise RequestError(f"'speculation.drafter' must be one of {', '.join(DRAFTERS)}, "
                               f"got {drafter!r}", "speculation")
        depth = _integer(value, "depth", lo=1, hi=32) if "depth" in value else None
        return Speculation("explicit", drafter, depth)
    raise RequestError("'speculation' must be \"auto\", \"off\" or "
                       "{\"drafter\": \"mtp\"|\"lookup\"|\"draft\"|\"assistant\", \"depth\": k}", "speculation")


COMMON_FIELDS = {"id", "model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                 "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repetition_penalty", "speculation", "tools", "tool_choice",
                 "parallel_tool_calls"}


def parse_request(obj: Any, extra_fields: frozenset[str] = frozenset()) -> GenerationRequest:
    """Check a request object. Unknown fields are refused by name, never silently ignored."""
    if not isinstance(obj, dict):
        raise RequestError("a request must be a JSON object")
    unknown = set(obj) - COMMON_FIELDS - extra_fields
    if unknown:
        names = ", ".join(sorted(unknown))
        raise RequestError(f"unsupported field(s): {names}", sorted(unknown)[0])
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    messages = prompt = None
    if obj.get("messages") is not None and obj.get("prompt") is not None:
        raise RequestError("give either 'messages' or 'prompt', not both", "messages")
    if obj.get("messages") is not None:
        messages = parse_messages(obj["messages"])
    elif obj.get("prompt") is not None:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", "prompt")
    else:
        raise RequestError("a request needs 'messages' (chat) or 'prompt' (raw text)", "messages")
    max_tokens = _integer(obj, "max_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _integer(obj, "max_completion_tokens", lo=1)
    temperature = _number(obj, "temperature", lo=0.0, hi=100.0)
    top_p = _number(obj, "top_p", lo=0.0, hi=1.0, lo_open=True)
    top_k = _integer(obj, "top_k", lo=0)
    min_p = _number(obj, "min_p", lo=0.0, hi=1.0)
    rep = _number(obj, "repetition_penalty", lo=0.0, hi=10.0, lo_open=True)
    seed = _integer(obj, "seed", lo=0, hi=2**63 - 1)
    sampling = SamplingParams(
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        min_p=min_p or 0.0,
        repetition_penalty=rep,
        seed=seed,
    )
    req = GenerationRequest(
        id=obj.get("id"), model=model, messages=messages, prompt=prompt, max_tokens=max_tokens,
        sampling=sampling, stop=parse_stop(obj.get("stop")),
        speculation=parse_speculation(obj.get("speculation")),
    )
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools = parse_tools(obj.get("tools"))
    choice = parse_tool_choice(obj.get("tool_choice"))
    if not tools and choice.mode in ("auto", "none") and parallel is None:
        return req
    return with_tools(req, tools, choice, parallel is not False)
