"""OpenAI completions (POST /v1/completions): one string `prompt` read into the engine's
request, the result written as a text_completion (whole or streamed).

The body takes the pipe's fields but for the chat ones (messages, tools), and OpenAI's own
options, refused by name where we cannot honour them (openai_chat.py says how).
"""

from __future__ import annotations

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.results import GenerationResult
from skulkp2p.formats.body_fields import FormatError, Options
from skulkp2p.formats.openai_chat import (
    COMMON_OPTIONS,
    CheckModel,
    OpenAIRequest,
    OpenAIShape,
    openai_fields,
)
from skulkp2p.formats.pipe_format import parse_request

COMPLETION_OPTIONS: Options = {
    **COMMON_OPTIONS,
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "only best_of=1 is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "logprobs": (lambda v: v is None, "logprobs are not supported yet"),
}

# The pipe's fields that only chat takes.
_CHAT_TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def completion_request(body: object, check_model: CheckModel) -> OpenAIRequest:
    if isinstance(body, dict):
        if body.get("messages") is not None:
            raise FormatError("completions take 'prompt'; send 'messages' to "
                              "/v1/chat/completions", "messages")
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise FormatError("'prompt' must be one string (batches and token-id prompts "
                                  "are not supported)", "prompt")
            body = {**body, "prompt": prompt[0]}
        elif prompt is None:
            raise FormatError("'prompt' is required", "prompt")
    fields, stream, include_usage = openai_fields(body, COMPLETION_OPTIONS, check_model)
    tools = sorted(_CHAT_TOOL_FIELDS & set(fields))
    if tools:  # the pipe's parser would take them: refuse them here by name
        raise FormatError(f"'{tools[0]}' is only for /v1/chat/completions", tools[0],
                          "unsupported_parameter")
    req = parse_request(fields, frozenset(COMPLETION_OPTIONS) | {"stream_options"})
    return OpenAIRequest(req, stream, include_usage)


class CompletionShape(OpenAIShape):
    prefix = "cmpl-"
    whole_object = "text_completion"
    chunk_object = "text_completion"

    def _choice(self, result: GenerationResult) -> JSONObject:
        return {"index": 0, "text": result.text, "logprobs": None,
                "finish_reason": result.finish_reason}

    def _text_chunk(self, text: str | None, finish: str | None = None, role: bool = False
                    ) -> JSONObject:
        choice: JSONObject = {"index": 0, "text": text or "", "logprobs": None,
                              "finish_reason": finish}
        return {**self._base(self.chunk_object), "choices": [choice]}

    def started(self) -> list[JSONObject]:
        return []  # no role to announce

    def _final_text(self) -> str | None:
        return ""
