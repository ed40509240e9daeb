"""The forward seam: the decode loop asks for logits of a few tokens and for a rollback.

`LocalForward` runs every layer in this process. A ring traversal implements the same three
methods, so the decode loop never knows where its layers are.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from skulkp2p.engine import caches


class Forward(Protocol):
    def prefill(self, tokens: list[int]) -> None: ...
    def __call__(self, tokens: list[int]) -> mx.array: ...
    def rollback(self, keep: int, dropped: int) -> None: ...


class LocalForward:
    """All layers here. `__call__` returns logits [w, V] for w tokens appended to the cache."""

    def __init__(self, model: nn.Module, prefill_step: int = 2048):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.prefill_step = prefill_step
        self._snapshot: caches.Snapshot | None = None

    def prefill(self, tokens: list[int]) -> None:
        # Same chunking as mlx-lm's generate_step, so the cache holds bit-identical keys/values.
        for start in range(0, len(tokens), self.prefill_step):
            chunk = mx.array(tokens[start:start + self.prefill_step])[None]
            self.model(chunk, cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def __call__(self, tokens: list[int]) -> mx.array:
        if len(tokens) > 1 and caches.needs_snapshot(self.cache):
            self._snapshot = caches.snapshot(self.cache, tokens)
        else:
            self._snapshot = None
        logits = self.model(mx.array(tokens)[None], cache=self.cache)[0]
        mx.eval(logits)
        return logits

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        if dropped <= 0:
            return
        if self._snapshot is None:
            caches.trim(self.cache, dropped)
            return
        # Recurrent state cannot be trimmed: restore the state from before the call and re-run
        # the tokens that were kept.
        kept_tokens = self._snapshot.tokens_for_replay
        caches.restore(self.cache, self._snapshot)
        self._snapshot = None
        if keep:
            self.model(mx.array(kept_tokens[:keep])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
