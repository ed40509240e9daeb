"""OpenAI-compatible routes: POST /v1/chat/completions and POST /v1/completions.

Bodies are checked by the engine's own request parser (tools, tool_choice and
parallel_tool_calls included); the OpenAI-only fields are checked here first. An option we
cannot honour (n > 1, logprobs, a JSON response format, penalties other than
repetition_penalty, the deprecated `functions`) is refused with a 400 naming it, never silently
dropped; options that change nothing for us at their harmless values (n=1, user, ...) pass.

Tool calls come from the engine typed (`GenerationResult.tool_calls`, `Chunk.tool_call`): here
they are only shaped, as `message.tool_calls` with finish_reason "tool_calls", or streamed as
`delta.tool_calls` (index, id, type and name with empty arguments first, then fragments of the
arguments), as OpenAI streams them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from skulkp2p.api import sse
from skulkp2p.api.endpoint import KeepAlive, ModelEndpoint
from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse
from skulkp2p.engine.request import GenerationRequest, RequestError, parse_request
from skulkp2p.engine.results import GenerationResult, ToolCallDelta
from skulkp2p.runtime.worker import Failed, Finished, Produced, Started


def _none(v: Any) -> bool:
    return v is None


def _zero(v: Any) -> bool:
    return v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == 0)


def _string(v: Any) -> bool:
    return v is None or isinstance(v, str)


# field -> (is this value harmless?, why another value is refused)
_COMMON_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
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

_CHAT_OPTIONS = {
    **_COMMON_OPTIONS,
    "functions": (lambda v: v is None or v == [],
                  "the deprecated 'functions' are not supported; send 'tools'"),
    "function_call": (lambda v: v in (None, "none", "auto"),
                      "the deprecated 'function_call' is not supported; send 'tool_choice'"),
    "logprobs": (lambda v: v in (None, False), "logprobs are not supported yet"),
    "top_logprobs": (lambda v: v is None or (type(v) is int and v == 0),
                     "logprobs are not supported yet"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "only response_format {\"type\": \"text\"} is supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "reasoning_effort": (_none, "reasoning_effort is not supported"),
    "verbosity": (_none, "verbosity is not supported"),
    "audio": (_none, "audio output is not supported"),
    "prediction": (_none, "predicted outputs are not supported"),
    "web_search_options": (_none, "web search is not supported"),
}

_COMPLETION_OPTIONS = {
    **_COMMON_OPTIONS,
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "only best_of=1 is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "logprobs": (_none, "logprobs are not supported yet"),
}


# Handled by the engine's parser (chat only), beside the options above.
_CHAT_TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def _check_options(body: dict[str, Any], options: dict[str, tuple[Callable[[Any], bool], str]]
                   ) -> None:
    for key, (ok, why) in options.items():
        if key in body and not ok(body[key]):
            raise ApiError(400, f"unsupported value for '{key}': {why}", param=key,
                           code="unsupported_parameter")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                       param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise ApiError(400, "'stream_options' takes only include_usage (a boolean)",
                       param="stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean",
                       param="stream_options")
    return stream, include


def _parse(node: ModelEndpoint, body: Any, options: dict[str, tuple[Callable[[Any], bool], str]]
           ) -> tuple[GenerationRequest, bool, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_options(body, options)
    stream, include_usage = _stream_flags(body)
    node.check_model(body.get("model"))
    if options is not _CHAT_OPTIONS:
        tools = sorted(_CHAT_TOOL_FIELDS & set(body))
        if tools:  # the engine's parser takes them: refuse them here by name
            raise ApiError(400, f"'{tools[0]}' is only for /v1/chat/completions",
                           param=tools[0], code="unsupported_parameter")
    try:
        req = parse_request(body, frozenset(options) | {"stream_options"})
    except RequestError as e:
        raise ApiError.from_request_error(e) from None
    return req, stream, include_usage


def parse_chat(node: ModelEndpoint, body: Any) -> tuple[GenerationRequest, bool, bool]:
    if isinstance(body, dict):
        if body.get("prompt") is not None:
            raise ApiError(400, "chat completions take 'messages'; send 'prompt' to "
                                "/v1/completions", param="prompt")
        if body.get("messages") is None:
            raise ApiError(400, "'messages' is required", param="messages")
    return _parse(node, body, _CHAT_OPTIONS)


def parse_completion(node: ModelEndpoint, body: Any) -> tuple[GenerationRequest, bool, bool]:
    if isinstance(body, dict):
        if body.get("messages") is not None:
            raise ApiError(400, "completions take 'prompt'; send 'messages' to "
                                "/v1/chat/completions", param="messages")
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ApiError(400, "'prompt' must be one string (batches and token-id prompts "
                                    "are not supported)", param="prompt")
            body = {**body, "prompt": prompt[0]}
        elif body.get("prompt") is None:
            raise ApiError(400, "'prompt' is required", param="prompt")
    return _parse(node, body, _COMPLETION_OPTIONS)


class _Shape:
    """What differs between the two OpenAI routes: ids, object names and where text goes."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            if result.tool_calls:
                message["content"] = result.text or None  # as OpenAI: null beside calls
                message["tool_calls"] = [call.to_dict() for call in result.tool_calls]
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": result.finish_reason}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None,
                      "finish_reason": result.finish_reason}
            out = self._base("text_completion")
        return {**out, "choices": [choice], "usage": result.usage.openai_dict(), **result.extras()}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False
              ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def tool_chunk(self, delta: ToolCallDelta) -> dict[str, Any]:
        """One piece of a streamed call: its index, id, type and name with empty arguments
        first, then `{"index", "function": {"arguments": fragment}}`."""
        call: dict[str, Any] = {"index": delta.index}
        if delta.id is not None:
            call.update(id=delta.id, type="function",
                        function={"name": delta.name, "arguments": delta.arguments})
        else:
            call["function"] = {"arguments": delta.arguments}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None,
                  "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage}


async def _handle(node: ModelEndpoint, http_req: HttpRequest, chat: bool) -> Response | StreamingResponse:
    body = http_req.json()
    req, stream, include_usage = (parse_chat if chat else parse_completion)(node, body)
    shape = _Shape(chat, node.model_id)
    if not stream:
        _, result = await node.run_to_end(req)
        return Response.json(200, shape.whole(result))
    job, first = await node.open_stream(req)

    def with_usage(obj: dict[str, Any]) -> dict[str, Any]:
        # With include_usage every chunk carries "usage": null and one last chunk the totals.
        return {**obj, "usage": None} if include_usage else obj

    async def events() -> AsyncIterator[bytes]:
        async for event in node.events(job, first):
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, Started):
                if chat:
                    yield sse.event(with_usage(shape.chunk("", role=True)))
            elif isinstance(event, Produced):
                if event.chunk.tool_call is not None:
                    yield sse.event(with_usage(shape.tool_chunk(event.chunk.tool_call)))
                elif event.chunk.text:
                    yield sse.event(with_usage(shape.chunk(event.chunk.text)))
            elif isinstance(event, Finished):
                result = event.result
                final = shape.chunk(None if chat else "", result.finish_reason)
                yield sse.event(with_usage({**final, **result.extras()}))
                if include_usage:
                    yield sse.event(shape.usage_chunk(result.usage.openai_dict()))
                yield sse.DONE
            elif isinstance(event, Failed):
                yield sse.event(engine_error(event.error).body())

    return StreamingResponse(200, events(), list(sse.HEADERS), on_close=job.cancel)


async def chat_completions(node: ModelEndpoint, req: HttpRequest) -> Response | StreamingResponse:
    return await _handle(node, req, chat=True)


async def completions(node: ModelEndpoint, req: HttpRequest) -> Response | StreamingResponse:
    return await _handle(node, req, chat=False)
