"""JSON values, typed: what a request's id, a tool's schema and the free-form parts of our
statistics hold, and what the front ends read and write (no alias of Any: a reader narrows)."""

from __future__ import annotations

from typing import TypeAlias

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"
