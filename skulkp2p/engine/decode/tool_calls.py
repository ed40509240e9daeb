"""Tool calls in a model's output, found while it streams.

The MLX engine feeds `ToolCallStream` the text its decode loop releases (after stop strings are
cut, `text.TextAssembler`); the stream hands back chunks: plain text as it comes, and each call
as typed `ToolCallDelta`s (id and name first, then fragments of its arguments). Decoding,
drafting and verification never see any of this: speculation stays exact, and runs on the call's
tokens like on any others.

What a call looks like is the model family's business, and mlx-lm already knows the families:
its `mlx_lm.tool_parsers.<name>` modules give the markers around a call (`tool_call_start`,
`tool_call_end`) and a `parse_tool_call(text, tools)` for the text between them. The card's
`[chat] tool_parser` names one; without it, the one mlx-lm's tokenizer wrapper inferred from the
chat template's markers (Qwen/Hermes `<tool_call>{json}</tool_call>` -> `json_tools`). Nothing
here is written per family except `forced_opening` (how to begin a call to one named function).

A call is handed out once its end marker arrived and it parsed: until then it is held, so text
the model meant as a call but wrote as malformed JSON (or a call to a function that was not
offered) comes back as the plain text it is, never as a broken call. Its arguments then go out as
the fragments the model produced them in (one fragment when the parser rewrote them).

No mlx here: `load_format` imports mlx-lm's parser module only when the MLX engine asks for it.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import GenerationRequest, Message, RequestError, Tool
from skulkp2p.engine.results import Chunk, GenerationResult, ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel

PARSERS = "mlx_lm.tool_parsers"


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call: mlx-lm's parser module, by name."""
    name: str
    start: str
    end: str  # "" where a call runs to the end of the reply (Mistral's [TOOL_CALLS])
    parse: Callable[[str, Any], Any]
    # The call is one JSON object {"name", "arguments"} (Hermes/Qwen): also read it where the
    # model leaves out the markers (see ToolCallParser).
    json_object: bool = False


# mlx-lm's parsers whose call is one JSON object {"name": ..., "arguments": {...}}.
JSON_OBJECT_FORMATS = ("json_tools",)


def load_format(name: str, where: str = "chat.tool_parser") -> ToolFormat:
    """mlx-lm's parser module `name` (importing it imports mlx-lm: the MLX engine only)."""
    if not name.isidentifier():
        raise ValueError(f"{where} {name!r} is not a module name")
    try:
        module = importlib.import_module(f"{PARSERS}.{name}")
    except ModuleNotFoundError:
        raise ValueError(f"{where} {name!r}: mlx-lm has no tool parser of that name "
                         f"({', '.join(known_parsers())})") from None
    return ToolFormat(name, module.tool_call_start, module.tool_call_end,
                      module.parse_tool_call, json_object=name in JSON_OBJECT_FORMATS)


def known_parsers() -> list[str]:
    from importlib.resources import files
    return sorted(p.name[:-3] for p in files(PARSERS).iterdir()
                  if p.name.endswith(".py") and not p.name.startswith("_"))


class TemplateTokenizer(Protocol):
    """What is read here of a model's tokenizer (mlx-lm's wrapper): its chat template."""

    def apply_chat_template(self, conversation: list[dict[str, object]], /,
                            **kwargs: object) -> object: ...


def model_format(card_chat: Mapping[str, object], tokenizer: object) -> ToolFormat | None:
    """The model's tool format: the card's `[chat] tool_parser` ("none": the model takes no
    tools), else the parser mlx-lm's tokenizer wrapper picked from the chat template (or from
    tokenizer_config's tool_parser_type), else None."""
    name = card_chat.get("tool_parser")
    if name == "none":
        return None
    if name:
        return load_format(str(name))
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if parser is None or not module.startswith(PARSERS + "."):
        return None
    return load_format(module.rsplit(".", 1)[-1], "the chat template's tool parser")


# How to begin a call to one named function, per format: the prompt ends with it, so the model
# can only go on with that call's arguments. Written per family because mlx-lm's parsers only
# read calls; the two here are the formats whose call opening is plain text we can write.
# An opening ends where the template's own rendering of a call puts a token boundary (no
# trailing space: the model's next token carries it, as in training text).
_NAMED_OPENINGS: dict[str, Callable[[str, str], str]] = {
    "json_tools": lambda start, name: f'{start}\n{{"name": {json.dumps(name)}, "arguments":',
    "qwen3_coder": lambda start, name: f"{start}\n<function={name}>\n",
}
_REQUIRED_OPENINGS: dict[str, Callable[[str], str]] = {
    "json_tools": lambda start: f'{start}\n{{"name":',
}


def forced_opening(fmt: ToolFormat, req: GenerationRequest) -> str:
    """The text the prompt ends with so that the reply is a call: `required` opens a call (the
    model picks the function), a named function opens a call to it. "" for auto."""
    return call_opening(fmt.name, fmt.start, req)


def call_opening(name: str, start: str, req: GenerationRequest) -> str:
    """`forced_opening` for the format mlx-lm calls `name`, whose calls begin with `start`
    (the served engine uses it too, knowing the format from the GGUF's template)."""
    choice = req.tool_choice
    if choice.mode == "required":
        required = _REQUIRED_OPENINGS.get(name)
        return required(start) if required else start
    if choice.mode == "function":
        opening = _NAMED_OPENINGS.get(name)
        if opening is None:
            raise RequestError(f"'tool_choice' naming a function is not supported for this "
                               f"model's tool format ({name}); use \"required\" (supported "
                               f"for {', '.join(sorted(_NAMED_OPENINGS))})", "tool_choice")
        return opening(start, choice.name or "")
    return ""


def json_tools_template(template: str) -> bool:
    """Whether a chat template asks for Hermes/Qwen calls (`<tool_call>{json}</tool_call>`):
    mlx-lm's rule for json_tools, for where mlx-lm is not at hand (a GGUF's template)."""
    return ("<tool_call>" in template and "tool_call.name" in template
            and "<function=" not in template)


def template_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """Messages as chat templates read them (OpenAI chat's shape, which mlx-lm's and Hugging
    Face's templates follow), with a call's arguments as an object (templates write them with
    `| tojson`), not as the JSON text a call carries."""
    out = []
    for m in messages:
        msg: dict[str, object] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def template_tools(tools: Sequence[Tool]) -> list[JSONObject]:
    """Tools as chat templates and mlx-lm's tool parsers take them (OpenAI chat's `tools`)."""
    out: list[JSONObject] = []
    for tool in tools:
        fn: JSONObject = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = (tool.parameters if tool.parameters is not None
                            else {"type": "object", "properties": {}})
        out.append({"type": "function", "function": fn})
    return out


PROBE_NAME = "skulkp2p_probe_tool"
PROBE_TOOL: JSONObject = {"type": "function", "function": {
    "name": PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer: TemplateTokenizer) -> bool:
    """Whether the chat template writes the tools into the prompt (a template that ignores them
    would let the model answer without ever seeing them)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tools=[PROBE_TOOL], add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return isinstance(text, str) and PROBE_NAME in text


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_OBJECT_HEAD = '{"name":'  # how a bare call begins, whitespace aside


class ToolCallParser:
    """Sans-I/O: `feed` it text as it is released, get back events in order, each a str (plain
    text) or a ToolCallDelta; `finish` at the end of the reply.

    Whitespace that only separates text from a call, or calls from each other, is dropped; plain
    text without a call comes out exactly as fed.

    Formats whose call is one JSON object (json_tools) are also read where the model leaves the
    markers out, written by hand because none of mlx-lm's parsers does it: Qwen2.5-Coder-0.5B
    answers a tool request with the bare `{"name": ..., "arguments": {...}}` its template shows,
    without the `<tool_call>` tags around it, and often goes on to a second call without closing
    the first tag. So: at the start of the reply or right after a call, text that begins with
    `{"name":` is held until its object closes, and is a call if it is one to an offered
    function (else it is released as text); inside the tags, the call ends where its object
    does when the model writes something other than the end marker after it."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool] | None = None,
                 parallel: bool = True, opening: str = "",
                 new_id: Callable[[], str] = new_call_id):
        self.fmt = fmt
        self.tools = None if tools is None else template_tools(tools)  # what mlx-lm's take
        self.names = None if tools is None else {t.name for t in tools}
        self.parallel = parallel
        self.new_id = new_id
        self.in_call = False
        self.pending = ""  # text not released yet: may begin a start marker, or a bare call
        self.space = ""  # whitespace held until text follows it
        self.space_before_call = ""  # given back if the call turns out to be no call
        self.body = ""  # the open call's text after its start marker
        self.cuts: list[int] = []  # where, in body, the fed pieces ended
        self.calls: list[ToolCall] = []
        self.text_parts: list[str] = []
        self.last_was_call = False
        self.bare_ok = fmt.json_object  # a bare call may begin here (nothing said yet)
        self.done = False  # parallel_tool_calls false and one call made: stop generating
        if opening:
            # The prompt ended with the call's opening: it is part of the call's text.
            if not opening.startswith(fmt.start):
                raise ValueError("a forced opening must begin with the start marker")
            self.in_call = True
            self.body = opening[len(fmt.start):]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, piece: str) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        if not piece or self.done:
            return out
        if self.in_call:
            self.body += piece
            self.cuts.append(len(self.body))
        else:
            self.pending += piece
        self._scan(out)
        return out

    def finish(self) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        if self.done:
            return out
        if self.in_call:
            # Unterminated (or a format whose calls run to the end): a call only if it parses.
            self._close(self.body, out, terminated=False)
        if self.pending and not self.done:
            self._text(self.pending, out)
        self.pending = ""
        if self.space and not self.last_was_call and not self.done:
            self._emit_text(self.space, out)
        self.space = ""
        return out

    # ---- internals ------------------------------------------------------------------------

    def _scan(self, out: list[str | ToolCallDelta]) -> None:
        start, end = self.fmt.start, self.fmt.end
        while not self.done:
            if not self.in_call:
                if self.bare_ok:
                    bare = self._bare(out)
                    if bare == "hold":
                        return
                    if bare == "call":
                        continue  # go on after it
                i = self.pending.find(start)
                if i >= 0:
                    self._text(self.pending[:i], out)
                    self.space_before_call, self.space = self.space, ""
                    self.in_call = True
                    self.body = self.pending[i + len(start):]
                    self.cuts = [len(self.body)] if self.body else []
                    self.pending = ""
                    continue
                keep = _marker_prefix(self.pending, start)
                self._text(self.pending[:len(self.pending) - keep], out)
                self.pending = self.pending[len(self.pending) - keep:]
                return
            if not end:
                return  # the call runs to the end of the reply
            j = self.body.find(end)
            if j >= 0:
                rest = self.body[j + len(end):]
                self._close(self.body[:j], out, terminated=True)
                self.pending = rest
                continue
            if self.fmt.json_object:
                k = _object_end(self.body)
                if k is not None:
                    after = self.body[k:].lstrip()
                    if after and not end.startswith(after[:len(end)]):
                        # The object closed and the model went on without the end marker.
                        rest = self.body[k:]
                        self._close(self.body[:k], out, terminated=False)
                        self.pending = rest
                        continue
            return

    def _bare(self, out: list[str | ToolCallDelta]) -> str:
        """Where a bare call may begin: "hold" while the pending text may still become one,
        "call" once one was handed out, "no" (and no more bare calls until the next call)."""
        head = self.pending.lstrip()
        if not head:
            return "hold"  # only whitespace so far
        squeezed = "".join(head[:4 * len(_OBJECT_HEAD)].split())[:len(_OBJECT_HEAD)]
        if not _OBJECT_HEAD.startswith(squeezed):
            self.bare_ok = False
            return "no"
        if len(squeezed) < len(_OBJECT_HEAD):
            return "hold"
        k = _object_end(head)
        if k is None and len(head) <= MAX_CALL_TEXT:
            return "hold"  # not closed yet
        if k is None:  # too long to be a call: the text it is
            self.bare_ok = False
            return "no"
        calls = self._parse_object(head[:k])
        if calls is None:
            self.bare_ok = False
            return "no"  # released as text
        self.space = ""  # what separated it from text before goes with the call
        self.pending = head[k:]
        self._hand_out(calls, head[:k], [], out)
        return "call"

    def _text(self, text: str, out: list[str | ToolCallDelta]) -> None:
        """Release text, holding its trailing whitespace until text follows it."""
        if not text:
            return
        text = self.space + text
        if self.last_was_call:
            text = text.lstrip()  # what separates a call from the text after it
        head = text.rstrip()
        self.space = text[len(head):]
        if head:
            self._emit_text(head, out)
            self.last_was_call = False
            self.bare_ok = False

    def _emit_text(self, text: str, out: list[str | ToolCallDelta]) -> None:
        self.text_parts.append(text)
        out.append(text)

    def _close(self, raw: str, out: list[str | ToolCallDelta], terminated: bool) -> None:
        """The open call ended: hand it out as calls if it parses, else as the text it is."""
        self.in_call = False
        body_cuts, self.body, self.cuts = self.cuts, "", []
        calls = self._parse(raw)
        before, self.space_before_call = self.space_before_call, ""
        if not calls:
            self.space = ""
            self._text(before + self.fmt.start + raw + (self.fmt.end if terminated else ""), out)
            return
        self._hand_out(calls, raw, body_cuts, out)

    def _hand_out(self, calls: list[tuple[str, str]], raw: str, cuts: list[int],
                  out: list[str | ToolCallDelta]) -> None:
        for name, arguments in calls:
            index = len(self.calls)
            call = ToolCall(self.new_id(), name, arguments)
            self.calls.append(call)
            out.append(ToolCallDelta(index, call.id, name, ""))
            out.extend(ToolCallDelta(index, arguments=f)
                       for f in _fragments(arguments, raw, cuts))
            if not self.parallel:
                self.done = True
                break
        self.last_was_call = True
        self.bare_ok = self.fmt.json_object and not self.done

    def _parse(self, raw: str) -> list[tuple[str, str]] | None:
        """[(name, arguments as JSON text)], or None when the text is not a well-formed call to
        an offered function, or is past the bounds (MAX_CALL_TEXT characters, MAX_CALL_DEPTH
        levels). The model's text never raises out of here."""
        if len(raw) > MAX_CALL_TEXT or _nesting(raw) > MAX_CALL_DEPTH:
            return None
        try:
            parsed = self.fmt.parse(raw, self.tools)
        except Exception:  # noqa: BLE001 - the parsers raise what their libraries raise
            return None
        return self._calls(parsed)

    def _parse_object(self, raw: str) -> list[tuple[str, str]] | None:
        obj = bounded_json(raw)
        if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
            return None
        return self._calls(obj)

    def _calls(self, parsed: Any) -> list[tuple[str, str]] | None:
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            name, arguments = item.get("name"), item.get("arguments", {})
            if not isinstance(name, str) or (self.names is not None and name not in
                                              self.names):
                return None
            if isinstance(arguments, str):
                if not isinstance(bounded_json(arguments), dict):
                    return None
                text = arguments
            elif isinstance(arguments, dict):
                text = json.dumps(arguments, ensure_ascii=False)
            else:
                return None
            calls.append((name, text))
        return calls or None


_DECODER = json.JSONDecoder()

# The bounds of a call's text the model wrote, as a request's JSON texts are bounded
# (formats/body_fields.py): past them the call comes back as the text it is.
MAX_CALL_TEXT = 1 << 20  # characters
MAX_CALL_DEPTH = 100  # levels of objects and arrays


def _nesting(text: str) -> int:
    """How deep the brackets of a JSON text nest, strings aside (no recursion, no parse)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def bounded_json(text: str) -> object:
    """The value of a JSON text the model wrote, or None when it is not JSON or is past the
    bounds (orjson parses without recursing)."""
    if len(text) > MAX_CALL_TEXT or _nesting(text) > MAX_CALL_DEPTH:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def _object_end(text: str) -> int | None:
    """Where the JSON object at the start of `text` (after whitespace) ends, once it is whole
    (None past the bounds: never a call)."""
    stripped = text.lstrip()
    if not stripped.startswith("{") or len(stripped) > MAX_CALL_TEXT:
        return None
    try:
        _, end = _DECODER.raw_decode(stripped)
    except (ValueError, RecursionError):  # (the call's parse then bounds its depth)
        return None
    return len(text) - len(stripped) + end


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may be one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _fragments(arguments: str, raw: str, cuts: list[int]) -> list[str]:
    """The arguments in the pieces the model wrote them in, where it wrote them verbatim (the
    usual case); else whole."""
    at = raw.find(arguments)
    if at < 0:
        return [arguments]
    bounds = [c - at for c in cuts if at < c < at + len(arguments)]
    edges = [0, *bounds, len(arguments)]
    return [arguments[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


class ToolCallStream:
    """The parser at the decode loop's pace: chunks in, chunks out, and the result rewritten
    at the end (the text beside the calls, the calls, finish_reason "tool_calls")."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser

    @property
    def done(self) -> bool:
        return self.parser.done

    def chunks(self, text: str, tokens: list[int]) -> Iterator[Chunk]:
        yield from _as_chunks(self.parser.feed(text), tokens)

    def finish(self, tail: str = "") -> Iterator[Chunk]:
        events = self.parser.feed(tail) + self.parser.finish()
        yield from _as_chunks(events, [], empty=False)

    def result(self, result: GenerationResult) -> GenerationResult:
        calls = tuple(self.parser.calls)
        finish = result.finish_reason
        if calls and (finish == "stop" or self.parser.done):
            finish = "tool_calls"
        return replace(result, text=self.parser.text, tool_calls=calls, finish_reason=finish,
                       stop_sequence=None if finish == "tool_calls" else result.stop_sequence)


def _as_chunks(events: list[str | ToolCallDelta], tokens: list[int], empty: bool = True
               ) -> Iterator[Chunk]:
    if not events:
        if empty:
            yield Chunk("", tokens)
        return
    for i, event in enumerate(events):
        toks = tokens if i == 0 else []
        if isinstance(event, str):
            yield Chunk(event, toks)
        else:
            yield Chunk("", toks, tool_call=event)


# ---- the MLX engine's side: a loaded model (its type only named: no mlx here) -------------

def model_tools(loaded: LoadedModel) -> tuple[ToolFormat | None, bool]:
    """(the model's tool format, whether its chat template renders tools), once per model."""
    cached = loaded.runtime.get("_tool_support")
    if cached is None:
        fmt = model_format(loaded.chat, loaded.tokenizer)
        cached = loaded.runtime["_tool_support"] = (fmt, renders_tools(loaded.tokenizer))
    return cached


def chat_tools(loaded: LoadedModel, req: GenerationRequest
               ) -> tuple[list[dict[str, object]], dict[str, object], str]:
    """What the chat template is given for `req`: (messages, extra arguments: the tools, the
    opening the prompt ends with when tool_choice forces a call). RequestError (400) for tools
    the model cannot take."""
    messages = template_messages(req.messages or ())
    if not req.uses_tools:
        return messages, {}, ""
    fmt, renders = model_tools(loaded)
    if not renders:
        raise RequestError(f"model {loaded.id}: its chat template does not render tools, so "
                           "the model would never see them", "tools")
    if fmt is None:
        raise RequestError(f"model {loaded.id} has no known tool-call format: name one of "
                           "mlx-lm's tool parsers in its card ([chat] tool_parser)", "tools")
    return messages, {"tools": template_tools(req.tools)}, forced_opening(fmt, req)


def tool_stream(loaded: LoadedModel, req: GenerationRequest) -> ToolCallStream | None:
    """The parser for `req`'s reply, or None when it offers no tools."""
    if not req.uses_tools:
        return None
    fmt, _ = model_tools(loaded)
    if fmt is None:  # chat_tools refused it already
        return None
    return ToolCallStream(ToolCallParser(fmt, req.tools, req.parallel_tool_calls,
                                         forced_opening(fmt, req)))
