"""LocalForwards that reuse a prompt's prefill across thousands of short seeded decodes
(tests/test_sampling_exactness.py, tests/test_tree_sampling.py)."""

from __future__ import annotations

import copy

import mlx.core as mx

from skulkp2p.engine.cache import caches
from skulkp2p.engine.model.forward import LocalForward


class PrefilledForward(LocalForward):
    """LocalForward that prefills a prompt it has seen before from a copy of its KV cache, so
    thousands of short decodes do not each recompute it. Plain KV caches only."""

    # (id of the model, prompt) -> (the model, kept so its id is never reused; per-layer K, V, n)
    _saved: dict[tuple[int, tuple[int, ...]], tuple[object, list]] = {}

    def prefill(self, tokens: list[int]) -> None:
        key = (id(self.model), tuple(tokens))
        entry = self._saved.get(key)
        if entry is None:
            super().prefill(tokens)
            # Exact-size copies: the next update reallocates instead of writing into them.
            saved = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset)
                     for c in self.cache]
            mx.eval([s[:2] for s in saved])
            self._saved[key] = (self.model, saved)
            return
        for c, (k, v, n) in zip(self.cache, entry[1], strict=True):
            c.keys, c.values, c.offset = k, v, n


class CopiedPrefillForward(LocalForward):
    """LocalForward that prefills a prompt it has seen before (with the same `hidden`) from
    copies of every cache entry (any kind: rotating, KV-shared owners) and of the prefill's
    hidden rows: for statistical tests whose drafter reads the target's live caches (the Gemma 4
    assistant), so that every run still has caches of its own."""

    # (id of the model, hidden, prompt) -> (the model, kept so its id is never reused;
    # the entries, their states, the prefill's hidden rows)
    _saved: dict[tuple[int, str | None, tuple[int, ...]], tuple[object, list, list, object]] = {}

    def prefill(self, tokens: list[int]) -> None:
        key = (id(self.model), self.hidden, tuple(tokens))
        entry = self._saved.get(key)
        if entry is None:
            super().prefill(tokens)
            states = [caches.copy_state(c.state) for c in self.cache]
            mx.eval(states)
            self._saved[key] = (self.model, [copy.copy(c) for c in self.cache], states,
                                self.last_hidden)
            return
        _, kept, states, hidden = entry
        fresh = []
        for c, state in zip(kept, states, strict=True):
            c = copy.copy(c)  # its offsets and window as after the prefill
            c.state = caches.copy_state(state)  # arrays of its own: caches write in place
            fresh.append(c)
        self.local.adopt(fresh)
        self.last_hidden = hidden
