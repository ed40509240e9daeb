"""Drafters: propose tokens for the target to verify.

Prompt lookup matches the last n tokens against the prompt and output so far and proposes the
continuation of the most recent match. Free, model-agnostic; it pays on echo work.
"""

from __future__ import annotations

import numpy as np

from skulkp2p.engine.drafting.drafter import InnerDrafter


class PromptLookup(InnerDrafter):
    name = "lookup"

    def __init__(self, max_key: int = 3, min_key: int = 1, search_window: int = 4096):
        self.max_key = max_key
        self.min_key = min_key
        self.search_window = search_window

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        if k <= 0:
            return [], None
        window = history[-self.search_window:]
        n_hist = len(window)
        for n in range(self.max_key, self.min_key - 1, -1):
            if n_hist <= n:
                continue
            key = window[-n:]
            # Most recent earlier occurrence of the key with a full k-token continuation; in a
            # repeating run the very latest match sits near the end and continues only briefly.
            best: list[int] = []
            for start in range(n_hist - n - 1, -1, -1):
                if window[start:start + n] == key:
                    cont = window[start + n:start + n + k]
                    if len(cont) > len(best):
                        best = cont
                    if len(best) == k:
                        break
            if best:
                return list(best), None
        return [], None
