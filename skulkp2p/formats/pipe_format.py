"""The JSONL pipe's request, result and error objects (docs/pipe.md); POST /v1/cluster/generate
takes and gives the same.

The pipe's request is OpenAI chat's fields (messages in its shape, tools, tool_choice,
parallel_tool_calls) plus a raw `prompt`, an `id` given back with the result, and our
`speculation`. The OpenAI routes take the same fields beside their own options
(openai_chat.py, completions.py), and so parse with `parse_request`.
"""

from __future__ import annotations

from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.results import GenerationResult, Usage
from skulkp2p.formats.body_fields import (
    check_fields,
    disk_cache,
    max_tokens,
    sampling,
    speculation,
    stop_strings,
)
from skulkp2p.formats.chat_messages import (
    parse_messages,
    parse_tool_choice,
    parse_tools,
    tool_call_json,
)
from skulkp2p.formats.response_format import parse_response_format
from skulkp2p.formats.result_extras import speculation_json, timing_json
from skulkp2p.formats.tool_specs import with_tools

COMMON_FIELDS = {"id", "model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                 "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repetition_penalty", "speculation", "tools", "tool_choice",
                 "parallel_tool_calls", "response_format", "disk_cache"}


def parse_request(obj: object, extra_fields: frozenset[str] = frozenset()) -> GenerationRequest:
    """The request an object asks for. Unknown fields are refused by name, never ignored."""
    if not isinstance(obj, dict):
        raise RequestError("a request must be a JSON object")
    check_fields(obj)
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
    limit = max_tokens(obj)
    if limit is None:
        limit = max_tokens(obj, "max_completion_tokens")
    req = GenerationRequest(
        id=obj.get("id"), model=model, messages=messages, prompt=prompt, max_tokens=limit,
        sampling=sampling(obj), stop=stop_strings(obj.get("stop")),
        speculation=speculation(obj.get("speculation")),
        response_format=parse_response_format(obj.get("response_format")),
        disk_cache=disk_cache(obj.get("disk_cache")),
    )
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools = parse_tools(obj.get("tools"))
    choice = parse_tool_choice(obj.get("tool_choice"))
    if not tools and choice.mode in ("auto", "none") and parallel is None:
        return req
    return with_tools(req, tools, choice, parallel is not False)


def request_id(obj: object) -> JSONValue:
    """The id of a request object, for its error, when it has one (even a bad request)."""
    if isinstance(obj, dict):
        value: JSONValue = obj.get("id")
        return value
    return None


def usage_json(usage: Usage) -> JSONObject:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens}


def result_json(result: GenerationResult, req_id: JSONValue, model: str) -> JSONObject:
    """The result object of one request, answered by `model`."""
    out: JSONObject = {"id": req_id, "model": model, "text": result.text,
                       "tokens": [*result.tokens],
                       "finish_reason": result.finish_reason,
                       "usage": usage_json(result.usage), "timing": timing_json(result.timing)}
    if result.tool_calls:
        out["tool_calls"] = [tool_call_json(call) for call in result.tool_calls]
    if result.speculation is not None:
        out["speculation"] = speculation_json(result.speculation)
    return out


def error_json(req_id: JSONValue, type_: str, message: str, param: str | None = None,
               code: str | None = None) -> JSONObject:
    """{"id", "error": {"type", "message", "param"}} (the id only when known), with the HTTP
    API's `code` beside them when there is one (through a cluster)."""
    err: JSONObject = {"type": type_, "message": message, "param": param}
    if code:
        err["code"] = code
    return {"id": req_id, "error": err} if req_id is not None else {"error": err}
