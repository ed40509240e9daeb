"""Cache checkpoint and rollback for every cache type mlx-lm builds: the one place these rules
live (the trunk's forward, every ring stage and the draft model use them).

Plain KV caches trim; a rotating (sliding-window) cache fed several tokens at once is cut back at
the end of its time-ordered buffer. Caches that cannot trim (recurrent state of gated-delta
layers, rotating caches fed one token that have wrapped or may wrap) are snapshotted before the
call and restored on rejection; the caller then re-runs the tokens it kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# Cache types whose trim(n) is exact however far back it goes. A RotatingKVCache trims only until
# it wraps, a ChunkedKVCache only back to its last front trim.
_EXACT_TRIM = ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")


def _cuts_after_concat(entry: Any, incoming: int | None) -> bool:
    """A rotating cache fed several entries at once (mlx-lm's `_update_concat`) holds them in a
    buffer in time order after the max_size - 1 entries before them, evicting nothing it still
    needs: cutting up to incoming - 1 entries off that buffer's end (a verify keeps its first
    token) undoes them exactly, wrapped or not (a sliding-window target, e.g. Gemma, then rolls
    back a verify without a snapshot; cutting more raises, see _trim_entry)."""
    return (type(entry).__name__ == "RotatingKVCache" and incoming is not None and incoming > 1
            and getattr(entry, "keep", 0) == 0)


def _trim_entry(entry: Any, n: int) -> None:
    keys = getattr(entry, "keys", None)
    if (type(entry).__name__ == "RotatingKVCache" and keys is not None
            and entry._idx == keys.shape[2]):  # noqa: SLF001
        # The buffer is in time order (after a multi-entry update): cut its end, so that it
        # stays in time order (mlx-lm's own trim only moves the write position). It must keep
        # a whole window: mlx-lm's next one-token update cannot grow a wrapped buffer.
        if keys.shape[2] - n < min(entry.max_size, entry.offset - n):
            raise ValueError(f"cannot cut {n} entries off a rotating cache of "
                             f"{keys.shape[2]} (window {entry.max_size})")
        entry.keys = keys[..., : keys.shape[2] - n, :]
        entry.values = entry.values[..., : keys.shape[2] - n, :]
        entry.offset -= n
        entry._idx -= n  # noqa: SLF001
        return
    entry.trim(n)


def _trimmable(entry: Any, incoming: int | None = 0, cut: bool = True) -> bool:
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
    return max_size is None or entry.offset + incoming < max_size


def exactly_trimmable(cache: list[Any]) -> bool:
    """Every entry trims back any distance: rewinds never need a snapshot."""
    return all(_trimmable(c, None) for c in cache)


def needs_snapshot(cache: list[Any], incoming: int | None) -> bool:
    return not all(_trimmable(c, incoming) for c in cache)


def trim(cache: list[Any], n: int) -> None:
    for entry in cache:
        _trim_entry(entry, n)


def copy_state(value: Any) -> Any:
    """A deep copy of a cache's state: caches write into their buffers in place, so a snapshot
    needs arrays of its own."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    return value


@dataclass
class Snapshot:
    entries: list[tuple[str, Any]]  # ("offset", n) for trimmable entries, ("state", (state, meta))


def snapshot(cache: list[Any], incoming: int | None) -> Snapshot:
    """The cache's state before `incoming` more entries (None: any number) are appended: offsets
    of the entries that can trim back over them, copies of every other entry's state."""
    entries: list[tuple[str, Any]] = []
    copies = []
    for entry in cache:
        # A snapshot is restored by undoing the whole call, which a cut cannot do for a
        # wrapped rotating cache (it keeps only a window before the new entries): copy those.
        if _trimmable(entry, incoming, cut=False):
            entries.append(("offset", entry.offset))  # (not size(): some types lack it)
        else:
            meta = getattr(entry, "meta_state", None)
            state = copy_state(entry.state)
            copies.append(state)
            entries.append(("state", (state, meta)))
    mx.eval(copies)  # copied now: the cache's next writes must not reach them
    return Snapshot(entries)


def restore(cache: list[Any], snap: Snapshot, reuse: bool = False) -> None:
    """Put the cache back to `snap`. With `reuse` the snapshot may be restored again later, so
    the cache gets copies of its own (it writes into its buffers in place)."""
    for entry, (kind, value) in zip(cache, snap.entries, strict=True):
        if kind == "offset":
            _trim_entry(entry, entry.offset - value)
        else:
            state, meta = value
            entry.state = copy_state(state) if reuse else state
            if meta is not None:
                entry.meta_state = meta


def rollback(cache: list[Any], snap: Snapshot | None, dropped: int,
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
