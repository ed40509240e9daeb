"""A pipeline ring in this process (tests of rings, batched rings and trees on rings): the tiny
models' stage slices, loaded once per session, and a ring of them behind an InProcessLink (every
frame through the wire codec) whose last stage's LoadedModel makes a RingForward per request."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from skulkp2p.engine.cache.prefix_cache import PrefixCache
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.model.stage import StageModel, StageSpan
from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker
from skulkp2p.engine.runner.mlx_engine import MlxEngine

# Layer spans of a 4-layer tiny model per ring size (the last span runs to the model's end).
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}

_loaded: dict = {}


def full(path: Path):
    """The whole tiny model at `path`, float32, loaded once per session."""
    if (path, None) not in _loaded:
        _loaded[(path, None)] = load_model(path, path.name, dtype="float32")
    return _loaded[(path, None)]


def stages(path: Path, n: int):
    """The model at `path` as the n stage slices of SPLITS[n], loaded once per session."""
    if (path, n) not in _loaded:
        total = len(full(path).model.layers)
        spans = [StageSpan(a, b if b < 4 else total, total) for a, b in SPLITS[n]]
        _loaded[(path, n)] = [load_model(path, path.name, dtype="float32", span=s)
                              for s in spans]
    return _loaded[(path, n)]


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
