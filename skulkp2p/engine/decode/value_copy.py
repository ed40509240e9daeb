"""Values copied from the request's text, drafted under a grammar: lookup that does not tell a
word that follows a space from the same word that follows a quote.

A structured output copies most of its values from the text it was given (a name, a city, a
number, a row of a table), but not token for token: in the text a word follows a space (" Rot",
"ter", "dam"), inside a JSON string it follows the opening quote ("Rot", "ter", "dam"). So
lookup by token ids finds no match at a value's first tokens, and the suffix drafter beside a
head (which needs a match of two tokens) finds none until the value is nearly written. Here a
token and the same text with a leading space compare equal: after a value's first token (the
verify's own token, after the key the grammar forced) the rest of the value is drafted from the
text, and the tokens the grammar forces after it (the closing quote's key) join the same round
(loop._constrained_round). Drafts are the text's own tokens, each verified as any draft.

Pure Python over the grammar's tokenizer (llguidance's view of it): no mlx.
"""

from __future__ import annotations

import threading

import llguidance

# The longest key compared (tokens at the end of the history) and the most tokens drafted; a
# one-token key (most often a value's first token) is a weaker guess: it drafts fewer. (Replayed
# over plain's outputs of the bench's structured set, 4 after a one-token key beat 6, 8 and 12.)
MAX_KEY = 3
MAX_DRAFT = 12
MAX_DRAFT_ONE_KEY = 4
# Only the most recent tokens are searched: a request's text and what it wrote so far.
WINDOW = 4096

_classes: dict[int, tuple[llguidance.LLTokenizer, dict[int, int]]] = {}
_lock = threading.Lock()


def space_classes(tokenizer: llguidance.LLTokenizer) -> dict[int, int]:
    """For each token whose text is a space followed by another token's text, that token's id
    (" Rot" -> "Rot"); built once per tokenizer (about 0.1 s for a 49k vocabulary)."""
    with _lock:
        held = _classes.get(id(tokenizer))
        if held is not None and held[0] is tokenizer:
            return held[1]
    texts = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
    by_text: dict[bytes, int] = {}
    for i, text in enumerate(texts):
        by_text.setdefault(text, i)
    classes = {}
    for i, text in enumerate(texts):
        if len(text) > 1 and text[:1] == b" ":
            bare = by_text.get(text[1:])
            if bare is not None:
                classes[i] = bare
    with _lock:
        _classes[id(tokenizer)] = (tokenizer, classes)  # (the tokenizer kept: its id stays its)
    return classes


class SpaceBlindLookup:
    """Prompt lookup over the history with tokens compared by their text less a leading space:
    the continuation, in the history's own tokens, of the most recent earlier occurrence of the
    history's last MAX_KEY (down to 1) tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.classes = space_classes(tokenizer)

    def propose(self, history: list[int], k: int) -> list[int]:
        k = min(k, MAX_DRAFT)
        if k <= 0:
            return []
        window = history[-WINDOW:]
        classes = self.classes
        seen = [classes.get(t, t) for t in window]
        n = len(seen)
        for size in range(MAX_KEY, 0, -1):
            if n <= size:
                continue
            key = seen[-size:]
            last = key[-1]
            for start in range(n - size - 1, -1, -1):
                if seen[start + size - 1] == last and seen[start:start + size] == key:
                    take = k if size > 1 else min(k, MAX_DRAFT_ONE_KEY)
                    return window[start + size:start + size + take]
        return []
