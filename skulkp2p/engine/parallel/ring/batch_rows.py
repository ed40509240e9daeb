"""Batched ring traversals: the rows of several requests cross a pipeline ring in ONE frame.

On the last stage the model's BatchScheduler (scheduler.py) runs one forward over every active
row; on a ring, the layers before the last stage's are one traversal away. `RingRows` is that
traversal: the step's rows (each a request decoding on the ring, with its own `RingForward` that
prefilled and restored it alone) go out in one "batch" frame, and the hidden rows of all of them
come back, [B, W, H], padded to the widest row. Each row in the frame names its request, its
sender instance, its own step counter, its width, and the accept decision (keep, dropped) and
prefix-cache key its last round left, exactly what a one-request frame carries.

On the other stages `StageRows` keeps the batch: every row's KV caches side by side, each at its
own length (batch_cache.py, as on one node). A frame's row list IS the batch: a request not in
it leaves (its row is gathered out), a request new to it joins from the per-request session its
prefill built (StageWorker.sessions), or empty at step 0 (nothing prefilled). A rollback is that
row's length going down. An "end" frame for a request in the batch (its sender closed it: it
finished, was cancelled or failed) frees its row at once, after keeping its caches in the prefix
cache when the frame asks for that. A frame of another batch instance at step 0 replaces the
batch (the last stage started over); anything else out of step is dropped, so the sender times
out or sees its ring broken and ends every request in the batch with that error.

Token trees (engine/model/tree.py) ride in the batch frame as on one node: a step where some rows
verify trees wraps the payload with each row's parents (None for a chain row:
ring_frames.tree_payload), every stage runs its layers under the rows' tree mask and positions
(tree_inputs over the rows' lengths), and a row's accepted path ("keep") rides on its next row
entry (or its "end"), where each stage compacts that row to it before anything else.

Only models whose every layer holds a plain KV cache batch (scheduler.batchable); the others stay
one request at a time on rings, as on one node.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol, cast

import mlx.core as mx

from skulkp2p import wire
from skulkp2p.engine.cache.batch_cache import RowLengths, RowsKVCache
from skulkp2p.engine.model.tree import check_path, tree_inputs, validate_parents
from skulkp2p.engine.parallel.ring.frames import (
    Frame,
    RingError,
    RingLink,
    check_answer,
    header,
    int_list,
    open_payload,
    seconds_list,
    tree_payload,
)
from skulkp2p.wire import WireValue

if TYPE_CHECKING:
    from skulkp2p.engine.cache.prefix_cache import PrefixCache
    from skulkp2p.engine.model.forward import StageCache
    from skulkp2p.engine.model.stage import StageModel

OP = "batch"


# traversal.py's RingForward and StageWorker are not imported here (traversal.py imports this
# module for a stage's batch): what is used of them is below.
class RowRing(Protocol):
    """A row's RingForward (traversal.py), as a batched traversal reads and advances it."""
    term: int
    instance: str
    request: str
    step: int
    link: RingLink
    stage: StageModel
    _pending: tuple[int, int] | None
    _store: list[WireValue] | None
    _store_disk: bool
    _keep: list[WireValue] | None
    traversals: int
    wait_s: float
    stages_compute_s: float
    link_rows: int


class BatchWorker(Protocol):
    """The StageWorker (traversal.py) whose batch a StageRows is."""
    stage: StageModel
    sessions: dict[str, tuple[str, int, StageCache]]
    prefix_cache: PrefixCache | None
    dropped: int


class RingRows:
    """The last stage's side: one traversal for the rows of a batched step."""

    def __init__(self) -> None:
        self.batch = uuid.uuid4().hex  # a new one after a failed traversal (stages re-sync)
        self.step = 0
        self.traversals = 0  # batched traversals run (tests, reports)
        self.peak = 0  # the most rows one traversal carried

    def traverse(self, rings: list[RowRing], tokens: list[list[int]],
                 trees: list[list[int] | None] | None = None) -> mx.array:
        """Hidden rows [B, W, H] (W the widest row's tokens) of the layers before this stage, for
        the rows of `rings` (each a RingForward) with `tokens` each; `trees`: each row's tree
        parents (engine/model/tree.py), None for a chain row."""
        if not rings:
            raise ValueError("a batched traversal needs at least one row")
        first = rings[0]
        terms = {r.term for r in rings}
        if len(terms) > 1:  # the ring moved to a new term under running requests
            raise RingError(f"the ring's rows span terms {sorted(terms)}: the model was "
                            "re-placed; retry")
        rows: list[WireValue] = [
            {"request": r.request, "instance": r.instance, "step": r.step,
             "w": len(t), "rollback": list(r._pending) if r._pending else None,
             "store": r._store, "keep": r._keep,
             **({"store_disk": False} if r._store is not None and not r._store_disk else {})}
            for r, t in zip(rings, tokens, strict=True)]
        payload: WireValue = [[int(v) for v in t] for t in tokens]
        if trees is not None and any(p is not None for p in trees):
            payload = tree_payload(payload, [None if p is None else [int(v) for v in p]
                                             for p in trees])
        msg: Frame = {**header(first.term, first.instance, self.batch, self.step, OP), "at": 0,
                      "rows": rows, "x": payload}
        t0 = time.perf_counter()
        try:
            out = first.link.traverse(msg)
            check_answer(out, self.step, self.batch, first.stage.span.start)
            x = wire.unpack_array(open_payload(out["x"])[0], as_mlx=True)
            width = max(len(t) for t in tokens)
            if tuple(x.shape[:2]) != (len(rings), width):
                raise RingError(f"ring answered rows {list(x.shape)} for {len(rings)} rows of "
                                f"width {width}")
        except BaseException:
            self.batch, self.step = uuid.uuid4().hex, 0  # the stages' batch is unknown now
            raise
        wait = time.perf_counter() - t0
        others = sum(seconds_list(out.get("cs")))
        for r, t in zip(rings, tokens, strict=True):
            r.step += 1
            r._pending = r._store = r._keep = None
            r._store_disk = True
            r.traversals += 1
            r.wait_s += wait
            r.stages_compute_s += others
            r.link_rows += len(t)
        self.step += 1
        self.traversals += 1
        self.peak = max(self.peak, len(rings))
        return x


class StageRows:
    """A stage's batch (not the last stage): the rows of the requests in the last batch frame."""

    def __init__(self, worker: BatchWorker):
        """`worker`: the StageWorker whose batch this is (its stage, sessions, prefix cache)."""
        self.worker = worker
        self.batch: str | None = None
        self.step = -1
        self.requests: list[str] = []  # row order
        self.meta: dict[str, tuple[str, int]] = {}  # request -> (instance, its last step)
        self.rows = RowLengths()
        self.layers = self._fresh()
        # request -> (where its last step's tree wrote node 0, the tree's parents), until the
        # row's accepted path comes (the next frame) or its next step runs
        self.trees: dict[str, tuple[int, list[int]]] = {}

    def _fresh(self) -> list[RowsKVCache]:
        from mlx_lm.models.cache import KVCache, make_prompt_cache
        caches = make_prompt_cache(self.worker.stage.model)
        if any(type(c) is not KVCache for c in caches):  # (a last stage never sends these)
            raise ValueError("this stage's layers hold recurrent or sliding-window state: "
                             "they are not batched")
        return [RowsKVCache(self.rows) for _ in caches]

    def holds(self, request: str) -> bool:
        return request in self.meta

    def _reset(self) -> None:
        self.requests, self.meta, self.trees = [], {}, {}
        self.rows.set([])
        self.layers = self._fresh()

    def handle(self, msg: Frame) -> Frame | None:
        return self._handle(msg)

    def _handle(self, msg: dict[str, Any]) -> Frame | None:
        # (`msg`'s fields are read as they come: a bad one raises, and the worker drops the
        # frame)
        batch, step = msg["request"], msg["step"]
        new = batch != self.batch
        if (new and step != 0) or (not new and step != self.step + 1):
            self.worker.dropped += 1  # a batch this stage never started, or out of step
            return None
        rows = msg["rows"]
        if not isinstance(rows, list) or not rows:
            raise ValueError("a batch frame needs a non-empty row list")
        widths = [int(r["w"]) for r in rows]
        if min(widths) < 1:
            raise ValueError("a row of a batch frame needs at least one token")
        # Everything checked before anything changes: a dropped frame leaves the batch as is.
        raw, trees = open_payload(msg["x"])
        shapes = self._tree_shapes(trees, widths)
        x = self._inputs(raw, widths)
        joining = self._check(rows, {} if new else self.meta)
        if joining is None:
            return None
        keeps = self._keeps(rows, {} if new else self.trees)
        if new:  # the last stage started over: the old rows' requests are gone
            self._reset()
        t0 = time.perf_counter()
        self._reconcile([r["request"] for r in rows], joining)
        self.trees = {r: t for r, t in self.trees.items() if r in self.meta}
        lengths = list(self.rows.lengths)
        for i, path in keeps.items():  # a row's last tree: keep its accepted path, first
            start, _ = self.trees.pop(rows[i]["request"])
            for layer in self.layers:
                layer.compact_row(i, start, path)
            lengths[i] = start + 1 + len(path)
        for i, r in enumerate(rows):
            if r.get("rollback"):
                keep, dropped = (int(v) for v in r["rollback"])
                if not 0 <= dropped <= lengths[i]:
                    raise ValueError(f"rollback of {dropped} past a row of {lengths[i]}")
                lengths[i] -= dropped
        self.rows.set(lengths)
        for i, r in enumerate(rows):
            if r.get("store"):
                self._store(i, r["store"], r.get("store_disk") is not False)
        tree = None if shapes is None else tree_inputs(lengths, shapes, max(widths))
        out = self.worker.stage.run_batch(x, self.layers, tree=tree)
        mx.eval(out, [a for c in self.layers for a in c.state if a is not None])
        self.rows.set([n + w for n, w in zip(lengths, widths, strict=True)])
        for i, r in enumerate(rows):
            self.meta[r["request"]] = (r["instance"], int(r["step"]))
            self.trees.pop(r["request"], None)
            # (shapes holds every row's parents where the frame has trees)
            if shapes is not None and isinstance(trees, list) and trees[i] is not None:
                self.trees[r["request"]] = (lengths[i], shapes[i])
        self.batch, self.step = batch, step
        span = self.worker.stage.span
        packed: WireValue = wire.pack_array(out)
        if trees is not None:
            packed = tree_payload(packed, trees)
        return {**header(msg["term"], msg["instance"], batch, step, OP),
                "x": packed, "at": span.end,
                "rows": rows,  # (the decisions and keys travel on, for the stages after)
                "cs": [*seconds_list(msg.get("cs")), round(time.perf_counter() - t0, 6)]}

    def _tree_shapes(self, trees: WireValue, widths: list[int]) -> list[list[int]] | None:
        """Every row's parents for a step with trees (a chain row's are a chain), checked;
        None for a step of chains only."""
        if trees is None:
            return None
        if not isinstance(trees, list) or len(trees) != len(widths):
            raise ValueError("a batch frame's trees need one entry per row")
        shapes = []
        for p, w in zip(trees, widths, strict=True):
            if p is None:
                shapes.append(list(range(-1, w - 1)))
                continue
            parents = int_list(p, "a tree's parents")
            validate_parents(parents)
            if len(parents) != w:
                raise ValueError(f"a tree of {len(parents)} parents for a row of {w} tokens")
            shapes.append(parents)
        return shapes

    def _keeps(self, rows: list[dict[str, Any]], trees: dict[str, tuple[int, list[int]]]
               ) -> dict[int, list[int]]:
        """The accepted paths the rows carry (row index -> path), each checked against the
        row's last tree here."""
        out = {}
        for i, r in enumerate(rows):
            if r.get("keep") is None:
                continue
            path = int_list(r["keep"], "keep")
            held = trees.get(r["request"])
            check_path(None if held is None else held[1], path)
            out[i] = path
        return out

    def _check(self, rows: list[dict[str, Any]], meta: dict[str, tuple[str, int]]
               ) -> dict[str, StageCache | None] | None:
        """Every row in step with `meta` (the batch's rows) or its session (else None: the frame
        is dropped); the joining rows' sessions (None: an empty row, nothing prefilled)."""
        joining: dict[str, StageCache | None] = {}
        seen = set()
        for r in rows:
            request, instance, step = r["request"], r["instance"], int(r["step"])
            if request in seen:
                raise ValueError(f"request {request} twice in one batch frame")
            seen.add(request)
            known = meta.get(request)
            if known is None:
                session = self.worker.sessions.get(request)
                if session is not None and session[0] == instance and step == session[1] + 1:
                    joining[request] = session[2]
                elif session is None and step == 0:
                    joining[request] = None
                else:
                    self.worker.dropped += 1
                    return None
            elif known[0] != instance or step != known[1] + 1:
                self.worker.dropped += 1
                return None
        return joining

    def _reconcile(self, want: list[str], joining: dict[str, StageCache | None]) -> None:
        """Make the batch's rows exactly `want`, in that order."""
        kept = [self.requests.index(r) for r in want if r in self.meta]
        if kept != list(range(len(self.requests))):
            for layer in self.layers:
                layer.keep_rows(kept)
            self.rows.set([self.rows.lengths[i] for i in kept])
            self.requests = [self.requests[i] for i in kept]
            self.meta = {r: self.meta[r] for r in self.requests}
        from mlx_lm.models.cache import KVCache

        for request, session in joining.items():
            # (a batched stage's layers hold plain KV caches: _fresh)
            caches = cast("list[KVCache]", session.cache) if session is not None else None
            length = caches[0].offset if caches else 0
            for j, layer in enumerate(self.layers):
                if caches is None:
                    layer.append_row(KVCache(), 0)
                else:
                    layer.append_row(caches[j], length)
            self.rows.set([*self.rows.lengths, length])
            self.requests.append(request)
            self.meta[request] = ("", -1)  # set from the frame once the step has run
            self.worker.sessions.pop(request, None)  # its caches live in the batch now
        if self.requests != want:  # joining rows in between kept ones: reorder
            order = [self.requests.index(r) for r in want]
            for layer in self.layers:
                layer.keep_rows(order)
            self.rows.set([self.rows.lengths[i] for i in order])
            self.requests = list(want)
        mx.eval([a for c in self.layers for a in c.state if a is not None])

    def _inputs(self, x: Any, widths: list[int]) -> mx.array:
        width = max(widths)
        if self.worker.stage.span.first:
            if not isinstance(x, list) or len(x) != len(widths) or any(
                    not isinstance(t, list) or len(t) != w or not t
                    for t, w in zip(x, widths, strict=True)):
                raise ValueError("the first stage needs one non-empty token list per row")
            # Padded on the right with the row's last token: past the row's length, masked
            # from its real queries, overwritten by its next step (as on one node).
            return mx.array([[int(v) for v in t] + [int(t[-1])] * (width - len(t)) for t in x])
        rows = wire.unpack_array(x, as_mlx=True)
        if rows.ndim != 3 or tuple(rows.shape[:2]) != (len(widths), width):
            raise ValueError(f"hidden rows {list(rows.shape)} for {len(widths)} rows of "
                             f"width {width}")
        return rows

    def _store(self, i: int, key: object, disk: bool = True) -> None:
        cache = self.worker.prefix_cache
        if cache is not None and isinstance(key, list) and all(
                layer.keys is not None for layer in self.layers):
            n = self.rows.lengths[i]
            cache.store(key, [layer.extract(i, n) for layer in self.layers], persist=disk)

    def end(self, msg: Frame) -> None:
        """The request's sender closed it: free its row (keeping it first when asked)."""
        self._end(msg)

    def _end(self, msg: dict[str, Any]) -> None:
        request = msg["request"]
        known = self.meta.get(request)
        if known is None or known[0] != msg["instance"]:
            return
        i = self.requests.index(request)
        held = self.trees.pop(request, None)
        if msg.get("store"):
            lengths = list(self.rows.lengths)
            if msg.get("keep") is not None:  # the last tree's path, as a next frame would
                path = int_list(msg["keep"], "keep")
                check_path(None if held is None else held[1], path)
                for layer in self.layers:
                    layer.compact_row(i, held[0], path)  # type: ignore[index]
                lengths[i] = held[0] + 1 + len(path)  # type: ignore[index]
            if msg.get("rollback"):
                lengths[i] -= int(msg["rollback"][1])
            self.rows.set(lengths)
            self._store(i, msg["store"], msg.get("store_disk") is not False)
        kept = [j for j in range(len(self.requests)) if j != i]
        for layer in self.layers:
            layer.keep_rows(kept)
        self.rows.set([self.rows.lengths[j] for j in kept])
        del self.requests[i]
        del self.meta[request]
        mx.eval([a for c in self.layers for a in c.state if a is not None])
