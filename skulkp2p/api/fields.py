"""The first check of a route's JSON body, shared by the routes that refuse what they do not
know: an object, no unknown field, and every option at a value we honour (else 400 naming it)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from skulkp2p.api.errors import ApiError

# field -> (is this value harmless?, why another value is refused)
Options = Mapping[str, tuple[Callable[[Any], bool], str]]


def check_body(body: Any, known: Collection[str], options: Options) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0],
                       code="unsupported_parameter")
    for key, (ok, why) in options.items():
        if key in body and not ok(body[key]):
            raise ApiError(400, f"unsupported value for '{key}': {why}", param=key,
                           code="unsupported_parameter")
    return body
