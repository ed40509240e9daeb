"""One forward with some modules' attribute replaced: a layer's rope for a tree's positions, its
MLP packed to the real tokens, the body's final norm bypassed. mlx builds the graph while the
forward runs, so the swap only has to last the call; it is undone even when the call raises.
The caller holds the model's lock: nothing else builds a graph on these modules meanwhile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator


@contextlib.contextmanager
def swapped(owners: Iterable[object], name: str, make: Callable[..., object]
            ) -> Iterator[None]:
    """Each owner's `name` is `make(its current value)` inside; the old values come back after.
    (`make` takes the module it replaces, of the type the caller knows it to be.)"""
    saved: list[tuple[object, object]] = []
    try:
        for owner in owners:
            old = getattr(owner, name)
            saved.append((owner, old))
            setattr(owner, name, make(old))
        yield
    finally:
        for owner, old in saved:
            setattr(owner, name, old)
