"""What a generation is asked: the typed request every engine takes, and the limits of its values.

No mlx here, and no JSON: the front ends (skulkp2p/formats/) read their own bodies into these
values, each naming its own fields in its errors; an engine raises RequestError for a request it
cannot serve (a prompt too long, a drafter the model lacks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.results import ToolCall


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


DRAFTERS = ("lookup", "mtp", "draft", "assistant")
ROLES = ("system", "user", "assistant", "tool", "developer")

# The ranges a request's values must fall in, whatever front end names them.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_SPECULATION_DEPTH = 32
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RequestError(ValueError):
    """A request the engine cannot serve, or a front end refused: `param` names the field."""

    def __init__(self, message: str, param: str | None = None,
                 type: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type
        self.status = status


@dataclass(frozen=True)
class Speculation:
    mode: str = "auto"  # auto | off | explicit
    drafter: str | None = None
    depth: int | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call: name, description and a JSON Schema of its arguments."""
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class ToolChoice:
    """auto: the model decides; none: tools are not offered (not rendered, no calls parsed);
    required: the model must call one; function: it must call `name`."""
    mode: str = "auto"  # auto | none | required | function
    name: str | None = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ResponseFormat:
    """The shape the output must take: free text, any JSON object, or JSON valid against
    `schema` (a JSON Schema; `name` and `strict` as the caller gave them). Anything but text
    constrains decoding: every token is drawn from the tokens the grammar allows
    (engine/decode/grammar.py)."""
    type: str = "text"  # one of RESPONSE_FORMATS
    schema: JSONObject | None = None
    name: str | None = None
    strict: bool | None = None

    @property
    def constrained(self) -> bool:
        return self.type != "text"


@dataclass(frozen=True)
class Message:
    """One turn of a chat, as the chat template renders it: its role (one of ROLES) and text,
    an assistant's calls (each call's arguments a JSON object, as text), and for a tool's result
    the call it answers (and the function's name, when given)."""
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    id: JSONValue = None  # the caller's own id, given back with the result (the pipe's)
    model: str | None = None
    messages: tuple[Message, ...] | None = None  # a chat (its template applies), or
    prompt: str | None = None  # raw text
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculation: Speculation = field(default_factory=Speculation)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    # False: nothing of this request is written to disk (the prefix cache keeps its entries in
    # memory only); the request field `disk_cache`.
    disk_cache: bool = True
    # True: EOS does not end the output, max_tokens does (the bench's fixed lengths, as
    # llama.cpp's benches run; no front end sets it).
    ignore_eos: bool = False

    @property
    def uses_tools(self) -> bool:
        """Tools are offered to the model and its calls are parsed."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def text_length(self) -> int:
        """Characters of the text the prompt is made from (the raw prompt, or every message's
        content and its calls' arguments): an engine bounds the prompt's tokens with it before
        tokenising anything."""
        if self.messages is None:
            return len(self.prompt or "")
        return sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                   for m in self.messages)
