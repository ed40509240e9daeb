"""Continuous batching for one model: the active requests' forwards run as ONE batched forward.

Each request keeps running the one decode loop (decode.py) in its own thread, with a
`RowForward` as its forward: the loop asks it for the logits of its tokens (pending + draft) and
for a rollback, exactly as it asks a `LocalForward`, and never learns that it runs in a batch.
The batch is assembled at this seam: a row's call hands its tokens to the `BatchScheduler` and
waits; once every active row has handed its tokens in, one forward runs over all of them (rows
of different widths padded on the right, each row at its own length: batch_cache.py), and each
row gets its own logits back. Drafting, accepting and rolling back stay the row's own (the same
code as a request served alone); a rollback is the row's length going down.

One lock (the scheduler's condition) serialises every MLX call on the model: a request's thread
holds it while it runs its loop's own work (choosing tokens, drafting with an MTP head, text and
stop handling) and lets go only while it waits for a step. The forward runs in the thread of the
row whose hand-in completed the batch (or of a row whose leaving did): there is no scheduler
thread to start, stop or wake, and no hand-off between the last row and the forward.

Joining and leaving: a request prefills its prompt on an ordinary per-request cache (a
prefix-cache hit restores into that cache first), in chunks; between chunks it waits for one
step of the rows already decoding, so a long prompt does not stall them. Requests that join
together prefill together: a chunk handed in goes to the back of the model's queue once, every
thread queued meanwhile hands its own chunk in, and the first to come back runs them all as one
forward (rows padded on the right, each at its own length), so a burst of N arrivals costs one
forward per chunk rather than N. Its first verify call copies that cache into a new row. It leaves at its end (EOS, stop, max_tokens, cancellation:
the decode loop's caller closes the forward), and the other rows are gathered at once.

Only models whose every layer holds a plain KV cache batch (llama, qwen2/3 and most dense
families); recurrent or sliding-window layers are served one request at a time (`batchable`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from skulkp2p.engine.batch_cache import RowLengths, RowsKVCache
from skulkp2p.engine.forward import StageCache, whole_model_stage
from skulkp2p.engine.tree import tree_capable, tree_inputs, validate_parents

# A joining prompt prefills in chunks of at most this many tokens, one step of the decoding rows
# between chunks. The same chunks whether alone or not, so a request's caches do not depend on
# what else runs.
BATCH_PREFILL_CHUNK = 512


@dataclasses.dataclass
class PrefillChunk:
    """A chunk of a joining prompt, handed in to be prefilled with the others waiting."""
    row: RowForward
    tokens: list[int]
    done: bool = False
    hidden: mx.array | None = None
    error: BaseException | None = None


class TicketLock:
    """A lock granted in the order it was asked for. Python's own lock lets the thread that
    releases it take it straight back, so a request decoding alone could keep the model from
    one that waits to join; here whoever asked first goes first (admission stays first come
    first served). Works under threading.Condition (it says who owns it).

    A release hands the lock straight to the oldest waiter by opening that waiter's own gate:
    only the thread whose turn it is wakes. (Waking every waiter on every release to check
    its ticket cost a context switch per waiting row per hand-off, several per row per step:
    with 16 rows, hundreds of wake-ups a step.)"""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)  # queued changed (wait_queued)
        self._held = False
        self._owner: int | None = None
        self._gates: collections.deque[threading.Lock] = collections.deque()  # the waiters'

    @property
    def queued(self) -> int:
        """Threads holding or waiting for the lock."""
        return len(self._gates) + self._held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if not self._held:  # (nobody waits while the lock is free: releases hand over)
                self._held, self._owner = True, me
                self._changed.notify_all()
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._gates.append(gate)
            self._changed.notify_all()
        gate.acquire()  # opened by the release that hands the lock to this thread
        with self._mutex:
            self._owner = me
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a TicketLock this thread does not hold")
            self._owner = None
            if self._gates:
                self._gates.popleft().release()  # still held: now by the oldest waiter
            else:
                self._held = False
            self._changed.notify_all()

    def wait_queued(self, n: int, timeout: float) -> bool:
        """Wait until `n` threads hold or wait for the lock (False when `timeout` passed)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.queued >= n, timeout)

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def batchable(model: nn.Module) -> bool:
    """Every layer's cache is a plain KV cache: rows can sit side by side at their own lengths."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


class BatchScheduler:
    """The batch of one model: its rows' caches, and the step that runs them together."""

    def __init__(self, model: nn.Module, max_batch: int, prefill_step: int = 2048):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.stage = whole_model_stage(model)
        self.trees = tree_capable(model)  # rows may verify token trees (engine/tree.py)
        self.max_batch = max_batch
        self.prefill_chunk = min(prefill_step, BATCH_PREFILL_CHUNK)
        self.lock = TicketLock()  # the model's, for every MLX call
        self.cond = threading.Condition(self.lock)
        self.rows = RowLengths()
        self.layers = [RowsKVCache(self.rows) for _ in make_prompt_cache(model)]
        self.active: list[RowForward] = []
        self.steps = 0  # batched forwards run so far
        self.widths: list[int] = []  # the last step's row widths (tests, the cost model)
        self.peak = 0  # the most rows one step has run
        self.ragged = 0  # steps whose rows had different widths (drafts of different depths)
        self.leaves: collections.deque[int] = collections.deque(maxlen=64)  # steps at each leave
        self.joining: list[PrefillChunk] = []  # prompt chunks handed in, not prefilled yet
        self.prefills = 0  # prefill forwards run so far (one per chunk round, however many rows)
        self.prefill_peak = 0  # the most prompts one prefill forward has run

    @property
    def batch_size(self) -> int:
        return len(self.active)

    def forward(self, hidden: str | None = None,
                interrupt: Callable[[], None] | None = None) -> RowForward:
        return RowForward(self, hidden, interrupt)

    # -- called with the lock held --

    def _join(self, row: RowForward) -> None:
        if len(self.active) >= self.max_batch:
            raise RuntimeError(f"batch is full ({self.max_batch} rows)")
        length = row.local.cache[0].offset if row.local.cache else 0
        for layer, single in zip(self.layers, row.local.cache, strict=True):
            layer.append_row(single, length)
        self._settle()  # (built on this thread: see _step)
        self.active.append(row)
        self.rows.set([*self.rows.lengths, length])
        row.local.reset()  # the row's tokens live in the batch now

    def _leave(self, row: RowForward) -> None:
        index = self.active.index(row)
        kept = [i for i in range(len(self.active)) if i != index]
        for layer in self.layers:
            layer.keep_rows(kept)
        self._settle()
        self.rows.set([self.rows.lengths[i] for i in kept])
        del self.active[index]
        self.leaves.append(self.steps)
        self._step_if_ready()
        self.cond.notify_all()

    def _settle(self) -> None:
        """Evaluate the rows' buffers now, on this thread (see _step)."""
        mx.eval([a for c in self.layers for a in c.state if a is not None])

    def _ready(self) -> bool:
        return bool(self.active) and all(r.submitted is not None for r in self.active)

    def _step_if_ready(self) -> None:
        if self._ready():
            self._step()

    def _prefill(self, row: RowForward, tokens: list[int]) -> mx.array | None:
        """Prefill one chunk of `row`'s prompt together with the chunks of every other request
        that hands one in meanwhile; the chunk's hidden rows (when the row asked for them)."""
        chunk = PrefillChunk(row, tokens)
        self.joining.append(chunk)
        if self.lock.queued > 1:
            # Go to the back of the model's queue: every thread queued now (requests that
            # arrived together) hands its chunk in first, and one forward runs them all.
            self.lock.release()
            self.lock.acquire()
        if not chunk.done:  # (else a thread queued before this one ran it)
            self._run_prefills()
        if chunk.error is not None:
            raise RuntimeError(f"the batched prefill failed: {chunk.error}") from chunk.error
        return chunk.hidden

    def _run_prefills(self) -> None:
        chunks, self.joining = self.joining, []
        modes: dict[str | None, list[PrefillChunk]] = {}
        for c in chunks:  # one forward per kind of hidden rows asked for (usually one)
            modes.setdefault(c.row.hidden, []).append(c)
        for hidden, chunks_of_mode in modes.items():
            for group in _packed(chunks_of_mode):
                self._run_prefill_group(group, hidden)

    def _run_prefill_group(self, group: list[PrefillChunk], hidden: str | None) -> None:
        try:
            self._prefill_together(group, hidden)
        except BaseException as e:  # every row of the forward fails with it
            for c in group:
                c.error = e
        for c in group:
            c.done = True
        self.prefills += 1
        self.prefill_peak = max(self.prefill_peak, len(group))

    def _prefill_together(self, group: list[PrefillChunk], hidden: str | None) -> None:
        if len(group) == 1:  # alone: straight on the row's own caches, no copies
            c = group[0]
            _, c.hidden = c.row.local.run(c.tokens, verify=False, hidden=hidden)
            c.row.prefill_shared = max(c.row.prefill_shared, 1)
            return
        # Rows of different lengths (a prefix-cache hit, a later chunk) and widths, padded on
        # the right with the row's last token: padded positions sit past the row's length and
        # are cut off when the row's caches are taken back out.
        lengths = [c.row.local.cache[0].offset for c in group]
        widths = [len(c.tokens) for c in group]
        width = max(widths)
        rows = RowLengths()
        rows.set(lengths)
        layers = [RowsKVCache.of_singles(rows, [c.row.local.cache[j] for c in group], lengths)
                  for j in range(len(self.layers))]
        tokens = [c.tokens + [c.tokens[-1]] * (width - len(c.tokens)) for c in group]
        _, h = self.stage.run_rows(mx.array(tokens), layers, logits=False, hidden=hidden)
        out = []
        for i, (c, n, w) in enumerate(zip(group, lengths, widths, strict=True)):
            c.row.local.adopt([layer.extract(i, n + w) for layer in layers])
            c.hidden = h[i, :w] if h is not None else None
            c.row.prefill_shared = max(c.row.prefill_shared, len(group))
            out += [a for single in c.row.local.cache for a in single.state]
            out += [] if c.hidden is None else [c.hidden]
        mx.eval(out)  # here: other rows' threads read these (see _step)

    def _step(self) -> None:
        rows = self.active
        widths = [len(r.submitted) for r in rows]  # type: ignore[arg-type]
        width = max(widths)
        # Pad on the right with the row's last token: the padded positions are written past
        # the row's length and masked from its real queries; the next step overwrites them.
        tokens = [r.submitted + [r.submitted[-1]] * (width - len(r.submitted))  # type: ignore
                  for r in rows]
        hidden = next((r.hidden for r in rows if r.hidden is not None), None)
        tree = None
        if any(r.submitted_tree is not None for r in rows):
            # One row's tree makes the step a tree forward; the other rows are chains in it.
            shapes = [r.submitted_tree or list(range(-1, len(r.submitted) - 1))  # type: ignore
                      for r in rows]
            tree = tree_inputs(self.rows.lengths, shapes, width)
        try:
            logits, h = self.stage.run_rows(mx.array(tokens), self.layers, hidden=hidden,
                                            tree=tree)
            mx.eval([a for a in (logits, h) if a is not None])
        except BaseException as e:  # every waiting row fails with it, not only this one
            for r in rows:
                r.submitted, r.error = None, e
            self.cond.notify_all()
            raise
        self.rows.set([n + w for n, w in zip(self.rows.lengths, widths, strict=True)])
        out = []
        for i, (r, w) in enumerate(zip(rows, widths, strict=True)):
            r.result = logits[i, :w]
            r.result_hidden = h[i, :w] if h is not None and r.hidden is not None else None
            r.submitted = r.submitted_tree = None
            out += [a for a in (r.result, r.result_hidden) if a is not None]
        # MLX runs a lazy array only on the thread that built it: every array another row's
        # thread reads is evaluated here.
        mx.eval(out)
        self._settle()
        self.steps += 1
        self.widths = widths
        self.peak = max(self.peak, len(rows))
        self.ragged += len(set(widths)) > 1
        self.cond.notify_all()


# Chunks prefill in one forward only while padding them to the widest costs at most this much
# more than their own tokens (on a CPU a forward over many token rows is compute-bound: padding
# a short prompt to a long one's chunk would cost what it saves).
PREFILL_PADDING_BOUND = 1.5


def _packed(chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """The chunks in forwards: narrowest first (the short prompts' first tokens come soonest),
    each forward's padded size (rows x widest) within PREFILL_PADDING_BOUND of its tokens."""
    groups: list[list[PrefillChunk]] = []
    group: list[PrefillChunk] = []
    tokens = 0
    for c in sorted(chunks, key=lambda c: len(c.tokens)):
        w = len(c.tokens)
        if group and (len(group) + 1) * w > PREFILL_PADDING_BOUND * (tokens + w):
            groups.append(group)
            group, tokens = [], 0
        group.append(c)
        tokens += w
    if group:
        groups.append(group)
    return groups


class RowForward:
    """One request's forward in a batch (the decode loop's `Forward`). Its methods are called
    with the scheduler's lock held (MlxEngine holds it while the request's code runs)."""

    def __init__(self, scheduler: BatchScheduler, hidden: str | None,
                 interrupt: Callable[[], None] | None):
        if hidden not in (None, "after", "before"):
            raise ValueError(f"hidden must be 'after' or 'before', got {hidden!r}")
        self.scheduler = scheduler
        self.hidden = hidden
        self.interrupt = interrupt
        self.local = StageCache(scheduler.stage)  # the prompt's caches until the row joins
        self.last_hidden: mx.array | None = None
        self.submitted: list[int] | None = None
        self.submitted_tree: list[int] | None = None  # the submitted tokens' parents, a tree
        self.result: mx.array | None = None
        self.result_hidden: mx.array | None = None
        self.error: BaseException | None = None
        self.prefill_waits = 0  # steps of the decoding rows run between this prompt's chunks
        self.prefill_shared = 0  # the most prompts one of this prompt's prefill forwards ran
        self.joined = False
        self.closed = False
        self._last_width = 0  # tokens of the last step (a tree's, for keep_path)

    @property
    def batch_size(self) -> int:
        """Rows in this row's forwards (itself included, once it joins): the gates weigh it."""
        active = len(self.scheduler.active)
        return active if self.joined else min(active + 1, self.scheduler.max_batch)

    @property
    def index(self) -> int:
        return self.scheduler.active.index(self)

    @property
    def cache(self) -> list[Any]:
        """The request's caches as one-request caches (copies once it has joined): what the
        prefix cache keeps at the end of the request."""
        if not self.joined:
            return self.local.cache
        i = self.index
        length = self.scheduler.rows.lengths[i]
        return [layer.extract(i, length) for layer in self.scheduler.layers]

    def restore(self, cache: list[Any], tokens: list[int], key: list[int]) -> int:
        """Go on from a prefix-cache hit (before the prefill)."""
        self.local.adopt(cache)
        return len(tokens)

    def prefill(self, tokens: list[int]) -> None:
        sched = self.scheduler
        rows = []
        for n, start in enumerate(range(0, len(tokens), sched.prefill_chunk)):
            if n and sched.active:  # let the decoding rows take one step between chunks
                sched.cond.wait_for(lambda seen=sched.steps: sched.steps != seen
                                    or not sched.active)
                self.prefill_waits += 1
            if self.interrupt is not None:
                self.interrupt()
            h = sched._prefill(self, tokens[start:start + sched.prefill_chunk])
            if h is not None:
                rows.append(h)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    @property
    def trees(self) -> bool:
        return self.scheduler.trees

    def __call__(self, tokens: list[int]) -> mx.array:
        return self._submit(tokens, None)

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """Logits of a token tree (engine/tree.py) in the batch's next forward; `keep_path`
        then keeps the accepted path in this row's caches."""
        if not self.trees:
            raise ValueError("this model verifies chains only (not an attention-only family)")
        validate_parents(parents)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        return self._submit(tokens, parents)

    def keep_path(self, path: list[int]) -> None:
        """Keep node 0 and the accepted path of this row's last tree, in order."""
        sched = self.scheduler
        i = self.index
        lengths = list(sched.rows.lengths)
        start = lengths[i] - self._last_width
        for layer in sched.layers:
            layer.compact_row(i, start, path)
        lengths[i] = start + 1 + len(path)
        sched.rows.set(lengths)
        sched._settle()
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[mx.array([0, *path])]

    def _submit(self, tokens: list[int], parents: list[int] | None) -> mx.array:
        sched = self.scheduler
        if not self.joined:
            # Wait for a free row (a batch at max_batch admits the next row when one leaves).
            sched.cond.wait_for(lambda: len(sched.active) < sched.max_batch)
            sched._join(self)
            self.joined = True
        self.result = self.error = None
        self.submitted = list(tokens)
        self.submitted_tree = parents
        self._last_width = len(tokens)
        sched._step_if_ready()
        sched.cond.wait_for(lambda: self.result is not None or self.error is not None)
        if self.error is not None:
            raise RuntimeError(f"the batched forward failed: {self.error}") from self.error
        logits, self.result = self.result, None
        if self.result_hidden is not None:
            self.last_hidden, self.result_hidden = self.result_hidden, None
        return logits

    def rollback(self, keep: int, dropped: int) -> None:
        """The last call appended keep + dropped tokens; forget the last `dropped` of them."""
        if dropped <= 0:
            return
        rows = self.scheduler.rows
        lengths = list(rows.lengths)
        lengths[self.index] -= dropped
        rows.set(lengths)

    def close(self) -> None:
        """Leave the batch (the request ended, however): the other rows go on without it."""
        if self.closed:
            return
        self.closed = True
        if self.joined:
            self.scheduler._leave(self)
