"""Turn generated tokens into text deltas, cutting at stop strings.

Text is released only when it is final: a trailing incomplete UTF-8 sequence, or a tail that could
still grow into a stop string, is held back until the next token settles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    """What is read of a tokenizer here: the text of a run of tokens."""

    def decode(self, tokens: Sequence[int], /) -> str: ...


class TextAssembler:
    def __init__(self, tokenizer: Detokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.released = ""  # text already handed out
        self.stopped = False
        self.stop_sequence: str | None = None  # the stop string that ended the text

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens)

    def add(self, token: int) -> str:
        """Add one token; return the newly final text (may be empty). Sets `stopped` on a stop."""
        self.tokens.append(token)
        text = self._decode()
        if self.stops:
            # A stop may span tokens, but not text already released (that ended before any stop).
            start = max(0, len(self.released) - max(len(s) for s in self.stops) + 1)
            hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
            if hits:
                at, self.stop_sequence = min(hits, key=lambda hit: hit[0])
                self.stopped = True
                return self._release(text[:at])
        safe = text.rstrip("\ufffd")
        for s in self.stops:
            for n in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:n]):
                    safe = safe[:-n]
                    break
        return self._release(safe)

    def finish(self) -> str:
        """Everything not yet released, at the end of generation."""
        if self.stopped:
            return ""
        return self._release(self._decode())

    def _release(self, text: str) -> str:
        if not text.startswith(self.released) or len(text) <= len(self.released):
            # Decoding more tokens rewrote earlier text (rare tokenizer clean-ups): release nothing
            # now; finish() settles the difference only when it extends the released text.
            return ""
        delta = text[len(self.released):]
        self.released = text
        return delta

    @property
    def text(self) -> str:
        return self.released
