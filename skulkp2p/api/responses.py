"""OpenAI's Responses API: POST /v1/responses, whole and streaming.

The body maps onto the engine's one request: `input` (a string, or a list of items: messages
with input_text/output_text parts, `function_call` and `function_call_output` items) becomes
chat messages, `instructions` a system message first, `max_output_tokens` the token limit,
function `tools` and `tool_choice` the engine's tools. `previous_response_id` continues a stored
response (response_store.py: per node, bounded; 404 for one that is not there): its
conversation comes first, then this request's input.

The reply's `output` holds a `message` item (output_text) for what the model said and a
`function_call` item per call; `usage` counts input and output tokens; our `timing` and
`speculation` ride along as on the other routes. Streaming sends the typed events, each with its
`sequence_number`: response.created, response.in_progress, then per item
response.output_item.added, its content (response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done; or
response.function_call_arguments.delta..., response.function_call_arguments.done) and
response.output_item.done, then response.completed (response.incomplete at
max_output_tokens). A failure after the head ends with an `error` event and response.failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.fields import check_body
from skulkp2p.api.response_store import ResponseStore, node_store
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import (
    GenerationRequest,
    RequestError,
    Tool,
    check_tool_list,
    make_tool,
    parse_messages,
    parse_request,
    parse_tool_choice,
    tool_entries,
    with_tools,
)
from skulkp2p.engine.results import Chunk, GenerationResult
from skulkp2p.runtime.worker import Failed, Finished, Produced

# Passed to the engine's parser under the same name.
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
           "speculation")


def _string(v: Any) -> bool:
    return v is None or isinstance(v, str)


# field -> (is this value harmless?, why another value is refused)
_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be a boolean"),
    "store": (lambda v: v is None or isinstance(v, bool), "'store' must be a boolean"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "'metadata' must be an object"),
    "user": (_string, "'user' must be a string"),
    "safety_identifier": (_string, "'safety_identifier' must be a string"),
    "prompt_cache_key": (_string, "'prompt_cache_key' must be a string"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "only service_tier 'auto' or 'default' is supported"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported"),
    "text": (lambda v: v is None or v == {} or v == {"format": {"type": "text"}},
             "only text output ({\"format\": {\"type\": \"text\"}}) is supported"),
    "reasoning": (lambda v: v is None or v == {} or v == {"effort": None},
                  "reasoning options are not supported"),
    "include": (lambda v: v is None or v == [], "'include' is not supported"),
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "top_logprobs": (lambda v: v is None or (type(v) is int and v == 0),
                     "logprobs are not supported"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported"),
    "conversation": (lambda v: v is None, "conversations are not supported; use "
                                          "previous_response_id"),
    "prompt": (lambda v: v is None, "stored prompts are not supported"),
    "stream_options": (lambda v: v is None or (isinstance(v, dict) and set(v) <= {
        "include_obfuscation"}), "'stream_options' takes only include_obfuscation"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool),
                            "'parallel_tool_calls' must be a boolean"),
}

_KNOWN = {*_PASSED, *_OPTIONS, "input", "instructions", "max_output_tokens", "tools",
          "tool_choice", "previous_response_id"}

_RENAME = {"max_tokens": "max_output_tokens", "messages": "input"}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# ---- the request ----------------------------------------------------------------------------

def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise RequestError(f"'{where}[{j}]': only text parts (input_text, output_text) are "
                               f"supported, got {kind!r}", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (OpenAI chat's shape, which the engine's parser checks)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"'{where}.role' must be user, assistant, system or "
                                   f"developer, got {role!r}", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise RequestError(f"'{where}.{key}' must be a string", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"'{where}.call_id' must be a string", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item.get("output"), f"{where}.output")})
        else:
            raise RequestError(f"'{where}': input items of type {kind!r} are not supported "
                               "(message, function_call, function_call_output)", "input")
    return out


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """The Responses API's function tools: [{"type": "function", name, description,
    parameters, strict}]."""
    if value is None:
        return ()
    tools = []
    for where, t in tool_entries(value):
        if t.get("type") != "function":
            raise RequestError(f"'{where}.type': only function tools are supported, got "
                               f"{t.get('type')!r}", f"{where}.type")
        tools.append(make_tool(t.get("name"), t.get("description"), t.get("parameters"),
                               t.get("strict"), where))
    return check_tool_list(tools)


class Parsed:
    """A checked request: the engine's request, and what the response echoes and stores."""

    def __init__(self, req: GenerationRequest, body: dict[str, Any],
                 conversation: list[dict[str, Any]]):
        self.req = req
        self.body = body
        self.conversation = conversation  # what a later request continues (no instructions)
        self.stream = bool(body.get("stream"))
        self.store = body.get("store") is not False


def parse_response_request(node: ModelEndpoint, body: Any, store: ResponseStore) -> Parsed:
    body = check_body(body, _KNOWN, _OPTIONS)
    node.check_model(body.get("model"))
    if body.get("input") is None:
        raise ApiError(400, "'input' is required", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", param="instructions")
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "'previous_response_id' must be a string",
                           param="previous_response_id")
        stored = store.get(previous)
        if stored is None:
            raise ApiError(404, f"no stored response {previous!r} on this node (responses are "
                                f"kept in memory, at most {store.max_count} of them)",
                           param="previous_response_id", code="response_not_found")
        history = stored.messages
    try:
        conversation = parse_messages(history + input_messages(body["input"]), "input")
        messages = conversation
        if instructions:
            messages = [{"role": "system", "content": instructions}, *conversation]
        inner = {k: body[k] for k in _PASSED if k in body}
        inner["messages"] = messages
        if body.get("max_output_tokens") is not None:
            inner["max_tokens"] = body["max_output_tokens"]
        req = parse_request(inner)
        tools = parse_tools(body.get("tools"))
        choice = parse_tool_choice(body.get("tool_choice"))
        if tools or choice.mode != "auto" or body.get("parallel_tool_calls") is not None:
            req = with_tools(req, tools, choice, body.get("parallel_tool_calls") is not False)
    except RequestError as e:
        raise ApiError.from_request_error(e, _RENAME) from None
    return Parsed(req, body, conversation)


# ---- the response ---------------------------------------------------------------------------

def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _usage(result: GenerationResult) -> dict[str, Any]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


class _Shape:
    """One response's id and the fields it echoes from its request."""

    def __init__(self, parsed: Parsed, model: str):
        body = parsed.body
        self.parsed = parsed
        self.id = _new_id("resp_")
        self.created = int(time.time())
        req = parsed.req
        self.echo = {
            "model": model,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": list(body.get("tools") or []),
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": parsed.store,
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
            "reasoning": {"effort": None, "summary": None},
        }

    def obj(self, status: str, output: list[dict[str, Any]],
            result: GenerationResult | None = None,
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": None, **self.echo, "output": output,
            "usage": None}
        if result is not None:
            if result.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = _usage(result)
            out.update(result.extras())
        return out


def _output(result: GenerationResult) -> list[dict[str, Any]]:
    """The output items of a whole result: what the model said, then its calls."""
    items = []
    if result.text or not result.tool_calls:
        items.append(_message_item(_new_id("msg_"), result.text))
    for call in result.tool_calls:
        items.append(_call_item(_new_id("fc_"), call.id, call.name, call.arguments))
    return items


def _store(store: ResponseStore, shape: _Shape, result: GenerationResult) -> None:
    if not shape.parsed.store:
        return
    reply: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        reply["tool_calls"] = [call.to_dict() for call in result.tool_calls]
    store.put(shape.id, [*shape.parsed.conversation, reply])


async def responses(node: ModelEndpoint, http_req: HttpRequest,
                    store: ResponseStore | None = None) -> Response | StreamingResponse:
    store = store if store is not None else node_store()
    parsed = parse_response_request(node, http_req.json(), store)
    shape = _Shape(parsed, node.model_id)
    if not parsed.stream:
        _, result = await node.run_to_end(parsed.req, _RENAME)
        _store(store, shape, result)
        return Response.json(200, shape.obj("completed", _output(result), result))
    job, first = await node.open_stream(parsed.req, _RENAME)
    items = _Items(shape)

    async def events() -> AsyncIterator[bytes]:
        yield items.event("response.created", response=shape.obj("in_progress", []))
        yield items.event("response.in_progress", response=shape.obj("in_progress", []))
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, Produced):
                for out in items.chunk(event.chunk):
                    yield out
            elif isinstance(event, Finished):
                result = event.result
                if not items.done and items.open is None:
                    for out in items.open_message():  # an empty reply: one empty message
                        yield out
                for out in items.close():
                    yield out
                _store(store, shape, result)
                final = shape.obj("completed", items.done, result)
                name = ("response.incomplete" if final["status"] == "incomplete"
                        else "response.completed")
                yield items.event(name, response=final)
            elif isinstance(event, Failed):
                err = engine_error(event.error, _RENAME)
                yield items.event("error", code=err.code, message=err.message, param=err.param)
                yield items.event("response.failed", response=shape.obj(
                    "failed", items.done, error={"code": err.code, "message": err.message}))

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)


class _Items:
    """The output items of a streamed reply as the engine's chunks arrive: a message item for
    text, a function_call item per call, each finished before the next is added."""

    def __init__(self, shape: _Shape):
        self.shape = shape
        self.seq = 0
        self.done: list[dict[str, Any]] = []  # finished items, in order
        self.open: dict[str, Any] | None = None
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse.event(data, kind)

    @property
    def index(self) -> int:
        return len(self.done)

    def chunk(self, chunk: Chunk) -> list[bytes]:
        out: list[bytes] = []
        call = chunk.tool_call
        if call is not None:
            if call.id is not None:
                out += self.close()
                self.open = _call_item(_new_id("fc_"), call.id, call.name or "", "",
                                       "in_progress")
                out.append(self.event("response.output_item.added", output_index=self.index,
                                      item=dict(self.open)))
            if call.arguments and self.open is not None:
                self.open["arguments"] += call.arguments
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=self.open["id"], output_index=self.index,
                                      delta=call.arguments))
        elif chunk.text:
            if self.open is None or self.open["type"] != "message":
                out += self.close()
                out += self.open_message()
            assert self.open is not None
            self.text += chunk.text
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=self.index, content_index=0,
                                  delta=chunk.text, logprobs=[]))
        return out

    def open_message(self) -> list[bytes]:
        self.open = _message_item(_new_id("msg_"), "", "in_progress")
        self.text = ""
        return [self.event("response.output_item.added", output_index=self.index,
                           item=dict(self.open)),
                self.event("response.content_part.added", item_id=self.open["id"],
                           output_index=self.index, content_index=0, part=_text_part(""))]

    def close(self) -> list[bytes]:
        """Finish the open item (if any)."""
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=self.index, content_index=0, text=self.text,
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=self.index, content_index=0,
                                  part=_text_part(self.text)))
            item = _message_item(item["id"], self.text)
        else:
            out.append(self.event("response.function_call_arguments.done",
                                  item_id=item["id"], output_index=self.index,
                                  name=item["name"], arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=self.index,
                              item=item))
        self.done.append(item)
        return out

