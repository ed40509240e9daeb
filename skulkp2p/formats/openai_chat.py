"""OpenAI chat (POST /v1/chat/completions): the body read into the engine's request, and the
result written as a chat.completion or streamed as chat.completion.chunk objects.

The body takes the pipe's fields (pipe_format.py: messages, sampling, stop, speculation, tools,
tool_choice, parallel_tool_calls) and OpenAI's own options. An option we cannot honour (n > 1,
logprobs, penalties other than repetition_penalty, the deprecated
`functions`) is refused naming it, never silently dropped; options that change nothing for us at
their harmless values (n=1, user, ...) pass.

Tool calls come from the engine typed (`GenerationResult.tool_calls`, `Chunk.tool_call`): here
they are only shaped, as `message.tool_calls` with finish_reason "tool_calls", or streamed as
`delta.tool_calls` (index, id, type and name with empty arguments first, then fragments of the
arguments), as OpenAI streams them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import GenerationRequest
from skulkp2p.engine.results import Chunk, GenerationResult, ToolCallDelta, Usage
from skulkp2p.formats.body_fields import Body, FormatError, Options, check_options
from skulkp2p.formats.chat_messages import tool_call_json
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.result_extras import extras

# Checks the model a body names (the API's: it raises what the API answers with).
CheckModel = Callable[[object], None]


def _none(v: object) -> bool:
    return v is None


def _zero(v: object) -> bool:
    return v is None or (not isinstance(v, bool) and isinstance(v, int | float) and v == 0)


def _string(v: object) -> bool:
    return v is None or isinstance(v, str)


COMMON_OPTIONS: Options = {
    "n": (lambda v: v is None or (type(v) is int and v == 1),
          "only n=1 is supported (one choice per request)"),
    "presence_penalty": (_zero, "presence_penalty is not supported; use repetition_penalty"),
    "frequency_penalty": (_zero, "frequency_penalty is not supported; use repetition_penalty"),
    "logit_bias": (lambda v: v is None or v == {}, "logit_bias is not supported"),
    "user": (_string, "'user' must be a string"),
    "safety_identifier": (_string, "'safety_identifier' must be a string"),
    "prompt_cache_key": (_string, "'prompt_cache_key' must be a string"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "'metadata' must be an object"),
    "store": (lambda v: v in (None, False), "storing completions is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "only service_tier 'auto' or 'default' is supported"),
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be a boolean"),
}

CHAT_OPTIONS: Options = {
    **COMMON_OPTIONS,
    "functions": (lambda v: v is None or v == [],
                  "the deprecated 'functions' are not supported; send 'tools'"),
    "function_call": (lambda v: v in (None, "none", "auto"),
                      "the deprecated 'function_call' is not supported; send 'tool_choice'"),
    "logprobs": (lambda v: v in (None, False), "logprobs are not supported yet"),
    "top_logprobs": (lambda v: v is None or (type(v) is int and v == 0),
                     "logprobs are not supported yet"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "reasoning_effort": (_none, "reasoning_effort is not supported"),
    "verbosity": (_none, "verbosity is not supported"),
    "audio": (_none, "audio output is not supported"),
    "prediction": (_none, "predicted outputs are not supported"),
    "web_search_options": (_none, "web search is not supported"),
}


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked body of either OpenAI route: the engine's request and how to answer it."""
    req: GenerationRequest
    stream: bool
    include_usage: bool  # a streamed answer ends with a chunk of usage (stream_options)


def _stream_flags(body: Body) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise FormatError("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise FormatError("'stream_options' takes only include_usage (a boolean)",
                          "stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise FormatError("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, include


def openai_fields(body: object, options: Options, check_model: CheckModel
                  ) -> tuple[Body, bool, bool]:
    """What both routes check before the request's own fields: an object, the options, the
    stream flags, then the model it names. (body, stream, include_usage)."""
    if not isinstance(body, dict):
        raise FormatError("the request body must be a JSON object")
    check_options(body, options)
    stream, include_usage = _stream_flags(body)
    check_model(body.get("model"))
    return body, stream, include_usage


def chat_request(body: object, check_model: CheckModel) -> OpenAIRequest:
    if isinstance(body, dict):
        if body.get("prompt") is not None:
            raise FormatError("chat completions take 'messages'; send 'prompt' to "
                              "/v1/completions", "prompt")
        if body.get("messages") is None:
            raise FormatError("'messages' is required", "messages")
    fields, stream, include_usage = openai_fields(body, CHAT_OPTIONS, check_model)
    req = parse_request(fields, frozenset(CHAT_OPTIONS) | {"stream_options"})
    return OpenAIRequest(req, stream, include_usage)


def usage_json(usage: Usage) -> JSONObject:
    """OpenAI's usage: cached prompt tokens under prompt_tokens_details."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class OpenAIShape:
    """One answer of an OpenAI route: its id and time, and its objects whole or streamed (each
    chunk with "usage": null when the request asked for a last chunk of usage)."""

    prefix = "chatcmpl-"
    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool = False):
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _base(self, obj: str) -> JSONObject:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, result: GenerationResult) -> JSONObject:
        message: JSONObject = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message["content"] = result.text or None  # as OpenAI: null beside calls
            message["tool_calls"] = [tool_call_json(call) for call in result.tool_calls]
        return {"index": 0, "message": message, "logprobs": None,
                "finish_reason": result.finish_reason}

    def whole(self, result: GenerationResult) -> JSONObject:
        return {**self._base(self.whole_object), "choices": [self._choice(result)],
                "usage": usage_json(result.usage), **extras(result)}

    def _text_chunk(self, text: str | None, finish: str | None = None, role: bool = False
                    ) -> JSONObject:
        delta: JSONObject = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: JSONObject = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}
        return {**self._base(self.chunk_object), "choices": [choice]}

    def _tool_chunk(self, delta: ToolCallDelta) -> JSONObject:
        """One piece of a streamed call: its index, id, type and name with empty arguments
        first, then `{"index", "function": {"arguments": fragment}}`."""
        call: JSONObject = {"index": delta.index}
        if delta.id is not None:
            call.update(id=delta.id, type="function",
                        function={"name": delta.name, "arguments": delta.arguments})
        else:
            call["function"] = {"arguments": delta.arguments}
        choice: JSONObject = {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None,
                              "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def _with_usage(self, obj: JSONObject) -> JSONObject:
        return {**obj, "usage": None} if self.include_usage else obj

    def started(self) -> list[JSONObject]:
        """The chunks sent when the generation starts: the assistant's role."""
        return [self._with_usage(self._text_chunk("", role=True))]

    def produced(self, chunk: Chunk) -> list[JSONObject]:
        if chunk.tool_call is not None:
            return [self._with_usage(self._tool_chunk(chunk.tool_call))]
        if chunk.text:
            return [self._with_usage(self._text_chunk(chunk.text))]
        return []

    def _final_text(self) -> str | None:
        return None

    def finished(self, result: GenerationResult) -> list[JSONObject]:
        """The last chunk (finish reason, our timing and speculation), then the usage chunk
        when asked for."""
        final = self._text_chunk(self._final_text(), result.finish_reason)
        out = [self._with_usage({**final, **extras(result)})]
        if self.include_usage:
            out.append({**self._base(self.chunk_object), "choices": [],
                        "usage": usage_json(result.usage)})
        return out
