"""The forward seam: the decode loop asks for logits of a few tokens and for a rollback.

There is one way to run layers: a `StageModel` (stage.py) runs a contiguous slice of them over a
`StageCache`, one request's caches with their checkpoint and rollback rules (caches.py). A
`LocalForward` is a stage that holds every layer; a `RingForward` (parallel/ring/traversal.py)
is the last stage of a ring, with the other stages one traversal away; a `TensorForward`
(parallel/tensor/group.py) reaches a tensor-parallel group; a `RowForward`
(batching/row_forward.py) is one request's row of a batch. All implement `Forward`, so the
decode loop never knows where its layers are. When a drafter needs the trunk's hidden states
(an MTP head), `hidden` names which one ("after" or "before" the final norm) and the forward
keeps the rows of its last call in `last_hidden` (prefill included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from skulkp2p.engine.cache import caches
from skulkp2p.engine.cache.caches import CacheEntry
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.cpu.weight_first import verify_rows
from skulkp2p.engine.model.stage import StageModel, StageSpan
from skulkp2p.engine.model.tree import check_path, compact_kv, tree_capable
from skulkp2p.engine.model.trunk import Trunk, check_hidden


class Forward(Protocol):
    """What the decode loop (engine/decode/loop.py), the request around it (generate.py: the
    prefix cache) and the drafters ask of the forward a request decodes on. The first members
    are what every forward does; the rest default to a forward without the capability: it
    verifies chains only, has no lazy steps, holds every cache here and frees nothing on close.
    (A row of a batch is a `RowForward`, engine/batching/row_forward.py: its drafters see the
    batch there.) A forward that imports mlx lazily (a ring's, a tensor group's)
    implements them all itself."""

    # The trunk's hidden rows of the last call (prefill included) when `hidden` asks for them.
    last_hidden: mx.array | None = None
    # Which hidden state it keeps: "after" or "before" the final norm, or None (none kept).
    hidden: str | None = None

    def prefill(self, tokens: list[int]) -> None:
        """Append `tokens` to the caches (no logits)."""
        ...

    def __call__(self, tokens: list[int]) -> mx.array:
        """Logits [w, V] of w tokens appended to the caches."""
        ...

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        ...

    @property
    def cache(self) -> list[CacheEntry]:
        """The request's caches as one-request caches: what the prefix cache keeps (a tensor
        group's: none here, its ranks keep theirs)."""
        ...

    @property
    def trees(self) -> bool:
        """Whether it verifies token trees now (attention-only families)."""
        return False

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """Logits [w, V] of a token tree (node 0 the pending token; `parents` as
        engine/model/tree.py), appended to the caches; `keep_path` then keeps the accepted
        path. Only where `trees`."""
        raise ValueError("this forward verifies chains only")

    def keep_path(self, path: list[int]) -> None:
        """Keep node 0 and the accepted path of the last tree, in order; `last_hidden` becomes
        their rows (what a chain verify of that path leaves)."""
        raise ValueError("this forward verifies chains only")

    def may_run_ahead(self) -> bool:
        """Whether `lazy_step` may build the next step now, before the current one is handed
        out (the loop's pipelined greedy steps): False for a forward without lazy steps, and
        for a batch row once another request is on the model."""
        return False

    def lazy_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        """Logits [1, V] of one token given as an mx array [1], appended to the caches, and
        the trunk's hidden row of the token when `hidden` asks for it, NOT evaluated. Only
        while `may_run_ahead`."""
        raise NotImplementedError("this forward has no lazy steps")

    def end_run_ahead(self) -> None:
        """The loop left its pipelined steps: nothing of this forward is in flight now."""
        return None

    def restore(self, cache: list[CacheEntry], tokens: list[int], key: list[int]) -> int:
        """Go on from caches that hold `tokens` (a prefix-cache hit; `key` is the entry's key,
        `tokens` and the next one); how many tokens are now held (0: the prompt is prefilled
        whole, as where the other stages of a ring miss)."""
        return 0

    def keep_in_group(self, key: list[int], disk: bool = True) -> int | None:
        """Before the prefix cache keeps the caches held here under `key`: have those held
        elsewhere kept now (a tensor group's ranks keep their slices; on their disks too
        unless `disk` is False). The bytes kept elsewhere (0: none held elsewhere), or None
        when some holder could not keep them (then no entry: a hit would miss there)."""
        return 0

    def share_store(self, key: list[int], disk: bool = True) -> None:
        """After the prefix cache kept the caches here under `key`: have the other stages of a
        ring keep theirs under it too (with the next frame or the end); `disk`: on their disk
        too (False: the request said no)."""
        return None

    def close(self) -> None:
        """The request ended, however: free what it holds elsewhere (a ring's stages, a
        batch's row)."""
        return None


class _Offset(Protocol):
    offset: int


class StageCache:
    """One request's caches on one stage. A multi-row verify that the caches could not trim
    back (recurrent state, a rotating cache about to wrap) is snapshotted first; a rollback
    trims, or restores the snapshot and replays the kept inputs (tokens on a first stage, hidden
    rows on the others)."""

    def __init__(self, stage: StageModel):
        self.stage = stage
        self.cache: list[CacheEntry] = make_prompt_cache(stage.model)
        self._snapshot: caches.Snapshot | None = None
        self._inputs: list[int] | mx.array | None = None  # a snapshotted verify's, to replay
        self._tree_start = 0  # where the last tree verify wrote its node 0
        self._tree: list[int] | None = None  # that tree's parents, until its path is kept
        # Whose forwards these are for the OpenBLAS thread policy (blas_threads.waited): None,
        # the calling thread; a batch scheduler sets itself (its rows' forwards never overlap).
        self.owner: object | None = None

    def reset(self) -> None:
        self.cache = make_prompt_cache(self.stage.model)
        self._snapshot = None

    def adopt(self, cache: list[CacheEntry]) -> None:
        """Go on from these caches (fresh ones from the prefix cache, one per layer here)."""
        if len(cache) != len(self.cache):
            raise ValueError(f"{len(cache)} caches for a stage of {len(self.cache)} layers")
        self.cache = cache
        self._snapshot = None

    def run(self, x: list[int] | mx.array, *, verify: bool, logits: bool = False,
            hidden: str | None = None, tree: list[int] | None = None
            ) -> tuple[mx.array | None, mx.array | None]:
        width = len(x) if isinstance(x, list) else x.shape[0]
        self._snapshot = None
        self._tree = None
        if tree is not None:
            if caches.needs_snapshot(self.cache, width):
                raise ValueError("token trees need plain KV caches (attention-only layers)")
            if len(tree) != width:
                raise ValueError(f"a tree of {len(tree)} parents for {width} inputs")
            self._tree_start = cast(_Offset, self.cache[0]).offset  # (plain KV caches)
            self._tree = list(tree)
            with blas_threads.waited(width, owner=self.owner), verify_rows(width > 1):
                out, h = self.stage.run(x, self.cache, logits=logits, hidden=hidden, tree=tree)
                mx.eval([a for a in (out, h) if a is not None])
            return out, h
        if verify and width > 1 and caches.needs_snapshot(self.cache, width):
            self._snapshot = caches.snapshot(self.cache, width)
            self._inputs = x
        # The OpenBLAS thread count for this forward (blas_threads.py): this thread waits on it.
        # A verify's products go weight-first (weight_first.py); a prefill's stay mlx-lm's.
        with blas_threads.waited(width, owner=self.owner), verify_rows(verify and width > 1):
            out, h = self.stage.run(x, self.cache, logits=logits, hidden=hidden)
            results = [a for a in (out, h) if a is not None]
            # A call with nothing to return (prefill) still evaluates its caches now, chunk by
            # chunk.
            mx.eval(results or [c.state for c in self.cache])
        return out, h

    def rollback(self, keep: int, dropped: int) -> None:
        snap, self._snapshot = self._snapshot, None

        def replay(n: int) -> None:
            assert self._inputs is not None  # (a snapshot keeps its inputs)
            self.stage.run(self._inputs[:n], self.cache, logits=False)
            mx.eval([c.state for c in self.cache])
        caches.rollback(self.cache, snap, dropped, replay, keep)

    def keep_path(self, path: list[int]) -> None:
        """After a tree verify: keep node 0 and the accepted path's nodes, in order. The path
        must be one of the last tree's (a ring stage gets it in a frame: checked, not trusted)."""
        check_path(self._tree, path)
        self._tree = None
        for entry in self.cache:
            compact_kv(cast(KVCache, entry), self._tree_start, path)  # (trees: plain KV caches)


def whole_model_stage(model: nn.Module) -> StageModel:
    """A stage that holds every layer of `model`."""
    n = len(Trunk(model).body.layers)
    return StageModel(model, StageSpan(0, n, n))


class LocalForward(Forward):
    """All layers here. `__call__` returns logits [w, V] for w tokens appended to the cache."""

    def __init__(self, model: nn.Module, prefill_step: int = 2048, hidden: str | None = None,
                 interrupt: Callable[[], None] | None = None):
        check_hidden(hidden)
        self.model = model
        self.local = StageCache(whole_model_stage(model))
        self.hidden = hidden
        self.prefill_step = prefill_step
        self.last_hidden: mx.array | None = None
        self.interrupt = interrupt  # raises to abandon a long prefill between chunks
        self._trees = tree_capable(model)

    @property
    def cache(self) -> list[CacheEntry]:
        return self.local.cache

    @property
    def trees(self) -> bool:
        return self._trees

    def reset(self) -> None:
        """Empty caches (a drafter whose history diverged starts over)."""
        self.local.reset()

    def restore(self, cache: list[CacheEntry], tokens: list[int], key: list[int]) -> int:
        """Go on from caches that hold `tokens` (a prefix-cache hit; `key` is the entry's key,
        `tokens` and the next one); how many tokens are now held (a ring's stages may miss,
        see RingForward.restore)."""
        self.local.adopt(cache)
        return len(tokens)

    def prefill(self, tokens: list[int]) -> None:
        # Same chunking as mlx-lm's generate_step, so the cache holds bit-identical keys/values.
        rows = []
        for start in range(0, len(tokens), self.prefill_step):
            if self.interrupt is not None:
                self.interrupt()
            _, h = self.local.run(tokens[start:start + self.prefill_step], verify=False,
                                  hidden=self.hidden)
            if h is not None:
                rows.append(h)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    def __call__(self, tokens: list[int]) -> mx.array:
        logits, h = self.local.run(tokens, verify=True, logits=True, hidden=self.hidden)
        assert logits is not None  # (asked for)
        if h is not None:
            self.last_hidden = h
        return logits

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        self.local.rollback(keep, dropped)

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """Logits [w, V] of a token tree (node 0 the pending token; `parents` as
        engine/model/tree.py), appended to the cache; `keep_path` then keeps the accepted path."""
        if not self.trees:
            raise ValueError("this model verifies chains only (not an attention-only family)")
        logits, h = self.local.run(tokens, verify=True, logits=True, hidden=self.hidden,
                                   tree=parents)
        assert logits is not None  # (asked for)
        if h is not None:
            self.last_hidden = h
        return logits

    def keep_path(self, path: list[int]) -> None:
        """Keep node 0 and the accepted path of the last tree; `last_hidden` becomes their
        rows, in order (what a chain verify of that path leaves)."""
        self.local.keep_path(path)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[mx.array([0, *path])]

    def lazy_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        """Logits [1, V] of one token given as an mx array [1], appended to the cache, and the
        trunk's hidden row of the token when this forward keeps them (`hidden`), NOT evaluated:
        decode's pipelined greedy steps build step n+1 while step n runs (as mlx-lm's
        generate_step does), and hand the hidden row to a quiet drafter as `last_hidden` once
        the step has run. The cache may hold one token past the last one the caller consumed
        (decode takes it back with a rollback when it must)."""
        blas_threads.step()  # the OpenBLAS thread count for pipelined steps (blas_threads.py)
        logits, h = self.local.stage.run(token, self.local.cache, logits=True, hidden=self.hidden)
        assert logits is not None  # (asked for)
        return logits, h

    def may_run_ahead(self) -> bool:
        """Always: the caches are this request's own."""
        return True
