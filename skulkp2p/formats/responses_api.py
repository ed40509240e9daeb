"""OpenAI's Responses API (POST /v1/responses): the body read into the engine's request, the
result written as a response object or streamed as its typed events.

`input` (a string, or a list of items: messages with input_text/output_text parts,
`function_call` and `function_call_output` items) becomes the chat, after the conversation of the
response `previous_response_id` names (the API keeps those); `instructions` a system message
first (not carried over to a later response); `max_output_tokens` the token limit; function
`tools` and `tool_choice` the request's tools.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.request import GenerationRequest, Message, RequestError, Tool
from skulkp2p.engine.results import Chunk, GenerationResult, ToolCall
from skulkp2p.formats.body_fields import (
    Body,
    FormatError,
    Options,
    check_body,
    disk_cache,
    max_tokens,
    sampling,
    speculation,
)
from skulkp2p.formats.chat_messages import check_chat, parse_tool_choice
from skulkp2p.formats.openai_chat import CheckModel
from skulkp2p.formats.response_format import format_json, parse_text_format
from skulkp2p.formats.result_extras import extras
from skulkp2p.formats.tool_specs import check_tool_list, make_tool, tool_entries, with_tools

# Read as the pipe's fields of the same name.
PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
          "speculation", "disk_cache")


def _string(v: object) -> bool:
    return v is None or isinstance(v, str)


OPTIONS: Options = {
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be a boolean"),
    "store": (lambda v: v is None or isinstance(v, bool), "'store' must be a boolean"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "'metadata' must be an object"),
    "user": (_string, "'user' must be a string"),
    "safety_identifier": (_string, "'safety_identifier' must be a string"),
    "prompt_cache_key": (_string, "'prompt_cache_key' must be a string"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "only service_tier 'auto' or 'default' is supported"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported"),
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

KNOWN = {*PASSED, *OPTIONS, "input", "instructions", "max_output_tokens", "tools",
         "tool_choice", "previous_response_id", "text"}

# The request's fields as the Responses API names them, for the errors raised under the pipe's
# names (a token limit's) and the engine's (a prompt too long names "messages").
RENAME = {"max_tokens": "max_output_tokens", "messages": "input"}

# The conversation of a stored response by its id (raises what the API answers for an unknown
# one).
StoredConversation = Callable[[str], Sequence[Message]]


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# ---- the request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked request: the engine's request, and what the response echoes and stores."""
    req: GenerationRequest
    body: Body
    conversation: tuple[Message, ...]  # what a later request continues (no instructions)
    stream: bool
    store: bool


def _parts_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(text, str):
            raise RequestError(f"'{where}[{j}]': only text parts (input_text, output_text) are "
                               f"supported, got {kind!r}", "input")
        texts.append(text)
    return "".join(texts)


def input_messages(value: object) -> list[Message]:
    """`input` as chat messages: a function_call item joins the assistant turn before it (or
    makes one), a function_call_output item is a tool result."""
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty list of items", "input")
    out: list[Message] = []
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
            out.append(Message("system" if role == "developer" else str(role),
                               _parts_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            fields = [item.get(key) for key in ("call_id", "name", "arguments")]
            for key, got in zip(("call_id", "name", "arguments"), fields, strict=True):
                if not isinstance(got, str):
                    raise RequestError(f"'{where}.{key}' must be a string", "input")
            call = ToolCall(*(str(got) for got in fields))
            if out and out[-1].role == "assistant":  # the same assistant turn
                out[-1] = replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            answers = item.get("call_id")
            if not isinstance(answers, str):
                raise RequestError(f"'{where}.call_id' must be a string", "input")
            out.append(Message("tool", _parts_text(item.get("output"), f"{where}.output"),
                               tool_call_id=answers))
        else:
            raise RequestError(f"'{where}': input items of type {kind!r} are not supported "
                               "(message, function_call, function_call_output)", "input")
    return out


def parse_tools(value: object) -> tuple[Tool, ...]:
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


def response_request(body: object, check_model: CheckModel, stored: StoredConversation
                     ) -> ResponsesRequest:
    """The request a Responses body asks for. FormatError for what the API's shape refuses,
    RequestError (its param in RENAME's names) for a field's value."""
    fields = check_body(body, KNOWN, OPTIONS)
    model = fields.get("model")
    check_model(model)
    if fields.get("input") is None:
        raise FormatError("'input' is required", "input")
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise FormatError("'instructions' must be a string", "instructions")
    history: Sequence[Message] = ()
    previous = fields.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise FormatError("'previous_response_id' must be a string", "previous_response_id")
        history = stored(previous)
    conversation = check_chat([*history, *input_messages(fields["input"])], "input")
    messages = conversation
    if instructions:
        messages = (Message("system", instructions), *conversation)
    req = GenerationRequest(
        model=model if isinstance(model, str) else None, messages=messages,
        max_tokens=max_tokens(fields, "max_output_tokens", name="max_tokens"),
        sampling=sampling(fields), speculation=speculation(fields.get("speculation")),
        response_format=parse_text_format(fields.get("text")),
        disk_cache=disk_cache(fields.get("disk_cache")))
    tools = parse_tools(fields.get("tools"))
    choice = parse_tool_choice(fields.get("tool_choice"))
    parallel = fields.get("parallel_tool_calls")
    if tools or choice.mode != "auto" or parallel is not None:
        req = with_tools(req, tools, choice, parallel is not False)
    return ResponsesRequest(req, fields, conversation, bool(fields.get("stream")),
                            fields.get("store") is not False)


def stored_conversation(parsed: ResponsesRequest, result: GenerationResult
                        ) -> tuple[Message, ...]:
    """What a later request continues: this request's conversation and the reply."""
    return (*parsed.conversation, Message("assistant", result.text, result.tool_calls))


# ---- the response ----------------------------------------------------------------------------


def _message_item(item_id: str, text: str, status: str = "completed") -> JSONObject:
    content: list[JSONValue] = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> JSONObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> JSONObject:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _usage(result: GenerationResult) -> JSONObject:
    u = result.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def output_items(result: GenerationResult) -> list[JSONValue]:
    """The output items of a whole result: what the model said, then its calls."""
    items: list[JSONValue] = []
    if result.text or not result.tool_calls:
        items.append(_message_item(_new_id("msg_"), result.text))
    for call in result.tool_calls:
        items.append(_call_item(_new_id("fc_"), call.id, call.name, call.arguments))
    return items


class ResponseShape:
    """One response's id and the fields it echoes from its request."""

    def __init__(self, parsed: ResponsesRequest, model: str):
        body = parsed.body
        self.id = _new_id("resp_")
        self.created = int(time.time())
        req = parsed.req
        tools = body.get("tools")
        self.echo: JSONObject = {
            "model": model,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": list(tools) if isinstance(tools, list) else [],
            "text": {"format": format_json(req.response_format)},
            "truncation": "disabled",
            "store": parsed.store,
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
            "reasoning": {"effort": None, "summary": None},
        }

    def obj(self, status: str, output: list[JSONValue], result: GenerationResult | None = None,
            error: JSONObject | None = None) -> JSONObject:
        out: JSONObject = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": None, **self.echo, "output": output,
            "usage": None}
        if result is not None:
            if result.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = _usage(result)
            out.update(extras(result))
        return out

    def whole(self, result: GenerationResult) -> JSONObject:
        return self.obj("completed", output_items(result), result)


class ResponseStream:
    """The events of a streamed reply as the engine's chunks arrive: a message item for text,
    a function_call item per call, each finished before the next is added."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.done: list[JSONValue] = []  # finished items, in order
        self.open: JSONObject | None = None
        self.text = ""

    def _event(self, kind: str, **fields: JSONValue) -> tuple[str, JSONObject]:
        data: JSONObject = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, data

    @property
    def _index(self) -> int:
        return len(self.done)

    def started(self) -> list[tuple[str, JSONObject]]:
        return [self._event("response.created", response=self.shape.obj("in_progress", [])),
                self._event("response.in_progress", response=self.shape.obj("in_progress", []))]

    def produced(self, chunk: Chunk) -> list[tuple[str, JSONObject]]:
        out: list[tuple[str, JSONObject]] = []
        call = chunk.tool_call
        if call is not None:
            if call.id is not None:
                out += self._close()
                self.open = _call_item(_new_id("fc_"), call.id, call.name or "", "",
                                       "in_progress")
                out.append(self._event("response.output_item.added", output_index=self._index,
                                       item=dict(self.open)))
            if call.arguments and self.open is not None:
                self.open["arguments"] = f"{self.open['arguments']}{call.arguments}"
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.open["id"], output_index=self._index,
                                       delta=call.arguments))
        elif chunk.text:
            if self.open is None or self.open["type"] != "message":
                out += self._close()
                out += self._open_message()
            assert self.open is not None
            self.text += chunk.text
            out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                   output_index=self._index, content_index=0,
                                   delta=chunk.text, logprobs=[]))
        return out

    def _open_message(self) -> list[tuple[str, JSONObject]]:
        self.open = _message_item(_new_id("msg_"), "", "in_progress")
        self.text = ""
        return [self._event("response.output_item.added", output_index=self._index,
                            item=dict(self.open)),
                self._event("response.content_part.added", item_id=self.open["id"],
                            output_index=self._index, content_index=0, part=_text_part(""))]

    def _close(self) -> list[tuple[str, JSONObject]]:
        """Finish the open item (if any)."""
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=self._index, content_index=0, text=self.text,
                                   logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=self._index, content_index=0,
                                   part=_text_part(self.text)))
            item = _message_item(str(item["id"]), self.text)
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=self._index,
                                   name=item["name"], arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        out.append(self._event("response.output_item.done", output_index=self._index,
                               item=item))
        self.done.append(item)
        return out

    def finished(self, result: GenerationResult) -> list[tuple[str, JSONObject]]:
        """Close the last item (an empty reply gets one empty message), then
        response.completed, or response.incomplete where max_output_tokens cut it."""
        out = []
        if not self.done and self.open is None:
            out += self._open_message()
        out += self._close()
        final = self.shape.obj("completed", self.done, result)
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(name, response=final))
        return out

    def failed(self, code: str | None, message: str, param: str | None
               ) -> list[tuple[str, JSONObject]]:
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.shape.obj(
                    "failed", self.done, error={"code": code, "message": message}))]
