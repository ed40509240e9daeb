"""Tool calls held to their format: a grammar that starts where a call starts.

When tools are offered, the reply is free text until the model opens a call; from there to the
call's end every token is drawn from what the call grammar allows: the model's own call format
(Hermes/Qwen: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, or the bare
object Qwen2.5-Coder also writes at the start of a reply), the name one of the offered
functions, the arguments JSON that fits the function's schema when the tool is strict (else any
JSON object). Before the call (and between calls) the rows are not masked at all, so until the
model opens a call the output is the unconstrained output, token for token: a lazy grammar, as
llama.cpp's are, triggered by the call's opening.

The grammar itself is llguidance's: a lark grammar whose arguments are `%json{...}`
sub-grammars. Here are only the trigger and the matcher's life: it is built when the emitted
tokens open a call (the start marker, or a bare `{"name":` where a call may begin), fed the
text of the opening, and dropped once the call is complete. A forced call (tool_choice
"required" or naming a function: the prompt ends with the call's opening, tool_calls.py)
starts with the matcher fed that opening. With a response format too, the grammar holds the whole
reply from its first token: either calls or an answer that fits the format.

Only formats whose call is one JSON object (mlx-lm's json_tools) have a grammar here; the others
stay parsed, unconstrained, as before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from skulkp2p.engine.decode.grammar import ANY_OBJECT, JSON_STYLE, Grammar, compile_format
from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import RequestError, ResponseFormat, Tool

# How a bare call (no start marker) begins, where one may begin (json_tools).
BARE_HEAD = b'{"name":'


@dataclass(frozen=True)
class CallFormat:
    """A model's call format, as the grammar writes it: the markers around a call."""
    start: str  # "<tool_call>"
    end: str  # "</tool_call>"
    bare: bool = True  # a call may also be the object alone (no markers)


def _marker(tokenizer: llguidance.LLTokenizer, text: str) -> str:
    """A marker in lark: its special token (`<[id]>`) where the tokenizer has one for it (a
    special token's bytes never match a string), else the text."""
    ids = tokenizer.tokenize_str(text)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text, ensure_ascii=False)


def _arguments(tool: Tool) -> str:
    """The %json sub-grammar of one function's arguments: its schema when the tool is strict,
    any object when not; written as grammar.JSON_STYLE writes JSON (the schema's own
    "x-guidance" wins)."""
    schema: JSONObject = dict(tool.parameters or {"type": "object", "properties": {}}) \
        if tool.strict else dict(ANY_OBJECT)
    schema = {"x-guidance": dict(JSON_STYLE), **schema}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def call_lark(tokenizer: llguidance.LLTokenizer, fmt: CallFormat, tools: Sequence[Tool],
              answer: ResponseFormat | None = None, only: Sequence[Tool] | None = None,
              bare: bool = True, repeat: bool = False) -> str:
    """The lark grammar of one call (`only`'s functions; default all `tools`), marked or bare;
    `repeat`: calls one after another (with an answer: calls, or the answer alone)."""
    start, end = _marker(tokenizer, fmt.start), _marker(tokenizer, fmt.end)
    first = list(only) if only is not None else list(tools)
    rules = [f"tagged: {start} \"\\n\" first_call \"\\n\" {end}",
             f"any_tagged: {start} \"\\n\" any_call \"\\n\" {end}",
             "WS: /[ \\t\\r\\n]+/"]
    names = {t.name: i for i, t in enumerate(tools)}
    rules.append("first_call: " + " | ".join(f"call_{names[t.name]}" for t in first))
    rules.append("any_call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "arguments": ')
        rules.append(f"call_{i}: {head} args_{i} \"}}\"")
        rules.append(f"args_{i}: {_arguments(tool)}")
    if answer is not None:
        schema = ANY_OBJECT if answer.type == "json_object" else (answer.schema or {})
        rules.append("answer: %json " + json.dumps({"x-guidance": dict(JSON_STYLE), **schema},
                                                   ensure_ascii=False))
    calls = "tagged (WS? any_tagged)*" if repeat else "tagged"
    if bare and fmt.bare:
        calls = f"({calls} | WS? first_call)"
    top = f"start: {calls}" + (" | answer" if answer is not None else "")
    return "\n".join([top, *rules]) + "\n"


def compile_lark(lark: str, where: str = "tools") -> str:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise RequestError(f"'{where}': {messages[0] if messages else 'invalid grammar'}",
                           where)
    return grammar


class ToolCallGrammar(Grammar):
    """The matcher of a reply that may call tools: free (`mask()` None) until the emitted
    tokens open a call, the call grammar's from there until the call is complete, then free
    again. `first` (a forced call, or calls-or-answer with a response format) holds the reply
    from its first token, fed `opening` (the tokens the prompt ended with); a forced call's
    grammar is let go when it is complete, calls-or-answer's never (then only EOS follows)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, calls: str, n_vocab: int,
                 fmt: CallFormat, first: str | None = None, opening: Sequence[int] = (),
                 first_ends: bool = True):
        super().__init__(tokenizer, calls, n_vocab)
        self.tokenizer = tokenizer
        self.template = self.matcher  # a fresh call matcher: copied at each call's opening
        self.start = fmt.start.encode()
        self.bare = fmt.bare
        self.first: llguidance.LLMatcher | None = None
        if first is not None:
            self.first = llguidance.LLMatcher(tokenizer, first, log_level=0)
            if self.first.is_error() or not self.first.consume_tokens(list(opening)):
                raise RequestError(f"'tools': {self.first.get_error()}", "tools")
        self.first_ends = first_ends
        self.history: list[int] = []  # every token accepted (rollback replays them)
        self._restart()

    def _restart(self) -> None:
        first = self.first
        self.active: llguidance.LLMatcher | None = None if first is None else first.deep_copy()
        self.lets_go = self.first_ends or first is None
        self.segment: list[int] = []  # tokens since the reply's start or the last call's end
        self.bare_open = self.bare  # a bare call may still begin this segment

    def mask(self) -> np.ndarray | None:
        return None if self.active is None else self.mask_of(self.active)

    def constrained(self) -> bool:
        return self.active is not None

    def accept(self, token: int) -> None:
        self.history.append(token)
        self.accepted += 1
        if self.active is not None:
            if not self.active.consume_token(token):
                raise RuntimeError(f"the tool-call grammar refused emitted token {token}: "
                                   f"{self.active.get_error()}")
            if self.lets_go and self.active.is_stopped():
                self.active, self.segment, self.bare_open = None, [], self.bare
            return
        self.segment.append(token)
        opening, self.bare_open = self._opening(self.segment, self.bare_open)
        if opening is not None:
            self.active = self._call_from(opening)

    def _call_from(self, opening: bytes) -> llguidance.LLMatcher | None:
        """A call matcher fed the text of the call's opening, or None when the call grammar
        refuses it (the model opened something else: the text stays free). The opening's
        tokens are its own tokenization, not the emitted tokens: the marker may begin inside
        a token (" <"), and the grammar's state is the text's, whatever the token boundaries."""
        matcher = self.template.deep_copy()
        tokens = self.tokenizer.tokenize_bytes(opening)
        if matcher.validate_tokens(tokens) != len(tokens) or not matcher.consume_tokens(tokens):
            return None
        return matcher

    def _opening(self, segment: list[int], bare_open: bool) -> tuple[bytes | None, bool]:
        """(the text of a call's opening, from its first byte to the end of `segment`, when
        the last token completed one; whether a bare call may still begin the segment)."""
        if bare_open:
            text = self.tokenizer.decode_bytes(segment).lstrip()
            if text.startswith(BARE_HEAD):
                return text, False
            bare_open = BARE_HEAD.startswith(text)
        last = self.tokenizer.decode_bytes(segment[-1:])
        if self.start[-1:] in last:  # the marker ends in the last token, if anywhere
            tail = self.tokenizer.decode_bytes(segment[-len(self.start):])
            at = tail.rfind(self.start)
            if at >= 0 and at + len(self.start) > len(tail) - len(last):
                return tail[at:], bare_open
        return None, bare_open

    def valid_prefix(self, tokens: list[int]) -> int:
        """Inside a call, what the call grammar allows; before one, every token up to the one
        that opens a call, then what the call grammar allows after it."""
        if not tokens:
            return 0
        if self.active is not None:
            return self.active.validate_tokens(tokens)
        segment, bare_open = list(self.segment), self.bare_open
        for i, token in enumerate(tokens):
            segment.append(token)
            opening, bare_open = self._opening(segment, bare_open)
            if opening is not None:  # the call's grammar from its opening on
                matcher = self._call_from(opening)
                if matcher is None:
                    return i + 1
                rest = tokens[i + 1:]
                return i + 1 + (matcher.validate_tokens(rest) if rest else 0)
        return len(tokens)

    def forced(self) -> list[int]:
        if self.active is None:
            return []
        return [t for t in self.active.compute_ff_tokens() if t < self.n_vocab]

    def forced_after(self, tokens: list[int]) -> list[int]:
        return []  # (no lookahead across a call's opening or end: the drafts stop earlier)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        kept = self.history[:-n]
        self.history, self.accepted = [], 0
        self._restart()
        for token in kept:
            self.accept(token)

    @property
    def done(self) -> bool:
        return self.active is not None and not self.lets_go and self.active.is_stopped()


def tool_grammar(tokenizer: llguidance.LLTokenizer, n_vocab: int, fmt: CallFormat,
                 tools: Sequence[Tool], mode: str, name: str | None, opening: str,
                 answer: ResponseFormat) -> ToolCallGrammar:
    """The grammar of a reply offered `tools` (tool_choice `mode`, `name` when it names one;
    the prompt ends with `opening` when it forces a call), with `answer` the response format
    a reply that calls nothing must fit (text: free)."""
    constrained = answer if answer.constrained else None
    if constrained is not None:
        compile_format(constrained)  # (a bad schema: its own 400, naming the path)
    calls = compile_lark(call_lark(tokenizer, fmt, tools))
    first: str | None = None
    opening_ids = tokenizer.tokenize_str(opening) if opening else []
    if mode in ("required", "function"):
        only = [t for t in tools if mode == "required" or t.name == name]
        first = compile_lark(call_lark(tokenizer, fmt, tools, only=only, bare=False,
                                       repeat=constrained is not None))
    elif constrained is not None:
        first = compile_lark(call_lark(tokenizer, fmt, tools, answer=constrained, bare=False,
                                       repeat=True))
    return ToolCallGrammar(tokenizer, calls, n_vocab, fmt, first, opening_ids,
                           first_ends=constrained is None)
