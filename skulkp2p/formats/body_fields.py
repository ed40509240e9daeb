"""Reading a request body: the field checks every front end shares (numbers, stop strings,
speculation, sampling), the check of a body's fields against what a route knows and honours, and
the error a front end raises for a body it refuses.

A field's error names it as the body spells it (`param`), so each API's error says which of its
own fields is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

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
