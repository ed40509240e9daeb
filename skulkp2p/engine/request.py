"""Generation requests: one parser for every front end (pipe, HTTP), and the sampling settings.

No mlx here: the API and the served engine import this without the MLX engine.

Every field is checked for type and range; a bad one raises RequestError naming the field, so each
front end can turn it into its own error shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


DRAFTERS = ("lookup", "mtp", "draft")
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
class GenerationRequest:
    id: Any = None
    model: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculation: Speculation = field(default_factory=Speculation)


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


def parse_messages(value: Any, key: str = "messages") -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"'{key}' must be a non-empty list of messages", key)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RequestError(f"'{key}[{i}]' must be an object with role and content", key)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"'{key}[{i}].role' must be one of {', '.join(ROLES)}, "
                               f"got {role!r}", key)
        out.append({"role": role, "content": _content_text(m.get("content"),
                                                           f"{key}[{i}].content")})
    return out


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
                       "{\"drafter\": \"mtp\"|\"lookup\"|\"draft\", \"depth\": k}", "speculation")


COMMON_FIELDS = {"id", "model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                 "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repetition_penalty", "speculation"}


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
    return GenerationRequest(
        id=obj.get("id"), model=model, messages=messages, prompt=prompt, max_tokens=max_tokens,
        sampling=sampling, stop=parse_stop(obj.get("stop")),
        speculation=parse_speculation(obj.get("speculation")),
    )
