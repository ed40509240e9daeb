"""The prefix cache: a request reuses the caches an earlier request on this node left for the
longest prefix of its prompt, and prefills only the rest. In memory, and optionally behind it on
disk (disk_store.py: a lookup that an entry on disk serves better loads it into memory).

One per model: the MlxEngine owns one for its model (or for the layers it holds, on a ring's last
stage), and every other ring stage's StageWorker owns one for its own layers. Each is used by one
thread only, one request at a time (the model's worker thread; a stage's executor thread), so
there is no lock; `read_ahead` alone may run beside it (it reads the disk store, which has a lock
of its own).

What an entry holds. An entry is stored under a token sequence K and holds the caches after the
model ran every token of K but the last: the decode loop's state after a prefill (K = the prompt,
whose last token is pending) and at the end of a request (K = prompt + every emitted token; the
last one is pending, never run). A prompt P that starts with K restores |K| - 1 positions and
prefills P[|K| - 1 : -1]; its first token is K's last, so the multi-turn case (the next turn's
prompt extends this turn's prompt and answer) hits the entry stored at the end of the turn.

- Plain KV caches trim exactly: such an entry also serves a prompt that shares only its first c
  tokens (trimmed to c - 1 positions on fetch), and a longer entry makes its prefixes redundant.
- Recurrent state (gated-delta layers of hybrid models) and rotating windows cannot trim: their
  entries serve only prompts that extend K exactly, so they are stored at the boundaries where
  the state is at hand: the end of every prompt and the end of every request.
- The MTP head's own cache rides along: its row i pairs the trunk's h_i with token i + 1, so the
  rows of positions below |K| - 1 are fixed by K; so does the trunk's hidden row of its last
  row. A hit gives the head its rows but the last, and that hidden row: the head recomputes its
  last row, whose logits are its first draft, exactly as after a cold prefill (a head restored
  to fewer rows than the entry has recomputes a row of the prefill instead). When the head
  stopped following (its gate switched it off), the entry keeps the rows it had; a request
  drafting with the head then uses at most that many positions.
- A draft model's cache is not kept: it rebuilds over the prompt (a drafter; exactness never
  depends on it).

Copy on fetch: a hit hands out new cache objects. KV buffers are shared as slices (mlx arrays are
values: a write through the request's cache makes new data, the entry's never changes); recurrent
state is copied. Entries are bounded by the bytes of their arrays (the whole KV buffers they keep
alive), least recently used first out.

mlx-lm's PromptTrie finds the entries (longest prefix, or the shortest entry past the point where
the prompt leaves the trie). Its LRUPromptCache does not fit as a whole: it assumes an entry's
caches hold all of K, deep-copies on fetch and orders eviction by insertion, not use.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, PromptTrie

from skulkp2p.engine.cache import caches
from skulkp2p.engine.cache.caches import CacheEntry
from skulkp2p.engine.cache.disk_store import DiskEntry, PrefixDiskStore, RawEntry, StoredEntry
from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB

__all__ = ["DEFAULT_PREFIX_CACHE_MB", "MB", "PrefixCache", "PrefixHit", "RawEntry"]

log = logging.getLogger("skulkp2p.prefix")

MB = 1 << 20

_NS = "model"  # the trie's namespace: one cache serves one model (or one stage's layers)
_KV_TYPES = ("KVCache", "ConcatenateKVCache")  # keys/values [B, H, S, D] up to `offset`


@dataclass
class _Entry:
    key: tuple[int, ...]
    caches: list[CacheEntry]  # hold len(key) - 1 positions
    mtp: KVCache | None  # the MTP head's KVCache, `mtp_rows` rows
    mtp_rows: int
    mtp_hidden: mx.array | None  # the trunk's hidden row paired in the head's last row [H]
    trimmable: bool
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.key) - 1

    @property
    def has_hidden(self) -> bool:
        return self.mtp_hidden is not None


class _Planned(Protocol):
    """What plans a hit on an entry, in memory (_Entry) or on disk (DiskEntry)."""
    @property
    def length(self) -> int: ...
    @property
    def trimmable(self) -> bool: ...
    @property
    def mtp_rows(self) -> int: ...
    @property
    def has_hidden(self) -> bool: ...


@dataclass
class PrefixHit:
    """Fresh caches for the first `length` tokens of the prompt; for an MTP request, the head's
    cache over the first `length` positions, or, with `mtp_hidden`, over all but the last one,
    whose row the head recomputes from `mtp_hidden` (the cache is None when that leaves none)."""
    length: int
    caches: list[CacheEntry]
    mtp: KVCache | None = None
    mtp_hidden: mx.array | None = None


class _KV(CacheEntry, Protocol):
    """An entry of _KV_TYPES holding keys: its buffers [B, H, capacity, D] up to `offset`."""
    keys: mx.array
    values: mx.array
    offset: int


class _Trims(CacheEntry, Protocol):
    """An entry whose caches trim exactly (what the prefix cache stores trimmable)."""
    def trim(self, n: int) -> int: ...


_C = TypeVar("_C", bound=CacheEntry)


def _is_kv(cache: object) -> bool:
    return type(cache).__name__ in _KV_TYPES and getattr(cache, "keys", None) is not None


def _leaves(tree: object) -> list[mx.array]:
    # (tree_flatten's return type allows the dict it gives only when passed one to fill)
    flat = cast(list[tuple[str, object]], tree_flatten(tree))
    return [v for _, v in flat if isinstance(v, mx.array)]


def _array_bytes(value: object) -> int:
    return sum(v.nbytes for v in _leaves(value))


def _held_bytes(cache: CacheEntry) -> int:
    if _is_kv(cache):
        kv = cast(_KV, cache)
        return kv.keys.nbytes + kv.values.nbytes  # the whole buffers a slice keeps alive
    return _array_bytes(cache.state)


def _detach(cache: _C, length: int) -> _C:
    """A new cache object for the first `length` positions of `cache`, sharing nothing that
    either side could change: KV buffers as slices, everything else copied."""
    new = copy.copy(cache)
    if _is_kv(cache):
        kv, new_kv = cast(_KV, cache), cast(_KV, new)
        new_kv.keys = kv.keys[..., :length, :]
        new_kv.values = kv.values[..., :length, :]
        new_kv.offset = length
        return new
    new.state = caches.copy_state(cache.state)
    offset = getattr(new, "offset", None)
    if offset is not None and offset > length:
        cast(_Trims, new).trim(offset - length)  # only entries whose caches trim exactly get here
    return new


def _arrays(objs: Sequence[CacheEntry | None]) -> list[mx.array]:
    out: list[mx.array] = []
    for c in objs:
        if c is None:
            continue
        state = (cast(_KV, c).keys, cast(_KV, c).values) if _is_kv(c) else c.state
        out.extend(_leaves(state))
    return out


class PrefixCache:
    """Entries of one model's caches by token prefix, LRU, bounded in bytes."""

    def __init__(self, max_bytes: int, disk: PrefixDiskStore | None = None):
        """`disk`: the entries on disk behind this cache (None: memory only)."""
        if max_bytes <= 0:
            raise ValueError("a prefix cache needs a positive size (0 turns it off: no cache)")
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        # Counters for reports: lookups that found something, that did not, tokens restored.
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.disk = disk
        self.disk_hits = 0  # lookups served by an entry loaded from disk

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict[str, int]:
        out = {"entries": len(self._lru), "bytes": self.nbytes, "max_bytes": self.max_bytes,
               "hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens}
        if self.disk is not None:
            out.update(self.disk.stats(), disk_hits=self.disk_hits)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued for the disk (for up to `timeout` s) and stop its writer."""
        if self.disk is not None:
            self.disk.close(timeout)

    def clear(self) -> None:
        for key in list(self._lru):
            self._remove(key)

    # ---------------------------------------------------------------------------- lookups

    def read_ahead(self, tokens: list[int]) -> RawEntry | None:
        """The entry on disk that would restore the most positions of `tokens`, read and
        checked without MLX: called on the request's thread before it takes the model's lock
        (the only part of this cache that is thread-safe: it reads the disk store, and asks
        the memory only whether it holds that very entry), so that other requests' rows decode
        while the file is read. A hint for `fetch`, which plans again under the lock and uses
        it only where it is still the entry to load. None: no disk, nothing better on disk."""
        disk = self.disk
        if disk is None or len(tokens) < 2:
            return None
        best: tuple[int, DiskEntry] | None = None
        for entry, common in disk.candidates(tokens):
            plan = self._plan(entry, common, False, len(tokens), None)
            if plan is not None and (best is None or plan[0] > best[0]):
                best = (plan[0], entry)
        if best is None or best[1].key in self._lru:  # (a dict lookup: safe off the lock)
            return None
        return disk.read(best[1])

    def fetch(self, tokens: list[int], *, mtp: bool = False,
              want: int | None = None, read: RawEntry | None = None) -> PrefixHit | None:
        """The longest reusable prefix of `tokens` (a prompt whose last token is pending), as
        fresh caches; None when nothing of at least one token is cached. `mtp`: the request
        drafts with the MTP head, whose rows must cover the positions restored too. `want`:
        exactly this many positions or nothing (a ring stage following the last stage).
        `read`: what `read_ahead` read for these tokens (installed if it is the entry on disk
        to load, else ignored)."""
        found = self._best(list(tokens), mtp, want)
        from_disk = False
        if self.disk is not None and self._load_better(
                list(tokens), mtp, found[1] if found is not None else 0, read, want):
            found, from_disk = self._best(list(tokens), mtp, want), True
        if found is None:
            self.misses += 1
            return None
        entry, length, use_hidden = found
        self._lru.move_to_end(entry.key)
        if self.disk is not None:
            self.disk.touch(entry.key)
        self.disk_hits += from_disk
        hit = PrefixHit(length, [_detach(c, length) for c in entry.caches])
        # (an entry without the head's rows never gives an MTP request positions: _mtp_plan)
        if use_hidden:
            hit.mtp = _detach(entry.mtp, length - 1) if length > 1 and entry.mtp else None
            hit.mtp_hidden = entry.mtp_hidden
        elif mtp and entry.mtp is not None:
            hit.mtp = _detach(entry.mtp, length)
        mx.eval(_arrays(hit.caches + [hit.mtp]))
        self.hits += 1
        self.reused_tokens += length
        return hit

    def _best(self, tokens: list[int], mtp: bool, want: int | None
              ) -> tuple[_Entry, int, bool] | None:
        """(entry, positions to restore, whether the head recomputes its last row from the
        stored hidden row) for the longest usable prefix."""
        if len(tokens) < 2 or not self._lru:
            return None
        found = self._trie.search(_NS, tokens)
        candidates: list[tuple[list[int], int | None]] = []
        if found.exact is not None:
            candidates.append((found.exact, None))
        if found.shorter is not None:
            candidates.append((found.shorter, None))
        if found.longer is not None:
            candidates.append((found.longer, found.common_prefix))
        best: tuple[_Entry, int, bool] | None = None
        for key, common in candidates:
            entry = self._lru.get(tuple(key))
            if entry is None:
                continue
            plan = self._plan(entry, common, mtp, len(tokens), want)
            if plan is not None and (best is None or plan[0] > best[1]):
                best = (entry, *plan)
        return best

    def _plan(self, entry: _Planned, common: int | None, mtp: bool, n_tokens: int,
              want: int | None) -> tuple[int, bool] | None:
        """(positions to restore, whether the head recomputes its last row) from `entry`, whose
        key is a prefix of the prompt (`common` None) or leaves it at `common`; None: none."""
        if common is None:  # the entry's key is a prefix of the prompt
            length = entry.length
        elif entry.trimmable:  # the prompt leaves the key at `common`
            length = common - 1
        else:
            return None
        use_hidden = False
        if mtp:
            length, use_hidden = self._mtp_plan(entry, length, n_tokens)
        if want is not None:
            if length < want or (length > want and not entry.trimmable):
                return None
            length = want
        return (length, use_hidden) if length > 0 else None

    def _load_better(self, tokens: list[int], mtp: bool, have: int,
                     read: RawEntry | None = None, want: int | None = None) -> bool:
        """Load into memory the entry on disk that restores the most positions of `tokens`
        (exactly `want`, when given), if it restores more than `have` (what memory gives);
        `read`: one read ahead, used when it is that entry's file as indexed now. False when
        none does or none of those loads (a file refused is removed by the store: a miss,
        never wrong caches)."""
        assert self.disk is not None
        if len(tokens) < 2:
            return False
        plans: list[tuple[int, DiskEntry]] = []
        for entry, common in self.disk.candidates(tokens):
            plan = self._plan(entry, common, mtp, len(tokens), want)
            if plan is not None and plan[0] > have:
                plans.append((plan[0], entry))
        for _, entry in sorted(plans, key=lambda p: -p[0]):
            raw = read if read is not None and read.index == entry else self.disk.read(entry)
            stored = self.disk.install(raw) if raw is not None else None
            if stored is not None and stored.key == entry.key and self._insert(stored):
                return True
        return False

    @staticmethod
    def _mtp_plan(entry: _Planned, length: int, n_tokens: int) -> tuple[int, bool]:
        """How many positions an MTP request can restore from `entry` (`length` for the trunk
        alone), and whether the head recomputes its last restored row from the stored hidden
        row. Its first draft comes from a row computed by this request: the recomputed one, or
        else a row of the prefill, so then one token of the prompt is left to prefill."""
        rows = entry.mtp_rows
        if length > rows:
            if not entry.trimmable:
                return 0, False
            length = rows
        if length == rows and entry.has_hidden:
            return length, True
        if length <= n_tokens - 2:
            return length, False
        return (n_tokens - 2, False) if entry.trimmable else (0, False)

    # ---------------------------------------------------------------------------- storing

    def entry_bytes(self, key: list[int]) -> int | None:
        """The bytes the entry stored under exactly `key` counts against the bound, or None."""
        entry = self._lru.get(tuple(int(t) for t in key))
        return None if entry is None else entry.nbytes

    def store(self, key: list[int], stage_caches: Sequence[CacheEntry],
              mtp: KVCache | None = None, mtp_hidden: mx.array | None = None, *,
              trim: bool = True,
              elsewhere_bytes: int = 0, persist: bool = True) -> bool:
        """Keep `stage_caches` (and the MTP head's cache, with the trunk's hidden row paired in
        its last row) as the state after every token of `key` but the last. They are detached
        here, so the caller may go on using its caches. `trim=False`: serve the entry at its
        own length only, even if these caches could trim (the last stage of a ring whose other
        stages hold recurrent state). `elsewhere_bytes`: what the entry holds in other processes
        (a tensor group's ranks keep the caches, this cache only the index: the largest rank's
        slice), counted against the bound so that the index evicts as the ranks do. `persist`:
        the entry goes to disk too, when this cache has a disk store (False: its request said
        no). False when nothing was stored (caches not at that length, or too big for the
        cache)."""
        held = tuple(int(t) for t in key)
        length = len(held) - 1
        if length < 1:
            return False
        offsets = {o for c in stage_caches if (o := getattr(c, "offset", None)) is not None}
        if offsets and offsets != {length}:
            log.warning("prefix cache: caches hold %s positions, the key says %d: not stored",
                        sorted(offsets), length)
            return False
        mtp_rows = 0
        if mtp is not None:
            mtp_rows = min(int(mtp.offset), length)
            if mtp_rows < int(mtp.offset):
                mtp_hidden = None  # paired with a row past the key
            mtp = _detach(mtp, mtp_rows) if mtp_rows > 0 else None
        if mtp is None:
            mtp_rows, mtp_hidden = 0, None
        elif mtp_hidden is not None:
            mtp_hidden = mx.array(mtp_hidden)
        detached = [_detach(c, length) for c in stage_caches]
        mx.eval(_arrays(detached + [mtp]) + ([mtp_hidden] if mtp_hidden is not None else []))
        nbytes = sum(_held_bytes(c) for c in stage_caches) + (
            _held_bytes(mtp) if mtp is not None else 0) + (
            mtp_hidden.nbytes if mtp_hidden is not None else 0) + max(0, int(elsewhere_bytes))
        if nbytes > self.max_bytes:
            log.debug("prefix cache: an entry of %d tokens (%.1f MB) exceeds the cache's %.1f MB",
                      length, nbytes / MB, self.max_bytes / MB)
            return False
        entry = _Entry(held, detached, mtp, mtp_rows, mtp_hidden,
                       trim and caches.exactly_trimmable(stage_caches), nbytes)
        self._add(entry)
        if persist and self.disk is not None:
            try:  # (a copy of its arrays, queued: the writer thread writes it)
                self.disk.put(StoredEntry(held, list(detached), mtp, mtp_rows, mtp_hidden,
                                          entry.trimmable))
            except Exception:  # the entry is kept in memory whatever the disk does
                log.exception("prefix cache: queueing an entry for the disk failed")
        return True

    def _insert(self, stored: StoredEntry) -> bool:
        """Keep an entry loaded from disk (not written again)."""
        mtp = cast(KVCache | None, stored.mtp)
        nbytes = sum(_held_bytes(c) for c in stored.caches) + (
            _held_bytes(mtp) if mtp is not None else 0) + (
            stored.mtp_hidden.nbytes if stored.mtp_hidden is not None else 0)
        if nbytes > self.max_bytes or len(stored.key) < 2:
            return False
        self._add(_Entry(stored.key, stored.caches, mtp, stored.mtp_rows, stored.mtp_hidden,
                         stored.trimmable, nbytes))
        return True

    def _add(self, entry: _Entry) -> None:
        if entry.key in self._lru:
            self._remove(entry.key)
        self._trie.add(_NS, list(entry.key), entry)
        self._lru[entry.key] = entry
        self.nbytes += entry.nbytes
        if entry.trimmable:
            self._drop_covered(entry)
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._lru)))

    def _drop_covered(self, entry: _Entry) -> None:
        """Entries under prefixes of a trimmable entry's key are served by it (trimmed), unless
        they keep MTP rows it lacks."""
        popped = self._trie.pop_prefixes(_NS, list(entry.key))
        for n, old in popped:
            if old.mtp_rows <= entry.mtp_rows:
                self._lru.pop(old.key, None)
                self.nbytes -= old.nbytes
            else:
                self._trie.add(_NS, list(entry.key[:n]), old)

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self._lru.pop(key)
        self._trie.pop(_NS, list(key))
        self.nbytes -= entry.nbytes
