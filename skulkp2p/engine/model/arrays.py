"""Arrays a loaded module holds, made concrete on the thread that loaded it."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def leaves(tree: object) -> list[mx.array]:
    """The arrays of a nested tree of parameters or state (lists, tuples, dicts), in
    mlx.utils.tree_flatten's order."""
    # tree_flatten's return type allows the dict it gives only when passed one to fill
    flat = cast(list[tuple[str, object]], tree_flatten(tree))
    return [v for _, v in flat if isinstance(v, mx.array)]


def materialize(module: nn.Module) -> None:
    """Evaluate every array the module holds, its parameters and the arrays it keeps outside
    them (names starting with `_`, such as a RoPE's precomputed `_freqs`). MLX binds a lazy
    array to the stream of the thread that built it: one left lazy at load time cannot be
    evaluated by the request threads that run the model later ("There is no Stream(cpu, 1) in
    current thread")."""
    arrays: list[mx.array] = []
    seen: set[int] = set()

    def walk(obj: object) -> None:
        if isinstance(obj, mx.array):
            arrays.append(obj)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)
        if isinstance(obj, nn.Module):
            for value in vars(obj).values():
                walk(value)

    walk(module)
    mx.eval(arrays)
