"""Cache checkpoint and rollback for every cache type mlx-lm builds: the one place these rules
live (the trunk's forward, every ring stage and the draft model use them).

Plain KV caches trim; a rotating (sliding-window) cache fed several tokens at once is cut back at
the end of its time-ordered buffer. Caches that cannot trim (recurrent state of gated-delta
layers, rotating caches fed one token that have wrapped or may wrap) are snapshotted before the
call and restored on rejection; the caller then re-runs the tokens it kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias, cast

import mlx.core as mx

# A cache entry's state as mlx-lm's `state` property gives and takes it: (keys, values) of a KV
# cache, a tuple of tuples for a quantized one, a list of arrays (or None) for recurrent state.
State: TypeAlias = "mx.array | None | list[State] | tuple[State, ...]"


class CacheEntry(Protocol):
    """What every mlx-lm cache entry has (mlx_lm.models.cache._BaseCache: KVCache,
    RotatingKVCache, ArraysCache, ...; mlx-lm has no type information): its state, read and
    written whole, and whether it trims. What only some types have (an offset, trim, settings,
    a rotating cache's window) the rules below read by the entry's type (_Trims, _HasMeta,
    _Rotating)."""

    @property
    def state(self) -> State: ...

    @state.setter
    def state(self, value: State) -> None: ...

    def is_trimmable(self) -> bool: ...


class _HasMeta(CacheEntry, Protocol):
    """An entry with settings besides its arrays (a rotating cache's window, a quantized one's
    bits)."""
    meta_state: object


class _Trims(CacheEntry, Protocol):
    """An entry that trims (is_trimmable(), or a rotating cache cut at its end)."""
    offset: int

    def trim(self, n: int) -> int: ...


class _Rotating(_Trims, Protocol):
    """mlx-lm's RotatingKVCache: a sliding window of `max_size` entries."""
    keys: mx.array | None
    values: mx.array  # (None only while keys are)
    max_size: int
    keep: int
    _idx: int

# Cache types whose trim(n) is exact however far back it goes. A RotatingKVCache trims only until
# it wraps, a ChunkedKVCache only back to its last front trim.
_EXACT_TRIM = ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")


def _cuts_after_concat(entry: CacheEntry, incoming: int | None) -> bool:
    """A rotating cache fed several entries at once (mlx-lm's `_update_concat`) holds them in a
    buffer in time order after the max_size - 1 entries before them, evicting nothing it still
    needs: cutting up to incoming - 1 entries off that buffer's end (a verify keeps its first
    token) undoes them exactly, wrapped or not (a sliding-window target, e.g. Gemma, then rolls
    back a verify without a snapshot; cutting more raises, see _trim_entry)."""
    return (type(entry).__name__ == "RotatingKVCache" and incoming is not None and incoming > 1
            and getattr(entry, "keep", 0) == 0)


def _trim_entry(entry: CacheEntry, n: int) -> None:
    rotating = cast(_Rotating, entry)  # read as one only where its type is
    keys = getattr(entry, "keys", None)
    if (type(entry).__name__ == "RotatingKVCache" and keys is not None
            and rotating._idx == keys.shape[2]):  # noqa: SLF001
        # The buffer is in time order (after a multi-entry update): cut its end, so that it
        # stays in time order (mlx-lm's own trim only moves the write position). It must keep
        # a whole window: mlx-lm's next one-token update cannot grow a wrapped buffer.
        if keys.shape[2] - n < min(rotating.max_size, rotating.offset - n):
            raise ValueError(f"cannot cut {n} entries off a rotating cache of "
                             f"{keys.shape[2]} (window {rotating.max_size})")
        rotating.keys = keys[..., : keys.shape[2] - n, :]
        rotating.values = rotating.values[..., : keys.shape[2] - n, :]
        rotating.offset -= n
        rotating._idx -= n  # noqa: SLF001
        return
    cast(_Trims, entry).trim(n)


def _trimmable(entry: CacheEntry, incoming: int | None = 0, cut: bool = True) -> bool:
    """Whether `incoming` more tokens can be appended and later trimmed off again (None: any
    number, e.g. a drafter that feeds several rounds before it rewinds). A rotating
    (sliding-window) cache fed one token at a time trims only while nothing has wrapped: if the
    append would wrap it, the evicted entries could not come back on a trim, so it needs a
    snapshot instead; fed several at once it can always be cut back (_cuts_after_concat)."""
    if incoming is None:
        return type(entry).__name__ in _EXACT_TRIM
    if cut and _cuts_after_concat(entry, incoming):
        return True
    if not (hasattr(entry, "is_trimmable") and entry.is_trimmable()):
        return False
    max_size = getattr(entry, "max_size", None)
    return max_size is None or cast(_Trims, entry).offset + incoming < max_size


def exactly_trimmable(cache: Sequence[CacheEntry]) -> bool:
    """Every entry trims back any distance: rewinds never need a snapshot."""
    return all(_trimmable(c, None) for c in cache)


def needs_snapshot(cache: Sequence[CacheEntry], incoming: int | None) -> bool:
    return not all(_trimmable(c, incoming) for c in cache)


def trim(cache: Sequence[CacheEntry], n: int) -> None:
    for entry in cache:
        _trim_entry(entry, n)


def compact_positions(start: int, path: list[int]) -> tuple[list[int], list[int]] | None:
    """A token tree's compaction (engine/model/tree.py): the moves that keep node 0 at `start`
    and the accepted path's nodes right after it: (destinations, sources), or None when the
    path is already in place (a chain's accepted prefix)."""
    if path == list(range(1, len(path) + 1)):
        return None
    return ([start + 1 + j for j in range(len(path))], [start + p for p in path])


def copy_state(value: State) -> State:
    """A deep copy of a cache's state: caches write into their buffers in place, so a snapshot
    needs arrays of its own."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    return value


# What a snapshot keeps of one entry: ("offset", n) for an entry that trims back over the call,
# else ("state", (a copy of its state, its meta_state or None)).
Saved: TypeAlias = "tuple[Literal['offset'], int] | tuple[Literal['state'], tuple[State, object]]"


@dataclass
class Snapshot:
    entries: list[Saved]


def snapshot(cache: Sequence[CacheEntry], incoming: int | None) -> Snapshot:
    """The cache's state before `incoming` more entries (None: any number) are appended: offsets
    of the entries that can trim back over them, copies of every other entry's state."""
    entries: list[Saved] = []
    copies = []
    for entry in cache:
        # A snapshot is restored by undoing the whole call, which a cut cannot do for a
        # wrapped rotating cache (it keeps only a window before the new entries): copy those.
        if _trimmable(entry, incoming, cut=False):
            entries.append(("offset", cast(_Trims, entry).offset))  # (not size(): some lack it)
        else:
            meta = getattr(entry, "meta_state", None)
            state = copy_state(entry.state)
            copies.append(state)
            entries.append(("state", (state, meta)))
    mx.eval(copies)  # copied now: the cache's next writes must not reach them
    return Snapshot(entries)


def restore(cache: Sequence[CacheEntry], snap: Snapshot, reuse: bool = False) -> None:
    """Put the cache back to `snap`. With `reuse` the snapshot may be restored again later, so
    the cache gets copies of its own (it writes into its buffers in place)."""
    for entry, saved in zip(cache, snap.entries, strict=True):
        if saved[0] == "offset":
            _trim_entry(entry, cast(_Trims, entry).offset - saved[1])
        else:
            state, meta = saved[1]
            entry.state = copy_state(state) if reuse else state
            if meta is not None:
                cast(_HasMeta, entry).meta_state = meta


def rollback(cache: Sequence[CacheEntry], snap: Snapshot | None, dropped: int,
             replay: Callable[[int], None], keep: int) -> None:
    """Forget the last `dropped` entries of a call that appended keep + dropped: trim where the
    cache can (`snap` is None), else restore the state from before the call (recurrent state
    cannot be trimmed) and `replay(keep)` the entries that were kept."""
    if dropped <= 0:
        return
    if snap is None:
        trim(cache, dropped)
        return
    restore(cache, snap)
    if keep:
        replay(keep)
