"""Structured outputs: a request's response format as an llguidance grammar, and the matcher that
gives the decode loop the tokens it allows.

The JSON Schema engine is llguidance's (JSON schema -> grammar -> a token mask per step); here
are only the choices around it: how a schema compiles (JSON written as `json.dumps` writes it,
", " and ": ", no free whitespace, so a small model cannot wander in blank space), how its errors
read (the front end's field and the JSON path of the offending keyword), and the matcher's state
kept equal to the tokens emitted (loop.py consumes each emitted token, and nothing else).

No mlx here: the front ends (skulkp2p/formats/) compile a request's schema to refuse a bad one
before anything runs; the mask is a numpy boolean vector the loop applies to each verified row.
"""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.request import RequestError, ResponseFormat

# How a schema's JSON is written (llguidance's JsonCompileOptions; a schema's own "x-guidance"
# overrides them): the separators json.dumps writes, and no whitespace beyond them.
JSON_STYLE: dict[str, str | bool | None] = {
    "item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
}

# What `json_object` asks for: any JSON object.
ANY_OBJECT: JSONObject = {"type": "object"}


def compile_format(fmt: ResponseFormat, where: str = "response_format") -> str:
    """The llguidance grammar of a constrained response format. RequestError for a schema
    llguidance cannot compile (invalid, or using a keyword it does not implement): its `param`
    is the JSON path of the keyword at fault, `where` (the front end's name of the schema's
    field) followed by the path inside the schema, and its message llguidance's."""
    if not fmt.constrained:
        raise ValueError("a text response format has no grammar")
    schema: JSONValue = ANY_OBJECT if fmt.type == "json_object" else fmt.schema
    if not isinstance(schema, dict):
        raise RequestError(f"'{where}' must be a JSON Schema object", where)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_STYLE)  # type: ignore[arg-type]
    except ValueError as e:
        raise RequestError(f"'{where}': invalid JSON schema: {e}", where) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        message = messages[0] if messages else "invalid JSON schema"
        path = where + error_path(schema, message)
        raise RequestError(f"'{path}': {message}", path)
    return grammar


def error_path(schema: JSONValue, message: str) -> str:
    """The JSON path inside `schema` (".properties.x.type"; "" for the schema itself) of the
    first place llguidance's error message names: a keyword it quotes ('Unimplemented keys:
    ["uniqueItems"]', "Expected positive integer for 'minLength'") or the value after its last
    colon ('Invalid type: intger', "Pointer '/nope' does not exist")."""
    quoted = [a or b for a, b in re.findall(r'"([^"]+)"|\'([^\']+)\'', message)]
    tail = message.rsplit(":", 1)[-1].strip() if ":" in message else ""
    words = [w for w in [*quoted, tail] if w]

    def names(value: JSONValue) -> bool:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            return False
        text = str(value)
        return any(text == w or (len(w) > 1 and text.endswith(w)) for w in words)

    def walk(node: JSONValue, path: str) -> str | None:
        if isinstance(node, dict):
            for key in node:
                if key in words:
                    return f"{path}.{key}"
            for key, value in node.items():
                if names(value):
                    return f"{path}.{key}"
            for key, value in node.items():
                found = walk(value, f"{path}.{key}")
                if found is not None:
                    return found
        elif isinstance(node, list):
            for i, value in enumerate(node):
                found = walk(value, f"{path}[{i}]")
                if found is not None:
                    return found
        return None

    return walk(schema, "") or ""


def tokenizer_bridge(hf_tokenizer: object, n_vocab: int, eos: list[int]
                     ) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, its masks `n_vocab` wide (the model's
    logits rows, padding included), ending on any of `eos`. About a second to build: once per
    model (the runner keeps it)."""
    from llguidance.hf import from_tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        raise RequestError("structured outputs need a fast (Rust) Hugging Face tokenizer",
                           "response_format")
    return from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)


class Grammar:
    """One request's matcher: the tokens the grammar allows next, in step with the tokens the
    loop emitted. Only `accept` moves it (one emitted token at a time); `valid_prefix` and
    `forced` look ahead without moving it, so a draft the verify rejects never reaches it and
    there is nothing to take back when the caches roll back."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, n_vocab: int):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"'response_format': {self.matcher.get_error()}",
                               "response_format")
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._bits = allocate_token_bitmask(1, n_vocab)
        self.eos = tokenizer.eos_token
        self.accepted = 0  # tokens consumed

    def mask(self) -> np.ndarray | None:
        """Booleans [n_vocab]: the tokens allowed next (EOS only where the grammar accepts);
        None where the grammar leaves the next token free (a tool-call grammar before a call
        starts, tool_grammar.py): the row is used as it is."""
        return self.mask_of(self.matcher)

    def constrained(self) -> bool:
        """Whether the grammar holds the next token (a tool-call grammar before a call starts
        does not: `mask()` is None there)."""
        return True

    def mask_of(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        fill_next_token_bitmask(matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.n_vocab]
        allowed = bits.astype(bool)
        if not allowed.any():  # (a matcher in error: end the output rather than choose blind)
            allowed[self.eos] = True
        return allowed

    def accept(self, token: int) -> None:
        """The loop emitted `token` (chosen from this mask's allowed tokens)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused emitted token {token}: "
                               f"{self.matcher.get_error()}")
        self.accepted += 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows next (nothing consumed)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces next whatever the model says (a key, punctuation):
        llguidance's fast-forward tokens, drafted at no cost (nothing consumed)."""
        return [t for t in self.matcher.compute_ff_tokens() if t < self.n_vocab]

    def forced_after(self, tokens: list[int]) -> list[int]:
        """The tokens the grammar would force after `tokens` (allowed ones: the loop cut its
        draft with `valid_prefix` first), looked ahead on a copy of the matcher (nothing
        consumed); [] where it refuses them. A draft like any other: each is verified."""
        ahead = self.matcher.deep_copy()
        if not ahead.consume_tokens(tokens):
            return []
        return [t for t in ahead.compute_ff_tokens() if t < self.n_vocab]

    def rollback(self, n: int) -> None:
        """Take back the last n accepted tokens."""
        if n > 0:
            self.matcher.rollback(n)
            self.accepted -= n

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow."""
        return self.matcher.is_stopped()
