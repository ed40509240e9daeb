"""Continuous batching for one model: the active requests' forwards run as ONE batched forward.

Each request keeps running the one decode loop (decode.py) in its own thread, with a
`RowForward` as its forward: the loop asks it for the logits of its tokens (pending + draft) and
for a rollback, exactly as it asks a `LocalForward`, and never learns that it runs in a batch.
The batch is assembled at this seam: a row's call hands its tokens to the `BatchScheduler` and
waits; once every active row has handed its tokens in, one forward runs over all of them (rows
of different widths padded on the right, each row at its own length: batch_cache.py), and each
row gets its own logits back. Drafting, accepting and rolling back stay the row's own (the same
code as a request served alone); a rollback is the row's length going down. (`RowForward`, the
row's side of all this, is row_forward.py.)

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

Layers batch per kind (`batchable`): plain KV caches and sliding windows (Gemma) as rows at
their own lengths, the recurrent state of qwen3_5's gated-delta layers as one state per row. A
recurrent state cannot be cut back, so a row whose verify was partly rejected takes its state
from before the step back (batch_cache.py: `restore_row`) and runs the tokens it kept again at
the front of its next step (`RowForward.replay`): the step it takes anyway, a few tokens wider,
instead of a forward of its own (a request alone replays them at once: caches.py).

On the last stage of a pipeline ring (models whose every layer holds a plain KV cache) the
same scheduler runs the batch, with `through` (a `RingRows`, ring_batch.py) for the layers
before this stage: a step is one traversal carrying every row, then this stage's layers over
the rows' caches here. Each row has its own `RingForward`, which prefills (one chunk, one traversal, not batched with other prompts),
restores the prefix cache, and carries the row's rollback and prefix-cache key on the next
frame; closing the row sends its end, which frees its row on every stage.

A request alone on one node's model never enters the batch: its forward runs on its own
per-request caches exactly as a `LocalForward` does (no batch buffers, array masks, hand-offs or per-step
settling), and plain greedy runs pipelined there (decode.py: the next step built while the
current one evaluates). A request that arrives counts itself first (`arrive`, before the lock),
then waits until the lone row has no step in flight (`wait_settled`); the lone row sees the
arrival at its next step, stops running ahead and joins the batch at its next forward.
A ring's rows always run through the batch (their forward is the traversal).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from skulkp2p.engine.batching.batch_view import StepPacking
from skulkp2p.engine.batching.head_batch import DraftHead, HeadRows
from skulkp2p.engine.batching.row_forward import RowForward
from skulkp2p.engine.batching.step_rope import shared_ropes
from skulkp2p.engine.batching.ticket_lock import TicketLock
from skulkp2p.engine.cache.batch_cache import RowLengths, RowsArraysCache, RowsKVCache
from skulkp2p.engine.cache.caches import CacheEntry
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.model.arrays import leaves
from skulkp2p.engine.model.forward import whole_model_stage
from skulkp2p.engine.model.packed import packed_rows, packs_mlps
from skulkp2p.engine.model.stage import StageModel
from skulkp2p.engine.model.tree import tree_capable, tree_inputs

if TYPE_CHECKING:
    from skulkp2p.engine.parallel.ring.batch_rows import RingRows, RowRing
    from skulkp2p.engine.parallel.ring.traversal import RingForward

# A joining prompt prefills in chunks of at most this many tokens, one step of the decoding rows
# between chunks. The same chunks whether alone or not, so a request's caches do not depend on
# what else runs.
BATCH_PREFILL_CHUNK = 512

# While rows decode, a joining prompt (of a request without hidden rows, on a model without
# recurrent layers) may prefill inside their steps, a chunk of at most this many tokens per step:
# one more ragged row of the step, its MLPs, attention projections and (no) head packed to the
# real tokens (engine/model/packed.py), so the decoding rows go on instead of waiting for whole
# prompts. Off (0) by default: a mixed step costs more per real token than a prefill forward of
# its own (4.5 against 2.4-2.8 ms), more than the decode steps it saves (docs/measurements/
# concurrency.md, "first tokens and the prefill path"); exact (tests/
# test_batch_mixed.py), so `BatchScheduler.mixed_chunk` turns it on where it pays.
MIXED_PREFILL_CHUNK = 0

# A ragged step's MLPs run on its real tokens only from this many padded token rows on
# (engine/model/packed.py; its head always does): below it the gathers cost about what they save
# (8 padded rows 1.08x padded, 28 0.82x: docs/measurements/concurrency.md, "Ragged speculative
# steps packed").
PACK_MLPS_FROM = 8


@dataclasses.dataclass
class PrefillChunk:
    """A chunk of a joining prompt, handed in to be prefilled with the others waiting."""
    row: RowForward
    tokens: list[int]
    done: bool = False
    hidden: mx.array | None = None
    error: BaseException | None = None


# Families whose recurrent layers take mlx-lm's per-row `lengths` (padded positions leave the
# state alone, the convolution window ends at each row's last real token): their ArraysCache
# state batches as rows. Other recurrent families (mamba and the like) are not checked here.
ROW_STATE_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _model_type(model: nn.Module) -> str | None:
    # (any family's mlx-lm model: the type sits on the model or on its args, family by family)
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


def batchable(model: nn.Module) -> bool:
    """Every layer's cache has a batched kind here: plain KV caches and sliding windows (rows
    side by side at their own lengths), and the recurrent state of the families that mask it per
    row (ROW_STATE_FAMILIES)."""
    def fits(c: CacheEntry) -> bool:
        if type(c) is KVCache:
            return True
        if type(c) is RotatingKVCache:
            return c.keep == 0  # (a kept prefix would stay visible past the window)
        return type(c) is ArraysCache and _model_type(model) in ROW_STATE_FAMILIES
    return all(fits(c) for c in make_prompt_cache(model))


def held_length(cache: Sequence[CacheEntry]) -> int:
    """Tokens a one-request cache list holds (read from a layer that counts them: a batch's
    layers are the kinds `batchable` takes, and of those a recurrent state counts none)."""
    return next((c.offset for c in cache if isinstance(c, KVCache | RotatingKVCache)), 0)


def _rows_layer(rows: RowLengths, template: CacheEntry) -> RowsKVCache | RowsArraysCache:
    if type(template) is ArraysCache:
        return RowsArraysCache(len(template.cache))
    assert isinstance(template, KVCache | RotatingKVCache)  # (batchable)
    return RowsKVCache.like(rows, template)


def _rows_of_singles(rows: RowLengths, singles: list[CacheEntry], lengths: list[int]
                     ) -> RowsKVCache | RowsArraysCache:
    # (one layer of each row: all of one kind, a kind `batchable` takes)
    if type(singles[0]) is ArraysCache:
        return RowsArraysCache.of_singles(rows, cast(list[ArraysCache], singles), lengths)
    return RowsKVCache.of_singles(rows, cast(list[KVCache | RotatingKVCache], singles), lengths)


def _append_row(layer: RowsKVCache | RowsArraysCache, single: CacheEntry, length: int) -> None:
    """Add a row's one-request cache of this layer (of the kind the layer batches)."""
    if isinstance(layer, RowsArraysCache):
        assert isinstance(single, ArraysCache)
        layer.append_row(single, length)
    else:
        # (a sliding window's RotatingKVCache is read as a KVCache is: keys, values, offset)
        layer.append_row(cast(KVCache, single), length)


def _weights(module: nn.Module) -> int:
    return sum(int(a.size) for a in leaves(module.parameters()))


def step_packing(layers: list[nn.Module], head: nn.Module | None, mlps_from: int
                 ) -> StepPacking:
    """The shares of one token row's work that a packed step runs on the real tokens only
    (engine/model/packed.py runs it so; the gates price a ragged step with them:
    gates.step_cost), by weights: a forward over a few dozen token rows on a CPU multiplies
    every weight once per row, so a module's share of the weights is its share of the work (SmolLM2-135M: MLPs 0.59, head 0.21). A mixture of experts
    routes each token to a few of its experts: its MLPs' share is overstated (the gates then
    expect a little more from packing than it saves). Attention's own products over the context
    are left out (small at the context lengths of a chat)."""
    mlps = sum(_weights(layer.mlp) for layer in layers)
    rest = sum(_weights(layer) for layer in layers) - mlps
    out = _weights(head) if head is not None else 0
    total = mlps + rest + out
    if total <= 0:
        return StepPacking(0.0, 0.0, mlps_from)
    return StepPacking(head=out / total, mlps=mlps / total, mlps_from=mlps_from)


class BatchScheduler:
    """The batch of one model: its rows' caches, and the step that runs them together."""

    def __init__(self, model: nn.Module, max_batch: int, prefill_step: int = 2048,
                 stage: StageModel | None = None, through: RingRows | None = None):
        """`stage`: the layers held here (default all of `model`'s); `through`: the ring's
        other stages, when `stage` is a ring's last (see the module's docstring)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if (through is None) != (stage is None or stage.span.first):
            raise ValueError("a stage past the first needs the ring's other stages (through)")
        self.stage = stage or whole_model_stage(model)
        self.through = through
        # rows may verify token trees (engine/model/tree.py), a ring's too (their trees cross the
        # ring in the batch frame: ring_batch.py)
        self.trees = tree_capable(model)
        self.max_batch = max_batch
        self.prefill_chunk = min(prefill_step, BATCH_PREFILL_CHUNK)
        self.lock = TicketLock()  # the model's, for every MLX call
        # (typeshed takes only threading's locks; a Condition works over any acquire/release)
        self.cond = threading.Condition(self.lock)  # type: ignore[arg-type]
        self.rows = RowLengths()
        self.layers = [_rows_layer(self.rows, c) for c in make_prompt_cache(model)]
        self.recurrent = [c for c in self.layers if isinstance(c, RowsArraysCache)]
        self.window_layers = [c for c in self.layers
                              if isinstance(c, RowsKVCache) and c.window is not None]
        self.replays = 0  # tokens rows ran again after a rollback of recurrent state
        self.replay_peak = 0  # the most tokens one row ran again at once (at most depth + 1)
        self.active: list[RowForward] = []
        self.steps = 0  # batched forwards run so far
        self.widths: list[int] = []  # the last step's row widths (tests, the cost model)
        self.peak = 0  # the most rows one step has run
        self.ragged = 0  # steps whose rows had different widths (drafts of different depths)
        self.leaves: collections.deque[int] = collections.deque(maxlen=64)  # steps at each leave
        self.joining: list[PrefillChunk] = []  # prompt chunks handed in, not prefilled yet
        self.prefills = 0  # prefill forwards run so far (one per chunk round, however many rows)
        self.prefill_peak = 0  # the most prompts one prefill forward has run
        # A request alone on the model decodes on its own caches, as a LocalForward does (no
        # batch buffers, masks or hand-offs), and plain greedy runs pipelined there; it joins
        # the batch at its next forward once another request arrives (RowForward.alone).
        self._count = threading.Lock()
        self.requests = 0  # requests started and not finished (MlxEngine: arrive / depart)
        self.ahead: RowForward | None = None  # a lone row with a step in flight (pipelined)
        self.solo_steps = 0  # forwards (rounds of the loop) rows ran alone on their own caches
        self.lazy_steps = 0  # pipelined plain greedy steps rows ran alone
        # The drafting rows' MTP/EAGLE head caches, per head, drafted in one forward per depth
        # (engine/batching/head_batch.py).
        self.heads: dict[int, HeadRows] = {}
        # Ragged steps run the layers' MLPs and the head on their real tokens only
        # (engine/model/packed.py); False runs every padded position through them (A/B in tools).
        self.pack_ragged = packs_mlps(self.stage.trunk.body.layers)
        self.pack_mlps_from = PACK_MLPS_FROM
        # The gates price a ragged step as it runs packed (gates.step_cost); False prices it
        # padded to the widest (A/B: docs/measurements/concurrency.md).
        self.price_packed = True
        trunk = self.stage.trunk
        # (an untied mlx-lm model's output head, where its family names it lm_head)
        head = trunk.body.embed_tokens if trunk.tied else getattr(trunk.text, "lm_head", None)
        self._packing = step_packing(list(trunk.body.layers), head, PACK_MLPS_FROM) \
            if self.pack_ragged else None
        self.packed_steps = 0  # ragged steps run packed
        self.padding_skipped = 0  # padded token rows those steps left out of the MLPs and head
        self.packed_prefills = 0  # prefill forwards of ragged chunks run packed
        self.mixed_chunk = MIXED_PREFILL_CHUNK  # 0: prompts never prefill inside steps
        self.mixed_steps = 0  # steps that carried a joining prompt's chunk
        self.mixed_tokens = 0  # prompt tokens prefilled inside steps
        # Batched forwards rotate from one table of sines and cosines per forward, not one per
        # layer and projection (engine/batching/step_rope.py); False: each layer's own rope (A/B).
        self.share_rope = True

    @property
    def packing(self) -> StepPacking | None:
        """How a ragged step runs, for the gates' price of it (None: padded to the widest)."""
        if self._packing is None or not self.pack_ragged or not self.price_packed:
            return None
        if self._packing.mlps_from != self.pack_mlps_from:
            self._packing = dataclasses.replace(self._packing, mlps_from=self.pack_mlps_from)
        return self._packing

    def arrive(self) -> None:
        """A request starts (before it first takes the lock): no row may run alone from now."""
        with self._count:
            self.requests += 1

    def depart(self) -> None:
        with self._count:
            self.requests -= 1

    def wait_settled(self) -> None:
        """Wait (lock held) until no lone row has a step in flight: MLX work of two threads must
        not overlap. The row stops running ahead at its next step once it sees this arrival."""
        self.cond.wait_for(lambda: self.ahead is None)

    @property
    def batch_size(self) -> int:
        return len(self.active)

    def forward(self, hidden: str | None = None,
                interrupt: Callable[[], None] | None = None,
                ring: RingForward | None = None) -> RowForward:
        """A new request's row; on a ring's last stage, over its own RingForward `ring`."""
        if (ring is None) != (self.through is None):
            raise ValueError("a ring's rows need their RingForward, and only they")
        return RowForward(self, hidden, interrupt, ring)

    # -- called with the lock held --

    def head_rows(self, head: DraftHead) -> HeadRows:
        """The batched head caches of `head`'s drafting rows (made on first use)."""
        rows = self.heads.get(id(head))
        if rows is None:
            rows = self.heads[id(head)] = HeadRows(head, self)
        return rows

    def heads_ready(self) -> bool:
        """Whether no row can still hand a head call in before the next trunk step: each has
        one pending or has handed its tokens in."""
        pending = {m for h in self.heads.values() for m in h.pending}
        return all(r.submitted is not None or r in pending for r in self.active)

    def heads_if_ready(self) -> None:
        """Run the pending head calls, one forward per head, once the barrier is complete."""
        if any(h.pending for h in self.heads.values()) and self.heads_ready():
            for h in self.heads.values():
                h.run()

    def join(self, row: RowForward) -> None:
        """Copy the row's own caches into a new row of the batch."""
        if len(self.active) >= self.max_batch:
            raise RuntimeError(f"batch is full ({self.max_batch} rows)")
        length = held_length(row.local.cache)
        for layer, single in zip(self.layers, row.local.cache, strict=True):
            _append_row(layer, single, length)
        self.settle()  # (built on this thread: see _step)
        self.active.append(row)
        self.rows.set([*self.rows.lengths, length])
        row.local.reset()  # the row's tokens live in the batch now

    def leave(self, row: RowForward) -> None:
        """Drop the row from the batch (its request ended); the others go on without it."""
        index = self.active.index(row)
        kept = [i for i in range(len(self.active)) if i != index]
        for layer in self.layers:
            layer.keep_rows(kept)
        self.settle()
        self.rows.set([self.rows.lengths[i] for i in kept])
        del self.active[index]
        for head in self.heads.values():
            head.leave(row)
        self.leaves.append(self.steps)
        self.heads_if_ready()
        self.step_if_ready()
        self.cond.notify_all()

    def settle(self) -> None:
        """Evaluate the rows' buffers now, on this thread (see _step)."""
        mx.eval([a for c in self.layers for a in c.arrays()])

    def _ready(self) -> bool:
        return bool(self.active) and all(r.submitted is not None for r in self.active)

    def step_if_ready(self) -> None:
        """Run the batched step once every row has handed its tokens in."""
        if self._ready():
            self._step()

    def prefill(self, row: RowForward, tokens: list[int]) -> tuple[bool, mx.array | None]:
        """Prefill one chunk of `row`'s prompt together with the chunks of every other request
        that hands one in meanwhile: whether it ran (False: rows started decoding before it did,
        and it was withdrawn to ride in their steps: RowForward.mixes), and the chunk's hidden
        rows (when the row asked for them)."""
        if row.ring is not None:  # alone through the ring, into the row's own caches here
            h = row.ring.prefill_chunk(tokens)
            row.prefill_shared = max(row.prefill_shared, 1)
            return True, h
        chunk = PrefillChunk(row, tokens)
        self.joining.append(chunk)
        if self.lock.queued > 1:
            # Go to the back of the model's queue: every thread queued now (requests that
            # arrived together) hands its chunk in first, and one forward runs them all.
            self._requeue()
        while not chunk.done:  # (else a thread queued before this one ran it)
            if row.mixes():  # rows decode now: the rest of this prompt rides in their steps
                self.joining.remove(chunk)
                return False, None
            self._run_prefills()
            if not chunk.done and self.lock.queued:
                # One forward per turn: the rows whose chunks it ran go on to their first
                # token (and decode) before the next, wider, group runs.
                self._requeue()
        if chunk.error is not None:
            raise RuntimeError(f"the batched prefill failed: {chunk.error}") from chunk.error
        return True, chunk.hidden

    def _requeue(self) -> None:
        """Go to the back of the model's queue (the ticket lock: every thread queued now first)."""
        self.lock.release()
        self.lock.acquire()

    def _run_prefills(self) -> None:
        """Run the narrowest forward of the chunks handed in; the others stay pending (the rows
        whose chunks ran get their first tokens before the wider ones run)."""
        modes: dict[str | None, list[PrefillChunk]] = {}
        for c in self.joining:  # one forward per kind of hidden rows asked for (usually one)
            modes.setdefault(c.row.hidden, []).append(c)
        groups = [(hidden, g) for hidden, chunks in modes.items() for g in _packed(chunks)]
        hidden, group = min(groups, key=lambda hg: max(len(c.tokens) for c in hg[1]))
        self.joining = [c for c in self.joining if c not in group]
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
            # Evaluated here, as below: a recurrent state is not part of the hidden rows' graph.
            mx.eval([single.state for single in c.row.local.cache])
            c.row.prefill_shared = max(c.row.prefill_shared, 1)
            return
        # Rows of different lengths (a prefix-cache hit, a later chunk) and widths, padded on
        # the right with the row's last token: padded positions sit past the row's length and
        # are cut off when the row's caches are taken back out.
        lengths = [held_length(c.row.local.cache) for c in group]
        widths = [len(c.tokens) for c in group]
        width = max(widths)
        rows = RowLengths()
        rows.set(lengths)
        layers = [_rows_of_singles(rows, [c.row.local.cache[j] for c in group], lengths)
                  for j in range(len(self.layers))]
        for layer in layers:
            if isinstance(layer, RowsArraysCache):
                layer.begin_step(widths)  # the padding must not reach a row's state
        tokens = [c.tokens + [c.tokens[-1]] * (width - len(c.tokens)) for c in group]
        packed = packed_rows(widths) if self.pack_ragged else None
        with self._ropes():
            _, h = self.stage.run_rows(mx.array(tokens), layers, logits=False, hidden=hidden,
                                       packed=packed)
        self.packed_prefills += packed is not None
        out = []
        for i, (c, n, w) in enumerate(zip(group, lengths, widths, strict=True)):
            c.row.local.adopt([layer.extract(i, n + w) for layer in layers])
            c.hidden = h[i, :w] if h is not None else None
            c.row.prefill_shared = max(c.row.prefill_shared, len(group))
            out += [a for single in c.row.local.cache for a in leaves(single.state)]
            out += [] if c.hidden is None else [c.hidden]
        mx.eval(out)  # here: other rows' threads read these (see _step)

    def _ropes(self) -> contextlib.AbstractContextManager[None]:
        """One batched forward's ropes: from one shared table (engine/batching/step_rope.py)."""
        if not self.share_rope:
            return contextlib.nullcontext()
        return shared_ropes(list(self.stage.trunk.body.layers))

    def _step(self) -> None:
        rows = self.active
        for head in self.heads.values():  # (calls handed in and not waited for: run them first)
            head.run()
        for window in self.window_layers:  # (every row has rolled back: see RowsKVCache.trim)
            window.trim()
        submitted: list[list[int]] = []
        for r in rows:
            assert r.submitted is not None  # (ready: every row handed its tokens in)
            submitted.append(r.submitted)
        widths = [len(s) for s in submitted]
        width = max(widths)
        # Pad on the right with the row's last token: the padded positions are written past
        # the row's length and masked from its real queries; the next step overwrites them.
        tokens = [s + [s[-1]] * (width - len(s)) for s in submitted]
        hidden = next((r.hidden for r in rows if r.hidden is not None), None)
        tree = None
        if any(r.submitted_tree is not None for r in rows):
            # One row's tree makes the step a tree forward; the other rows are chains in it.
            shapes = [r.submitted_tree or list(range(-1, len(s) - 1))
                      for r, s in zip(rows, submitted, strict=True)]
            tree = tree_inputs(self.rows.lengths, shapes, width)
        riding = [r.prefilling for r in rows]
        packed = None
        if self.pack_ragged:  # (a prompt's chunk rides only where steps pack: RowForward.mixes)
            heads = [0 if p else w for p, w in zip(riding, widths, strict=True)]
            packed = packed_rows(widths, self.pack_mlps_from, heads if any(riding) else None,
                                 attention=any(riding))
        for layer in self.recurrent:
            layer.begin_step(widths)
        try:
            # The OpenBLAS thread count (blas_threads.py): rows' threads take turns here, so
            # the steps count as one owner's (never overlapping) and may run wide.
            # A mixed step's work is its real tokens (packed: a prefill's, compute-bound): it
            # takes the thread count a prefill of that many tokens learned.
            mixed = packed is not None and packed.attention
            work = packed.tokens if packed is not None and packed.attention else width * len(rows)
            # (on a ring's last stage each row has its own RingForward)
            rings: list[RowRing] = [r.ring for r in rows if r.ring is not None]
            with blas_threads.waited(work, "forward" if mixed else "batch", owner=self), \
                    self._ropes():
                if self.through is not None:  # the layers before this stage: one traversal
                    x = self.through.traverse(rings, submitted, [r.submitted_tree for r in rows])
                    t0 = time.perf_counter()
                    logits, h = self.stage.run_rows(None, self.layers, hidden=hidden, embeddings=x,
                                                    tree=tree, packed=packed)
                else:
                    logits, h = self.stage.run_rows(mx.array(tokens), self.layers, hidden=hidden,
                                                    tree=tree, packed=packed)
                mx.eval([a for a in (logits, h) if a is not None])
                if self.through is not None:  # this stage's compute, for the rings' reports
                    own = time.perf_counter() - t0
                    for r in rows:
                        assert r.ring is not None  # (a ring's rows each have theirs)
                        r.ring.compute_s += own
        except BaseException as e:  # every waiting row fails with it, not only this one
            for r in rows:
                r.submitted, r.error = None, e
            self.cond.notify_all()
            raise
        finally:
            for layer in self.recurrent:
                layer.end_step()
        assert logits is not None  # (the last stage's rows: logits asked for)
        self.rows.set([n + w for n, w in zip(self.rows.lengths, widths, strict=True)])
        out = []
        for i, (r, w) in enumerate(zip(rows, widths, strict=True)):
            r.result = logits[i, :w] if packed is None else packed.head_row(logits, i)
            r.result_hidden = h[i, :w] if h is not None and r.hidden is not None else None
            r.submitted = r.submitted_tree = None
            out += [a for a in (r.result, r.result_hidden) if a is not None]
        # MLX runs a lazy array only on the thread that built it: every array another row's
        # thread reads is evaluated here.
        mx.eval(out)
        self.settle()
        self.steps += 1
        self.widths = widths
        self.peak = max(self.peak, len(rows))
        self.ragged += len(set(widths)) > 1
        if packed is not None:
            self.packed_steps += 1
            self.padding_skipped += len(rows) * width - packed.tokens
        if any(riding):
            self.mixed_steps += 1
            self.mixed_tokens += sum(w for p, w in zip(riding, widths, strict=True) if p)
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
