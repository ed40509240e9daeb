"""Reading a request body: the field checks every front end shares (numbers, stop strings,
speculation, sampling), the check of a body's fields against what a route knows and honours, the
bounds of the JSON a request holds (how deep its fields nest, and the one parser of the JSON
texts inside them), and the error a front end raises for a body it refuses.

A field's error names it as the body spells it (`param`), so each API's error says which of its
own fields is wrong.

JSON in a request, bounded: a body is parsed by orjson, which refuses one nested deeper than 1024
levels, but a value that deep would still overflow Python's recursion on its way on (the chat
template writes tool schemas and call arguments with `tojson`, an Anthropic tool_use's `input` is
written as JSON text, the Responses API echoes its `metadata` and `tools`), and a JSON text
inside a field (a call's `arguments`) was parsed by json.loads, which recursed until Python gave
up. So every field is checked without recursing (`check_fields`: each front end's body, the
pipe's line), every JSON text goes through `parse_json_text`, and a field too deep or too long
is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import orjson

from skulkp2p.engine.json_types import JSONValue
from skulkp2p.engine.request import (
    DRAFTERS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_SPECULATION_DEPTH,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    RequestError,
    SamplingParams,
    Speculation,
)

Body = Mapping[str, JSONValue]  # a JSON object, as read (never written to)

# field -> (is this value harmless?, why another value is refused)
Options = Mapping[str, tuple[Callable[[object], bool], str]]


class FormatError(RequestError):
    """A body an API refuses as a whole or by one of its own fields, with the HTTP status and
    error code the API answers it with (a RequestError's code is "invalid_value")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400):
        super().__init__(message, param, status=status)
        self.code = code


# The most levels of objects and arrays a request's field may nest (a tool's JSON Schema, 32
# schemas deep as tool_specs.check_schema allows, nests 69 levels from the body's `tools`).
MAX_JSON_DEPTH = 100

# The longest JSON text parsed from inside a field, in characters: more than a call's arguments
# in any context these models read.
MAX_JSON_TEXT = 1 << 20


def _depth_exceeded(value: JSONValue, limit: int) -> bool:
    """Whether `value` nests more than `limit` levels, level by level (no recursion)."""
    level: list[JSONValue] = [value] if isinstance(value, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[JSONValue] = []
        for v in level:
            items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
            below += [c for c in items if isinstance(c, dict | list)]
        level = below
    return False


def _deep_path(value: JSONValue, limit: int) -> str:
    """Where `value` (which nests past `limit` levels) goes too deep: its first few steps, as
    a path (`.a[0].b...`)."""
    path: list[str] = []
    node = value
    for _ in range(6):
        limit -= 1  # (a child of `node` nests past this many)
        if isinstance(node, dict):
            key, node = next((k, v) for k, v in node.items() if _depth_exceeded(v, limit))
            path.append(f".{key}")
        elif isinstance(node, list):
            i, node = next((i, v) for i, v in enumerate(node) if _depth_exceeded(v, limit))
            path.append(f"[{i}]")
    return "".join(path) + "..."


def check_depth(value: JSONValue, where: str, param: str) -> None:
    """FormatError (400, `param`) when `value`, the field `where`, nests more than
    MAX_JSON_DEPTH levels."""
    if _depth_exceeded(value, MAX_JSON_DEPTH):
        at = where + _deep_path(value, MAX_JSON_DEPTH)
        raise FormatError(f"'{at}' nests deeper than {MAX_JSON_DEPTH} levels of objects and "
                          "arrays", param, "invalid_value")


def check_fields(body: Body) -> None:
    """Every field of a body nests at most MAX_JSON_DEPTH levels; a 400 names the first that
    does not."""
    for key, value in body.items():
        check_depth(value, key, key)


def parse_json_text(text: str, where: str, param: str) -> JSONValue:
    """The value of the JSON text `text`, the field `where`: FormatError (400, `param`) when it
    is longer than MAX_JSON_TEXT characters, is not JSON, or nests more than MAX_JSON_DEPTH
    levels. (orjson parses without recursing in Python and refuses past 1024 levels itself.)"""
    if len(text) > MAX_JSON_TEXT:
        raise FormatError(f"'{where}' is {len(text)} characters of JSON; at most "
                          f"{MAX_JSON_TEXT} are read", param, "invalid_value")
    try:
        value: JSONValue = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e) or "recursion" in str(e).lower():
            raise FormatError(f"'{where}' nests deeper than {MAX_JSON_DEPTH} levels of "
                              "objects and arrays", param, "invalid_value") from None
        raise FormatError(f"'{where}' is not valid JSON: {e}", param, "invalid_value") from None
    check_depth(value, where, param)
    return value


def check_options(body: Body, options: Options) -> None:
    """Every option at a value we honour; else a 400 naming it."""
    for key, (ok, why) in options.items():
        if key in body and not ok(body[key]):
            raise FormatError(f"unsupported value for '{key}': {why}", key,
                              "unsupported_parameter")


def check_body(body: object, known: Collection[str], options: Options) -> Body:
    """A route's body: an object, no field the route does not know, every option honoured."""
    if not isinstance(body, dict):
        raise FormatError("the request body must be a JSON object")
    check_fields(body)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise FormatError(f"unsupported field(s): {', '.join(unknown)}", unknown[0],
                          "unsupported_parameter")
    check_options(body, options)
    return body


def number(obj: Body, key: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RequestError(f"'{key}' must be a number, got {type(v).__name__}", key)
    if v != v:  # NaN
        raise RequestError(f"'{key}' must be a number, got NaN", key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise RequestError(f"'{key}' must be <= {hi}, got {v}", key)
    return float(v)


def integer(obj: Body, key: str, lo: int | None = None, hi: int | None = None,
            name: str | None = None) -> int | None:
    """obj[key], an integer in [lo, hi]; errors call it `name` (default: key)."""
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    name = name or key
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if lo is not None and v < lo:
        raise RequestError(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise RequestError(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def max_tokens(obj: Body, key: str = "max_tokens", name: str | None = None) -> int | None:
    return integer(obj, key, lo=1, name=name)


def sampling(obj: Body) -> SamplingParams:
    """temperature, top_p, top_k, min_p, repetition_penalty and seed, checked in that order."""
    temperature = number(obj, "temperature", lo=0.0, hi=MAX_TEMPERATURE)
    top_p = number(obj, "top_p", lo=0.0, hi=1.0, lo_open=True)
    top_k = integer(obj, "top_k", lo=0)
    min_p = number(obj, "min_p", lo=0.0, hi=1.0)
    rep = number(obj, "repetition_penalty", lo=0.0, hi=MAX_REPETITION_PENALTY, lo_open=True)
    seed = integer(obj, "seed", lo=0, hi=MAX_SEED)
    return SamplingParams(
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        min_p=min_p or 0.0,
        repetition_penalty=rep,
        seed=seed,
    )


def stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(str(s) for s in strings)


def speculation(value: object) -> Speculation:
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
        if not isinstance(drafter, str) or drafter not in DRAFTERS:
            raise RequestError(f"'speculation.drafter' must be one of {', '.join(DRAFTERS)}, "
                               f"got {drafter!r}", "speculation")
        depth = integer(value, "depth", lo=1, hi=MAX_SPECULATION_DEPTH) if "depth" in value \
            else None
        return Speculation("explicit", drafter, depth)
    raise RequestError("'speculation' must be \"auto\", \"off\" or "
                       "{\"drafter\": \"mtp\"|\"lookup\"|\"draft\"|\"assistant\", \"depth\": k}",
                       "speculation")


def disk_cache(value: object) -> bool:
    """`disk_cache`: false keeps everything of the request off the node's disk (its prefix
    cache entries stay in memory); true or absent lets them be written."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RequestError("'disk_cache' must be a boolean", "disk_cache")
    return value
