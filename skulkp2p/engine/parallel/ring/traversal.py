"""Pipeline rings: the decode loop's forward seam as one traversal of the ring per call.

Where the loop runs: on the LAST stage. It holds the final norm, the output head and the drafter,
so logits never travel; a verify round costs one frame per link: the round's tokens (a few ints)
go from the last stage to the first, and each stage passes its k+1 output rows (model dtype, raw
bytes) to the next, ending back at the last stage. The accept decision (keep, dropped) rides on
the NEXT round's frame, so every stage trims (or restores and replays) its caches identically
before it runs that round, without a traversal of its own.

Token trees (engine/model/tree.py; attention-only families) cross the ring the same way: a tree verify
is ONE traversal whose payload carries the tree's parents beside the tokens or rows
(ring_frames.tree_payload), every stage runs its layers under the same tree mask and per-node
positions (StageCache.run with `tree`), and the last stage gets a logits row per node, as for a
chain. The accepted path's node indices ("keep") ride on the next frame like a chain's rollback:
each stage compacts its caches to the path before it runs anything more. That costs no traversal
and no wait (the stages are idle until the next frame anyway), and every frame that could read
the caches, the "end" that stores them in the prefix cache included, applies it first. The request's entry node forwards the
HTTP request to the last stage (see node/serving.py).

This module is protocol logic only: `StageWorker.handle` maps a frame to the frame for the next
stage, and a `RingLink` carries frames (in process for tests, TCP in cluster/ring_link.py).
Data frames carry term, instance, request and step; a frame of another term, of an unknown
request or out of step is dropped (the sender then times out and ends its request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from skulkp2p import wire
from skulkp2p.engine.parallel.ring.frames import (
    FRAME,
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

if TYPE_CHECKING:  # mlx loads lazily: the node's control plane imports this module
    import mlx.core as mx

    from skulkp2p.engine.cache.caches import CacheEntry
    from skulkp2p.engine.cache.prefix_cache import PrefixCache
    from skulkp2p.engine.model.forward import StageCache
    from skulkp2p.engine.model.stage import StageModel
    from skulkp2p.engine.parallel.ring.batch_rows import StageRows

__all__ = ["InProcessLink", "RingError", "RingForward", "RingLink", "StageWorker"]

log = logging.getLogger("skulkp2p.ring")


class StageWorker:
    """A stage that is not the last: frame in -> frame for the next stage (or None: dropped)."""

    def __init__(self, stage: StageModel, term: int, prefix_cache: PrefixCache | None = None):
        self.stage = stage
        self.term = term
        self.sessions: dict[str, tuple[str, int, StageCache]] = {}  # request -> (instance, step)
        self.dropped = 0
        # This stage's own entries (engine/cache/prefix_cache.py), under the keys the last stage
        # names: a "restore" frame asks for a cached prefix, a "store" field keeps one.
        self.prefix_cache = prefix_cache
        self.rows: StageRows | None = None  # the batch, once a batch frame came

    def _batch(self) -> StageRows:
        if self.rows is None:
            from skulkp2p.engine.parallel.ring.batch_rows import StageRows
            self.rows = StageRows(self)
        return self.rows

    def handle(self, msg: Frame) -> Frame | None:
        try:
            return self._handle(msg)
        except (KeyError, TypeError, ValueError, wire.WireError) as e:
            self.dropped += 1
            log.warning("ring: dropping a bad frame: %s: %s", type(e).__name__, e)
            return None

    def _handle(self, msg: dict[str, Any]) -> Frame | None:
        # (`msg`'s fields are read as they come: a bad one raises, and handle drops the frame)
        if msg.get("t") != FRAME or msg["term"] != self.term:
            self.dropped += 1  # another term's ring: its placement is gone
            return None
        if msg.get("at", self.stage.span.start) != self.stage.span.start:
            # Sent for another cut of the layers (a re-placement within the same term): this
            # stage would run the wrong layers on it.
            self.dropped += 1
            return None
        request, instance, step, op = msg["request"], msg["instance"], msg["step"], msg["op"]
        if op == "batch":  # several requests' rows in one frame (engine/parallel/ring/batch_rows.py)
            return self._batch().handle(msg)
        known = self.sessions.get(request)
        if op == "end" and self.rows is not None and self.rows.holds(request):
            self.rows.end(msg)  # a row of the batch: freed now, not at the next batch frame
            return {**msg, "at": self.stage.span.end}
        if op == "end":
            if known is not None and known[0] == instance:
                session = known[2]
                if msg.get("store"):
                    if msg.get("keep") is not None:
                        session.keep_path(int_list(msg["keep"], "keep"))
                    if msg.get("rollback"):
                        session.rollback(*(int(v) for v in msg["rollback"]))
                    self._store(session, msg["store"], msg.get("store_disk") is not False)
                del self.sessions[request]
            return {**msg, "at": self.stage.span.end}
        if step == 0 and known is None:
            from skulkp2p.engine.model.forward import StageCache
            known = (instance, -1, StageCache(self.stage))
        if known is None or known[0] != instance or step != known[1] + 1:
            self.dropped += 1  # unknown request, a restarted sender, or a frame out of step
            return None
        session = known[2]
        t0 = time.perf_counter()
        if op == "restore":
            length, key = msg["prefix"]
            missed = [int(v) for v in msg.get("missed") or []]
            if not self._restore(session, int(length), key):
                missed.append(self.stage.span.start)  # this stage lacks the entry: say so
            self.sessions[request] = (instance, step, session)
            return {**header(self.term, instance, request, step, op), "x": None,
                    "at": self.stage.span.end,
                    "prefix": msg["prefix"], "missed": missed,
                    "cs": [*seconds_list(msg.get("cs")), round(time.perf_counter() - t0, 6)]}
        raw, parents = open_payload(msg["x"])
        tree = None if parents is None else int_list(parents, "a tree's parents")
        if tree is not None:
            if op != "verify":
                raise ValueError(f"a tree in a {op!r} frame (only a verify carries one)")
        if msg.get("keep") is not None:  # the last tree's accepted path (before anything else)
            session.keep_path(int_list(msg["keep"], "keep"))
        if msg.get("rollback"):
            keep, dropped = msg["rollback"]
            session.rollback(int(keep), int(dropped))
        if msg.get("store"):
            self._store(session, msg["store"], msg.get("store_disk") is not False)
        x: list[int] | mx.array
        if self.stage.span.first:
            if not isinstance(raw, list) or not raw:
                raise ValueError("the first stage needs a non-empty token list")
            x = int_list(raw, "the first stage's tokens")
        else:
            x = wire.unpack_array(raw, as_mlx=True)
        out, _ = session.run(x, verify=op == "verify", tree=tree)
        self.sessions[request] = (instance, step, session)
        packed = wire.pack_array(out) if tree is None else tree_payload(wire.pack_array(out),
                                                                        parents)
        # The decision travels on with the rows, for the stages after this one; so does each
        # stage's compute time ("cs", seconds per stage), which tells the last stage how much
        # of a traversal was compute and how much was link.
        return {**header(self.term, instance, request, step, op), "x": packed,
                "at": self.stage.span.end,
                "rollback": msg.get("rollback"), "store": msg.get("store"),
                "store_disk": msg.get("store_disk"), "keep": msg.get("keep"),
                "cs": [*seconds_list(msg.get("cs")), round(time.perf_counter() - t0, 6)]}

    def _restore(self, session: StageCache, length: int, key: list[int]) -> bool:
        """Put the session's caches at exactly `length` cached positions (0: empty)."""
        if length == 0:
            session.reset()
            return True
        if self.prefix_cache is None or not isinstance(key, list) or len(key) != length + 1:
            return False
        hit = self.prefix_cache.fetch(key, want=length)
        if hit is None:
            return False
        session.adopt(hit.caches)
        return True

    def _store(self, session: StageCache, key: object, disk: bool = True) -> None:
        if self.prefix_cache is not None and isinstance(key, list):
            self.prefix_cache.store(key, session.cache, persist=disk)


class RingForward:
    """The Forward seam over a ring, run on the last stage. `link` reaches the other stages."""

    def __init__(self, stage: StageModel, link: RingLink, *, term: int, instance: str,
                 request: str, prefill_step: int = 2048, hidden: str | None = None,
                 interrupt: Callable[[], None] | None = None):
        if not stage.span.last:
            raise ValueError("RingForward runs on the last stage")
        self.stage = stage
        self.link = link
        self.term, self.instance, self.request = term, instance, request
        self.prefill_step = prefill_step
        self.hidden = hidden
        self.interrupt = interrupt
        from skulkp2p.engine.model.forward import StageCache
        self.local = StageCache(stage)
        self.last_hidden: mx.array | None = None
        self.step = 0
        self._pending: tuple[int, int] | None = None  # the decision the next frame carries
        # A tree's accepted path and a prefix-cache key the next frame carries (ints, as frame
        # values)
        self._keep: list[WireValue] | None = None
        # Whether this ring verifies token trees: every stage is of the same family, so this
        # stage's layers say it (attention-only llama, qwen2, qwen3).
        from skulkp2p.engine.model.tree import tree_capable
        self.trees = tree_capable(stage.model)
        self._store: list[WireValue] | None = None
        self._store_disk = True  # the stages keep that entry on their disk too
        self.link_rows = 0  # hidden rows that crossed into this stage (for reports)
        # Where the time went (for reports): waiting on the traversal, of which the other
        # stages' own compute (they report it in the frame), and this stage's compute.
        self.traversals = 0
        self.wait_s = 0.0
        self.stages_compute_s = 0.0
        self.compute_s = 0.0

    @property
    def cache(self) -> list[CacheEntry]:
        return self.local.cache

    def _send(self, op: str, tokens: WireValue, **extra: WireValue) -> Frame:
        # "at": the layer the receiving stage must start at (the first stage: 0); each stage
        # passes on where it ended, and a stage cut differently drops the frame.
        msg: Frame = {**header(self.term, self.instance, self.request, self.step, op), "x": tokens,
               "at": 0,
               "rollback": list(self._pending) if self._pending else None,
               "store": self._store, "keep": self._keep, **self._store_flags(), **extra}
        t0 = time.perf_counter()
        out = self.link.traverse(msg)
        self.wait_s += time.perf_counter() - t0
        self.traversals += 1
        self.stages_compute_s += sum(seconds_list(out.get("cs")))
        check_answer(out, self.step, self.request, self.stage.span.start)
        self.step += 1
        self._pending = None
        self._store = None
        self._store_disk = True
        self._keep = None
        return out

    def _traverse(self, op: str, tokens: WireValue) -> mx.array:
        out = self._send(op, tokens)
        rows = wire.unpack_array(open_payload(out["x"])[0], as_mlx=True)
        self.link_rows += rows.shape[0]
        return rows

    def restore(self, cache: list[CacheEntry], tokens: list[int], key: list[int]) -> int:
        """Go on from this stage's caches for `tokens` (a prefix-cache hit here) if every other
        stage restores its own entry for them too: one traversal asks each for the entry under
        `key` (tokens and the next one), at exactly that length. Returns the tokens now held:
        len(tokens), or 0 when a stage missed (every stage is then reset, and the prompt is
        prefilled whole: never a wrong answer)."""
        length = len(tokens)
        out = self._send("restore", None, prefix=[length, [int(t) for t in key]])
        missed = out.get("missed") or []
        if missed:
            log.info("ring: prefix of %d tokens missing on the stage(s) starting at layer %s: "
                     "full prefill", length, ", ".join(str(m) for m in wire.as_list(missed)))
            self._send("restore", None, prefix=[0, []])  # the stages that restored start over
            return 0
        self.local.adopt(cache)
        return length

    def share_store(self, key: list[int], disk: bool = True) -> None:
        """Have the other stages keep their caches under `key` too (with the next frame, or the
        end of the request), before they run anything more; `disk`: on their disk too."""
        self._store = [int(t) for t in key]
        self._store_disk = disk

    def _store_flags(self) -> Frame:
        """What a frame carrying `store` says besides the key ("store_disk": false when the
        request keeps its entries off the disk; absent otherwise)."""
        return {"store_disk": False} if self._store is not None and not self._store_disk else {}

    def prefill(self, tokens: list[int]) -> None:
        import mlx.core as mx
        rows = []
        for start in range(0, len(tokens), self.prefill_step):
            if self.interrupt is not None:
                self.interrupt()
            h = self.prefill_chunk(tokens[start:start + self.prefill_step])
            if h is not None:
                rows.append(h)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    def prefill_chunk(self, tokens: list[int]) -> mx.array | None:
        """One chunk of the prompt through the ring into this request's caches; its trunk rows
        when `hidden` asks for them."""
        x = self._traverse("prefill", list(tokens))  # (a list of frame values)
        t0 = time.perf_counter()
        _, h = self.local.run(x, verify=False, hidden=self.hidden)
        self.compute_s += time.perf_counter() - t0
        return h

    def note_rollback(self, keep: int, dropped: int) -> None:
        """A batched row's rollback (its caches here are the batch's): only the decision, for
        the other stages, on the next frame."""
        if dropped > 0:
            self._pending = (keep, dropped)

    def __call__(self, tokens: list[int]) -> mx.array:
        x = self._traverse("verify", list(tokens))
        t0 = time.perf_counter()
        logits, h = self.local.run(x, verify=True, logits=True, hidden=self.hidden)
        self.compute_s += time.perf_counter() - t0
        if h is not None:
            self.last_hidden = h
        return _logits(logits)

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """Logits [w, V] of a token tree (node 0 the pending token; `parents` as engine/model/tree.py)
        in ONE traversal: every stage runs it under the tree's mask and positions. `keep_path`
        then keeps the accepted path, here now and on the other stages with the next frame."""
        from skulkp2p.engine.model.tree import validate_parents
        if not self.trees:
            raise ValueError("this model verifies chains only (not an attention-only family)")
        validate_parents(parents)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        x = self._traverse("verify", tree_payload([int(t) for t in tokens],
                                                  [int(p) for p in parents]))
        t0 = time.perf_counter()
        logits, h = self.local.run(x, verify=True, logits=True, hidden=self.hidden,
                                   tree=parents)
        self.compute_s += time.perf_counter() - t0
        if h is not None:
            self.last_hidden = h
        return _logits(logits)

    def keep_path(self, path: list[int]) -> None:
        """Keep node 0 and the accepted path of the last tree: here now, on the other stages
        before they run their next frame (it carries the path)."""
        import mlx.core as mx
        t0 = time.perf_counter()
        self.local.keep_path(path)
        self.compute_s += time.perf_counter() - t0
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[mx.array([0, *path])]
        self._keep = [int(j) for j in path]

    def note_keep(self, path: list[int]) -> None:
        """A batched row's kept path (its caches here are the batch's): only the path, for the
        other stages, on the next frame."""
        self._keep = [int(j) for j in path]

    def rollback(self, keep: int, dropped: int) -> None:
        if dropped <= 0:
            return
        t0 = time.perf_counter()
        self.local.rollback(keep, dropped)
        self.compute_s += time.perf_counter() - t0
        self._pending = (keep, dropped)

    # The rest of the Forward seam (engine/model/forward.py), declared: a ring runs the round
    # loop (each step is a traversal), and its other stages keep their caches with the next
    # frame.
    def may_run_ahead(self) -> bool:
        return False

    def lazy_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        raise NotImplementedError("a ring has no lazy steps")

    def end_run_ahead(self) -> None:
        return None

    def keep_in_group(self, key: list[int], disk: bool = True) -> int:
        return 0

    def close(self) -> None:
        """Free the request's caches on the other stages (best effort)."""
        msg: Frame = {**header(self.term, self.instance, self.request, self.step, "end"), "at": 0}
        if self._store is not None:  # the stages undo the last rejected drafts, then keep
            msg.update(store=self._store, keep=self._keep,
                       rollback=list(self._pending) if self._pending else None,
                       **self._store_flags())
        try:
            self.link.send(msg)
        except Exception as e:  # the ring may be gone already; the stages time sessions out
            log.debug("ring: end of %s not sent: %s", self.request, e)


def _logits(out: mx.array | None) -> mx.array:
    """A last stage's run with logits=True (which always gives them)."""
    if out is None:
        raise RuntimeError("the last stage's forward gave no logits")
    return out


class InProcessLink:
    """Stages in this process, every frame through the wire codec (tests, and the reference
    for what the TCP link must do)."""

    def __init__(self, workers: list[StageWorker], secret: str | None = None):
        self.workers = workers
        self.key = wire.frame_key(secret)
        self.bytes = 0

    def _through(self, msg: Frame) -> Frame:
        frame = wire.encode_frame(msg, self.key, wire.DATA_MAX_FRAME)
        self.bytes += len(frame)
        dec = wire.FrameDecoder(self.key, wire.DATA_MAX_FRAME)
        (decoded,) = dec.feed(frame)
        return decoded

    def traverse(self, msg: Frame) -> Frame:
        cur = msg
        for w in self.workers:
            out = w.handle(self._through(cur))
            if out is None:
                raise RingError("a stage dropped the frame")
            cur = out
        return self._through(cur)

    def send(self, msg: Frame) -> None:
        cur = msg
        for w in self.workers:
            out = w.handle(self._through(cur))
            if out is None:
                return
            cur = out
