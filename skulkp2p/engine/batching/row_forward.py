"""One request's forward in a model's batch: `RowForward`, the decode loop's `Forward` on a row.

The decode loop (decode.py) asks it for the logits of its tokens and for rollbacks exactly as it
asks a `LocalForward`; it hands the tokens in to its batch (scheduler.py: `BatchScheduler`, the
rows' caches and the step that runs them together) and waits for that step, or runs them on the
request's own caches while the request is alone on the model. Prefilling the prompt in chunks,
joining and leaving the batch, a recurrent row's replay after a rejected verify and a ring's row
are the row's side of what scheduler.py's docstring describes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from skulkp2p.engine.batching.batch_view import BatchView, StepPacking
from skulkp2p.engine.cache.batch_cache import RowLengths, RowsArraysCache, RowsKVCache
from skulkp2p.engine.cache.caches import CacheEntry
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.model.forward import Forward, StageCache
from skulkp2p.engine.model.stage import StageModel
from skulkp2p.engine.model.tree import validate_parents
from skulkp2p.engine.model.trunk import check_hidden
from skulkp2p.engine.parallel.ring.frames import RingError

if TYPE_CHECKING:
    from skulkp2p.engine.batching.head_batch import DraftHead, HeadRows
    from skulkp2p.engine.parallel.ring.traversal import RingForward


class RowsBatch(Protocol):
    """What a row needs of its batch (scheduler.BatchScheduler, which builds the rows: a
    protocol here, so this module does not import the scheduler's). Called with the batch's
    lock held."""
    stage: StageModel
    trees: bool
    max_batch: int
    prefill_chunk: int
    cond: threading.Condition
    rows: RowLengths
    layers: list[RowsKVCache | RowsArraysCache]
    recurrent: list[RowsArraysCache]
    active: list[RowForward]
    ahead: RowForward | None
    requests: int
    steps: int
    leaves: collections.deque[int]
    replays: int
    replay_peak: int
    solo_steps: int
    lazy_steps: int
    pack_ragged: bool
    mixed_chunk: int

    @property
    def packing(self) -> StepPacking | None: ...

    def head_rows(self, head: DraftHead) -> HeadRows:
        """The batched head caches of `head`'s drafting rows."""
        ...

    def heads_if_ready(self) -> None:
        """Run the pending head calls once no row can still hand one in."""
        ...

    def join(self, row: RowForward) -> None:
        """Copy the row's own caches into a new row of the batch."""
        ...

    def leave(self, row: RowForward) -> None:
        """Drop the row from the batch (its request ended)."""
        ...

    def settle(self) -> None:
        """Evaluate the rows' buffers now, on this thread."""
        ...

    def step_if_ready(self) -> None:
        """Run the batched step once every row has handed its tokens in."""
        ...

    def prefill(self, row: RowForward, tokens: list[int]) -> tuple[bool, mx.array | None]:
        """Prefill one chunk of the row's prompt with the other joining prompts' chunks:
        whether it ran (False: withdrawn to ride in the decoding rows' steps), and its hidden
        rows when the row asks for them."""
        ...


class RowForward(Forward):
    """One request's forward in a batch (the decode loop's `Forward`); its request's drafters
    see the batch through it (`batch_view`, `drafts`, `head_batch`). Its methods are called with
    the scheduler's lock held (MlxEngine holds it while the request's code runs)."""

    def __init__(self, scheduler: RowsBatch, hidden: str | None,
                 interrupt: Callable[[], None] | None, ring: RingForward | None = None):
        check_hidden(hidden)
        self.scheduler = scheduler
        self.hidden = hidden
        self.interrupt = interrupt
        self.ring = ring  # the request's own link to the ring's other stages, on a ring
        # The prompt's caches until the row joins (on a ring, its RingForward's: it prefills).
        self.local = ring.local if ring is not None else StageCache(scheduler.stage)
        self.local.owner = scheduler  # its forwards run in turns with the batch's (the lock)
        self.last_hidden: mx.array | None = None
        self.submitted: list[int] | None = None
        self.submitted_tree: list[int] | None = None  # the submitted tokens' parents, a tree
        self.result: mx.array | None = None
        self.result_hidden: mx.array | None = None
        self.error: BaseException | None = None
        # Tokens this row's last step ran (replay included), and the ones its next step runs
        # first: kept tokens of a partly rejected verify, whose recurrent state was restored.
        self.last_step: list[int] = []
        self.replay: list[int] = []
        self.width = 1  # tokens the decode loop verified in its last call (drafts + 1)
        self.drafts = False  # a drafter decodes on this row (set by its gate: gates.py)
        self.prefill_waits = 0  # steps of the decoding rows run between this prompt's chunks
        self.prefill_shared = 0  # the most prompts one of this prompt's prefill forwards ran
        self.joined = False
        self.closed = False
        self.prefilling = False  # the row's tokens handed in are a prompt's chunk (no logits)
        self._last_width = 0  # tokens of the last step (a tree's, for keep_path)

    def batch_view(self) -> BatchView:
        """The other rows of this row's next forward, for its gate: the widths they handed in
        for it, else the widths of their last verify."""
        # (a prompt's chunk riding in the step is left out: its row wants no logits, runs
        # packed, and is gone from the next steps once its prompt is in)
        others = [r for r in self.scheduler.active if r is not self and not r.prefilling]
        return BatchView(tuple(r.width if r.submitted is None else len(r.submitted)
                               for r in others), sum(r.drafts for r in others),
                         self.scheduler.packing)

    @property
    def index(self) -> int:
        return self.scheduler.active.index(self)

    def head_batch(self, head: DraftHead) -> HeadRows | None:
        """Where this row's MTP head drafts together with the other rows' (engine/
        head_batch.py), once the row is in the batch; None while it runs alone."""
        return self.scheduler.head_rows(head) if self.joined and not self.closed else None

    @property
    def cache(self) -> list[CacheEntry]:
        """The request's caches as one-request caches (copies once it has joined): what the
        prefix cache keeps at the end of the request."""
        if not self.joined:
            return self.local.cache
        i = self.index
        length = self.scheduler.rows.lengths[i]
        singles: list[CacheEntry] = [layer.extract(i, length) for layer in self.scheduler.layers]
        if not self.replay:
            return singles
        # Tokens waiting to run again at the front of the next step: run them on the copies.
        held = StageCache(self.scheduler.stage)
        held.owner = self.scheduler
        held.adopt(singles)
        held.run(self.replay, verify=False)
        return held.cache

    def restore(self, cache: list[CacheEntry], tokens: list[int], key: list[int]) -> int:
        """Go on from a prefix-cache hit (before the prefill); on a ring, only if every other
        stage restores its own entry too (RingForward.restore)."""
        if self.ring is not None:
            return self.ring.restore(cache, tokens, key)
        self.local.adopt(cache)
        return len(tokens)

    def share_store(self, key: list[int], disk: bool = True) -> None:
        """On a ring, the other stages keep their caches under `key` too (the next frame)."""
        if self.ring is not None:
            self.ring.share_store(key, disk)

    def alone(self) -> bool:
        """Whether this row may decode on its own caches: it has not joined the batch, no row
        has, and no other request is on the model."""
        sched = self.scheduler
        return (self.ring is None and not self.joined and not sched.active
                and sched.requests <= 1)

    def may_run_ahead(self) -> bool:
        """Whether plain greedy may build this row's next step before the current one is
        handed out (decode's pipelined path): only while the row is alone. A row that stops
        running ahead lets an arriving request go on (BatchScheduler.wait_settled)."""
        ok = self.alone()
        if not ok and self.scheduler.ahead is self:
            self.scheduler.ahead = None
            self.scheduler.cond.notify_all()
        return ok

    def lazy_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        """One lazy step on the row's own caches (see LocalForward.lazy_step), while alone:
        until `end_run_ahead`, an arriving request waits for it (BatchScheduler.wait_settled)."""
        sched = self.scheduler
        sched.ahead = self
        sched.lazy_steps += 1
        blas_threads.step(owner=sched)  # the OpenBLAS thread count (blas_threads.py)
        logits, h = self.local.stage.run(token, self.local.cache, logits=True, hidden=self.hidden)
        assert logits is not None  # (asked for)
        return logits, h

    def end_run_ahead(self) -> None:
        """Nothing of this row is in flight any more (decode left a pipelined stretch)."""
        if self.scheduler.ahead is self:
            self.scheduler.ahead = None
            self.scheduler.cond.notify_all()

    def mixes(self) -> bool:
        """Whether this prompt's next chunk rides in the decoding rows' next step: rows decode,
        one is free for it (or it has joined: its caches are in the batch), it wants no hidden
        rows (a head drafter's, which begins before its row joins), the steps pack (a chunk
        padding every row to its width would cost more than the step it saves) and no layer
        is recurrent (its state would have to join before the prompt is in)."""
        sched = self.scheduler
        if (not sched.mixed_chunk or self.ring is not None or self.hidden is not None
                or not sched.pack_ragged or sched.recurrent):
            return False
        return self.joined or (bool(sched.active) and len(sched.active) < sched.max_batch)

    def prefill(self, tokens: list[int]) -> None:
        sched = self.scheduler
        rows = []
        start = n = 0
        while start < len(tokens):
            if self.interrupt is not None:
                self.interrupt()
            if self.mixes():
                piece = tokens[start:start + sched.mixed_chunk]
                self._ride(piece)
                start += len(piece)
                continue
            if n and sched.active:  # let the decoding rows take one step between chunks
                def stepped(seen: int = sched.steps) -> bool:
                    return sched.steps != seen or not sched.active
                sched.cond.wait_for(stepped)
                self.prefill_waits += 1
                if self.interrupt is not None:  # (cancelled while the rows stepped)
                    self.interrupt()
            n += 1
            piece = tokens[start:start + sched.prefill_chunk]
            ran, h = sched.prefill(self, piece)
            if not ran:  # (withdrawn: it rides in the decoding rows' steps instead)
                continue
            if h is not None:
                rows.append(h)
            start += len(piece)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    def _ride(self, tokens: list[int]) -> None:
        """Prefill `tokens` as this row's part of the decoding rows' next step (no logits)."""
        sched = self.scheduler
        if not self.joined:
            sched.join(self)
            self.joined = True
        self.prefilling = True
        try:
            self._step_with(tokens, None)
        finally:
            self.prefilling = False

    @property
    def trees(self) -> bool:
        return self.scheduler.trees

    def __call__(self, tokens: list[int]) -> mx.array:
        return self._submit(tokens, None)

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """Logits of a token tree (engine/model/tree.py) in the batch's next forward; `keep_path`
        then keeps the accepted path in this row's caches."""
        if not self.trees:
            raise ValueError("this model verifies chains only (not an attention-only family)")
        validate_parents(parents)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        return self._submit(tokens, parents)

    def keep_path(self, path: list[int]) -> None:
        """Keep node 0 and the accepted path of this row's last tree, in order."""
        if not self.joined:  # the tree ran alone, on the row's own caches
            self.local.keep_path(path)
        else:
            sched = self.scheduler
            i = self.index
            lengths = list(sched.rows.lengths)
            start = lengths[i] - self._last_width
            for layer in sched.layers:
                assert isinstance(layer, RowsKVCache)  # (trees: attention-only layers)
                layer.compact_row(i, start, path)
            lengths[i] = start + 1 + len(path)
            sched.rows.set(lengths)
            sched.settle()
        if self.ring is not None:  # the other stages keep the path with the next frame
            self.ring.note_keep(path)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[mx.array([0, *path])]

    def _submit(self, tokens: list[int], parents: list[int] | None) -> mx.array:
        sched = self.scheduler
        if self.alone():  # as a LocalForward: the same forward, no batch around it
            logits, h = self.local.run(tokens, verify=True, logits=True, hidden=self.hidden,
                                       tree=parents)
            sched.solo_steps += 1
            assert logits is not None  # (asked for)
            if h is not None:
                self.last_hidden = h
            return logits
        if not self.joined:
            # Wait for a free row (a batch at max_batch admits the next row when one leaves).
            sched.cond.wait_for(lambda: len(sched.active) < sched.max_batch)
            sched.join(self)
            self.joined = True
        self.width = len(tokens)
        if self.replay and len(tokens) > 1:
            # The kept tokens of a rejected verify run in a step of their own first: a step that
            # also verified drafts could be rejected in turn, and the state to restore would
            # then be the one before these tokens (the replay would grow round after round).
            self._step_with(self.replay, None)
            self.replay = []
        skip = len(self.replay)  # (with one token, nothing to reject: they go first in its step)
        # (replays are of recurrent rows, which verify chains: a tree never has one in front)
        logits, hidden = self._step_with(self.replay + list(tokens), parents)
        self.replay = []
        if hidden is not None:
            self.last_hidden = hidden[skip:]
        return logits[skip:]

    def _step_with(self, tokens: list[int], parents: list[int] | None
                   ) -> tuple[mx.array, mx.array | None]:
        """Hand `tokens` (a tree's when `parents`) in for the next batched step and wait for
        their logits (and hidden rows when asked for)."""
        sched = self.scheduler
        self.result = self.result_hidden = self.error = None
        self.submitted = self.last_step = tokens
        self.submitted_tree = parents
        self._last_width = len(tokens)
        sched.heads_if_ready()  # (this row may be the last the pending head calls waited for)
        sched.step_if_ready()
        sched.cond.wait_for(lambda: self.result is not None or self.error is not None)
        if self.error is not None:
            # A ring breaking stays a RingError (transient: the leader re-places the model),
            # so the API can tell it from a bug in the forward.
            kind = RingError if isinstance(self.error, RingError) else RuntimeError
            raise kind(f"the batched forward failed: {self.error}") from self.error
        logits, hidden = self.result, self.result_hidden
        assert logits is not None  # (no error: the step set it)
        self.result = self.result_hidden = None
        return logits, hidden

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        if dropped <= 0:
            return
        if not self.joined:  # the last call ran alone, on the row's own caches
            self.local.rollback(keep, dropped)
            return
        sched = self.scheduler
        i = self.index
        lengths = list(sched.rows.lengths)
        if sched.recurrent:
            # A recurrent state cannot be cut back: the row's state goes back to before the
            # step, and the tokens it kept run again at the front of its next step.
            lengths[i] -= len(self.last_step)
            self.replay = self.last_step[:len(self.last_step) - dropped]
            sched.replays += len(self.replay)
            sched.replay_peak = max(sched.replay_peak, len(self.replay))
            for layer in sched.recurrent:
                layer.restore_row(i)
            sched.settle()  # built here: the next step may run on another row's thread
        else:
            lengths[i] -= dropped
        sched.rows.set(lengths)
        if self.ring is not None:  # the other stages roll back with the next frame
            self.ring.note_rollback(keep, dropped)

    def close(self) -> None:
        """Leave the batch (the request ended, however): the other rows go on without it."""
        if self.closed:
            return
        self.closed = True
        sched = self.scheduler
        if sched.ahead is self:
            sched.ahead = None
            sched.cond.notify_all()
        if self.ring is not None:
            # The end first: it frees the row on the other stages (keeping its caches when
            # asked) before a step of the remaining rows, sent after it, could drop the row.
            self.ring.close()
        if self.joined:
            sched.leave(self)
        else:
            sched.leaves.append(sched.steps)
