"""Cache rollback for every cache type mlx-lm builds.

Plain KV caches trim. Caches that cannot trim (recurrent state of gated-delta layers, rotating
caches that have wrapped) are snapshotted before a multi-token verify and restored on rejection;
the caller then re-runs the tokens it kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


def _trimmable(entry: Any, incoming: int = 0) -> bool:
    """Whether `incoming` more tokens can be appended and later trimmed off again. A rotating
    (sliding-window) cache trims only while nothing has wrapped: if the append would wrap it, the
    evicted entries could not come back on a trim, so it needs a snapshot instead."""
    if not (hasattr(entry, "is_trimmable") and entry.is_trimmable()):
        return False
    max_size = getattr(entry, "max_size", None)
    return max_size is None or entry.offset + incoming < max_size


def needs_snapshot(cache: list[Any], incoming: int) -> bool:
    return not all(_trimmable(c, incoming) for c in cache)


def trim(cache: list[Any], n: int) -> None:
    for entry in cache:
        entry.trim(n)


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
    tokens_for_replay: list[int]


def snapshot(cache: list[Any], tokens: list[int]) -> Snapshot:
    entries: list[tuple[str, Any]] = []
    for entry in cache:
        if _trimmable(entry, len(tokens)):
            entries.append(("offset", entry.size()))
        else:
            meta = getattr(entry, "meta_state", None)
            entries.append(("state", (copy_state(entry.state), meta)))
    return Snapshot(entries, list(tokens))


def restore(cache: list[Any], snap: Snapshot) -> None:
    for entry, (kind, value) in zip(cache, snap.entries, strict=True):
        if kind == "offset":
            entry.trim(entry.size() - value)
        else:
            state, meta = value
            entry.state = state
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
