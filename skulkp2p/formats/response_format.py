"""Structured outputs as the front ends spell them, read into the engine's `ResponseFormat`.

Anthropic Messages: `output_config.format` {"type": "json_schema", "schema"} (or the
structured-outputs beta's top-level `output_format`). OpenAI chat and the pipe: `response_format` {"type": "text" | "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict", "description"}}. The Responses API:
`text.format`, the same types with the json_schema's fields beside "type". A schema is checked
for shape first (tool_specs.check_schema: a 400 naming the exact field), then compiled by
llguidance (engine/decode/grammar.py: a keyword it does not implement, or a value it refuses,
is a 400 naming the keyword's path), so a bad schema is refused before anything runs.
"""

from __future__ import annotations

from skulkp2p.engine.decode.grammar import compile_format
from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.request import TOOL_NAME, RequestError, ResponseFormat
from skulkp2p.formats.tool_specs import check_schema

SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def parse_response_format(value: object, where: str = "response_format") -> ResponseFormat:
    """Chat's and the pipe's `response_format` (None: free text)."""
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict):
        raise RequestError(f"'{where}' must be an object", where)
    kind = value.get("type")
    if kind in ("text", "json_object"):
        if set(value) - {"type"}:
            extra = sorted(set(value) - {"type"})[0]
            raise RequestError(f"'{where}' of type {kind} takes no '{extra}'", f"{where}.{extra}")
        return _checked(ResponseFormat(type=str(kind)), where)
    if kind != "json_schema":
        raise RequestError(f"'{where}.type' must be one of text, json_object, json_schema",
                           f"{where}.type")
    if set(value) - {"type", "json_schema"}:
        extra = sorted(set(value) - {"type", "json_schema"})[0]
        raise RequestError(f"unsupported field '{where}.{extra}'", f"{where}.{extra}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(f"'{where}.json_schema' is required: an object with 'name' and "
                           "'schema'", f"{where}.json_schema")
    return _schema_format(spec, f"{where}.json_schema")


def parse_text_format(value: object, where: str = "text") -> ResponseFormat:
    """The Responses API's `text` ({"format": {...}}; None or {}: free text)."""
    if value is None or value == {}:
        return ResponseFormat()
    if not isinstance(value, dict):
        raise RequestError(f"'{where}' must be an object", where)
    if set(value) - {"format", "verbosity"}:
        extra = sorted(set(value) - {"format", "verbosity"})[0]
        raise RequestError(f"unsupported field '{where}.{extra}'", f"{where}.{extra}")
    if value.get("verbosity") not in (None, "medium"):
        raise RequestError(f"'{where}.verbosity' is not supported", f"{where}.verbosity")
    fmt = value.get("format")
    if fmt is None:
        return ResponseFormat()
    where = f"{where}.format"
    if not isinstance(fmt, dict):
        raise RequestError(f"'{where}' must be an object", where)
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return _checked(ResponseFormat(type=str(kind)), where)
    if kind != "json_schema":
        raise RequestError(f"'{where}.type' must be one of text, json_object, json_schema",
                           f"{where}.type")
    return _schema_format({k: v for k, v in fmt.items() if k != "type"}, where)


def parse_output_config(config: object, legacy: object = None) -> ResponseFormat:
    """Anthropic's structured outputs: `output_config` {"format": {"type": "json_schema",
    "schema": {...}}} as the `anthropic` SDK sends it (its `output_format=` type, and the
    structured-outputs beta, both arrive here), or the beta's earlier top-level
    `output_format` (the same object)."""
    fmt: object = None
    where = "output_format"
    if config is not None:
        if not isinstance(config, dict):
            raise RequestError("'output_config' must be an object", "output_config")
        unknown = sorted(set(config) - {"format", "effort"})
        if unknown:
            raise RequestError(f"unsupported field 'output_config.{unknown[0]}'",
                               f"output_config.{unknown[0]}")
        if config.get("effort") is not None:
            raise RequestError("'output_config.effort' is not supported", "output_config.effort")
        if config.get("format") is not None and legacy is not None:
            raise RequestError("give 'output_config.format' or 'output_format', not both",
                               "output_format")
        fmt, where = config.get("format"), "output_config.format"
    if fmt is None:
        fmt = legacy
    if fmt is None:
        return ResponseFormat()
    if not isinstance(fmt, dict):
        raise RequestError(f"'{where}' must be an object", where)
    if fmt.get("type") != "json_schema":
        raise RequestError(f"'{where}.type' must be \"json_schema\"", f"{where}.type")
    unknown = sorted(set(fmt) - {"type", "schema"})
    if unknown:
        raise RequestError(f"unsupported field '{where}.{unknown[0]}'", f"{where}.{unknown[0]}")
    if "schema" not in fmt:
        raise RequestError(f"'{where}.schema' is required", f"{where}.schema")
    schema = fmt["schema"]
    check_schema(schema, f"{where}.schema")
    if not isinstance(schema, dict):
        schema = {} if schema is True else {"not": {}}
    return _checked(ResponseFormat(type="json_schema", schema=schema, name="output"),
                    f"{where}.schema")


def _schema_format(spec: dict[str, JSONValue], where: str) -> ResponseFormat:
    unknown = set(spec) - SCHEMA_FIELDS
    if unknown:
        extra = sorted(unknown)[0]
        raise RequestError(f"unsupported field '{where}.{extra}'", f"{where}.{extra}")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise RequestError(f"'{where}.name' is required: 1-64 letters, digits, '_' or '-'",
                           f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"'{where}.description' must be a string", f"{where}.description")
    schema = spec.get("schema", {})
    check_schema(schema, f"{where}.schema")
    if not isinstance(schema, dict):  # (a boolean schema: true is any JSON, false nothing)
        schema = {} if schema is True else {"not": {}}
    return _checked(ResponseFormat(type="json_schema", schema=schema, name=name, strict=strict),
                    f"{where}.schema")


def _checked(fmt: ResponseFormat, where: str) -> ResponseFormat:
    if fmt.constrained:
        compile_format(fmt, where)
    return fmt


def format_json(fmt: ResponseFormat) -> JSONObject:
    """The Responses API's echo of `text.format`."""
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    out: JSONObject = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema,
                       "strict": fmt.strict}
    return out
