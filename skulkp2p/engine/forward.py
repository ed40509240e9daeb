"""The forward seam: the decode loop asks for logits of a few tokens and for a rollback.

`LocalForward` runs every layer in this process. A ring traversal implements the same methods, so
the decode loop never knows where its layers are. When a drafter needs the trunk's hidden states
(an MTP head), `hidden` names which one ("after" or "before" the final norm) and the forward keeps
the rows of its last call in `last_hidden` (prefill included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from skulkp2p.engine import caches
from skulkp2p.engine.trunk import Trunk


class Forward(Protocol):
    last_hidden: mx.array | None

    def prefill(self, tokens: list[int]) -> None: ...
    def __call__(self, tokens: list[int]) -> mx.array: ...
    def rollback(self, keep: int, dropped: int) -> None: ...


class LocalForward:
    """All layers here. `__call__` returns logits [w, V] for w tokens appended to the cache."""

    def __init__(self, model: nn.Module, prefill_step: int = 2048, hidden: str | None = None,
                 interrupt: Callable[[], None] | None = None):
        if hidden not in (None, "after", "before"):
            raise ValueError(f"hidden must be 'after' or 'before', got {hidden!r}")
        self.model = model
        self.trunk = Trunk(model) if hidden else None
        self.hidden = hidden
        self.cache = make_prompt_cache(model)
        self.prefill_step = prefill_step
        self.last_hidden: mx.array | None = None
        self._snapshot: caches.Snapshot | None = None
        self.interrupt = interrupt  # raises to abandon a long prefill between chunks

    def _run(self, tokens: list[int], logits: bool) -> mx.array | None:
        inputs = mx.array(tokens)[None]
        if self.trunk is None:
            return self.model(inputs, cache=self.cache)[0] if logits else self._body_only(inputs)
        if self.hidden == "before":
            h = self.trunk.hidden_before_norm(inputs, self.cache)
            normed = self.trunk.norm(h)
        else:
            h = normed = self.trunk.body(inputs, self.cache)
        self.last_hidden = h[0]
        return self.trunk.head(normed)[0] if logits else None

    def _body_only(self, inputs: mx.array) -> None:
        self.model(inputs, cache=self.cache)
        return None

    def prefill(self, tokens: list[int]) -> None:
        # Same chunking as mlx-lm's generate_step, so the cache holds bit-identical keys/values.
        rows = []
        for start in range(0, len(tokens), self.prefill_step):
            if self.interrupt is not None:
                self.interrupt()
            self._run(tokens[start:start + self.prefill_step], logits=False)
            if self.last_hidden is not None:
                rows.append(self.last_hidden)
            mx.eval([c.state for c in self.cache], rows)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    def __call__(self, tokens: list[int]) -> mx.array:
        if len(tokens) > 1 and caches.needs_snapshot(self.cache, len(tokens)):
            self._snapshot = caches.snapshot(self.cache, tokens)
        else:
            self._snapshot = None
        logits = self._run(tokens, logits=True)
        mx.eval(logits, self.last_hidden) if self.last_hidden is not None else mx.eval(logits)
        return logits

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        snap, self._snapshot = self._snapshot, None

        def replay(n: int) -> None:
            self.model(mx.array(snap.tokens_for_replay[:n])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        caches.rollback(self.cache, snap, dropped, replay, keep)
