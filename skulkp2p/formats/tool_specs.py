"""Function tools as every API offers them: a tool's name, description and JSON Schema checked
where a chat template or a constrained decoder reads them, and the tools joined to a request.

Each API nests a tool's fields its own way (OpenAI chat under `function`, the Responses API and
Anthropic not; Anthropic calls the schema `input_schema`), so every error names the field as the
API spells it: `param` is its whole path (`tools[0].function.parameters.properties.x.type`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from skulkp2p.engine.decode.grammar import compile_format
from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import (
    TOOL_NAME,
    GenerationRequest,
    RequestError,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from skulkp2p.formats.body_fields import Body

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("not", "if", "then", "else", "contains", "propertyNames")


def check_schema(node: object, where: str, depth: int = 0) -> None:
    """A JSON Schema, checked for shape: a malformed one raises RequestError naming the exact
    field (`param` is the path)."""
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
            subs = node[key]
            if not isinstance(subs, dict):
                raise RequestError(f"'{where}.{key}' must be an object of schemas",
                                   f"{where}.{key}")
            for name, sub in subs.items():
                check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in node:
            listed = node[key]
            if not isinstance(listed, list) or not listed:
                raise RequestError(f"'{where}.{key}' must be a non-empty list of schemas",
                                   f"{where}.{key}")
            for j, sub in enumerate(listed):
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


def make_tool(name: object, description: object, parameters: object, strict: object,
              where: str, name_key: str = "name", params_key: str = "parameters",
              params_required: bool = False) -> Tool:
    """One function tool from its parts, each checked; errors name `where`.<field>."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise RequestError(f"'{where}.{name_key}' must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}", f"{where}.{name_key}")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"'{where}.description' must be a string", f"{where}.description")
    schema: JSONObject | None = None
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
        schema = parameters
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    if strict and schema is not None:
        # A strict tool's calls are held to its schema (engine/decode/tool_grammar.py): one
        # the grammar cannot compile is refused here, naming the keyword's path.
        compile_format(ResponseFormat(type="json_schema", schema=schema),
                       f"{where}.{params_key}")
    return Tool(name, description, schema, strict)


def check_tool_list(tools: list[Tool], key: str = "tools") -> tuple[Tool, ...]:
    seen = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise RequestError(f"'{key}[{i}]': a function named {tool.name!r} is already given",
                               f"{key}[{i}]")
        seen.add(tool.name)
    return tuple(tools)


def tool_entries(value: object, key: str = "tools") -> Iterator[tuple[str, Body]]:
    """(path, entry) for each object of an API's tool list: the list and each entry being an
    object are checked here, the entry's own fields by the caller."""
    if not isinstance(value, list):
        raise RequestError(f"'{key}' must be a list of tools", key)
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise RequestError(f"'{where}' must be an object", where)
        yield where, entry


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
