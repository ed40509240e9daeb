"""A pipeline ring in this process (tests of batched rings and of trees on rings): its stages
behind an InProcessLink (every frame through the wire codec) and the last stage's LoadedModel
whose make_forward makes a RingForward per request."""

from __future__ import annotations

import dataclasses

from skulkp2p.engine.mlx_engine import MlxEngine
from skulkp2p.engine.prefix_cache import PrefixCache
from skulkp2p.engine.ring import InProcessLink, RingForward, StageWorker
from skulkp2p.engine.stage import StageModel


class Ring:
    """A ring's stages in this process and its last stage's LoadedModel, whose make_forward
    makes a RingForward per request over one InProcessLink."""

    def __init__(self, parts, term: int = 3, prefix_mb: float = 0):
        cache = (lambda: PrefixCache(int(prefix_mb * 2**20))) if prefix_mb else (lambda: None)
        self.workers = [StageWorker(StageModel(p.model, p.span), term, cache())
                        for p in parts[:-1]]
        self.link = InProcessLink(self.workers)
        self.stage = StageModel(parts[-1].model, parts[-1].span)
        self.forwards: list[RingForward] = []
        self.count = 0

        def make(req, hidden, interrupt) -> RingForward:
            self.count += 1
            fwd = RingForward(self.stage, self.link, term=term, instance="i1",
                              request=f"r{self.count}", hidden=hidden, interrupt=interrupt)
            self.forwards.append(fwd)
            return fwd

        self.last = dataclasses.replace(parts[-1], make_forward=make)

    def engine(self, max_batch: int, prefix_mb: float = 0) -> MlxEngine:
        return MlxEngine(self.last, prefix_mb, memory_tokens=0, max_batch=max_batch)

    def held(self) -> list[int]:
        """Rows and sessions each stage still holds."""
        return [len(w.sessions) + (len(w.rows.requests) if w.rows else 0)
                for w in self.workers]
